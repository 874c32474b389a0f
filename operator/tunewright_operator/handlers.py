"""The kopf handlers: small, each one call into the reconciler (`kopf run -m tunewright_operator.handlers`).

kopf keeps its bookkeeping in annotations, so the FineTuneJob's status has one writer: the reconciler.
Run one replica (the chart's Deployment uses `Recreate`): two operators would both reconcile; kopf's
peering can stand guard against a second one but is not leader election.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import UTC, datetime

import kopf

from tunewright_core import crds, k8s, pools
from tunewright_core.names import JOB_LABEL
from tunewright_core.spec import TERMINAL_PHASES, GPUPoolSpec
from tunewright_operator.api_client import ApiSummaries
from tunewright_operator.manifests import ClusterSettings
from tunewright_operator.reconcile import clean_up, reconcile

FINETUNEJOBS = ("tunewright.dev", "v1alpha1", "finetunejobs")
GPUPOOLS = ("tunewright.dev", "v1alpha1", "gpupools")
MIRROR_SECONDS = 15.0  # how often a live job's RayJob is read back (RayJob events also wake it at once)
DISCOVERY_SECONDS = 60.0
MIN_JOB_TOKEN_KEY = 32


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_) -> kopf.ConnectionInfo:
    """In-cluster credentials, else the kubeconfig KUBECONFIG names, read now (not when a module was
    imported), through the Kubernetes client: its auth plugins (exec, e.g. EKS and GKE) included."""
    from kubernetes import client

    k8s.load_credentials()
    config = client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _sep, token = (header or "").rpartition(" ")  # (`_` is the handler's **kwargs)
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None, scheme=scheme or None,
        token=token or None, certificate_path=config.cert_file, private_key_path=config.key_file,
        trust_env=settings.networking.trust_env)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.tunewright.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.tunewright.dev")
    settings.persistence.finalizer = "tunewright.dev/cleanup"
    settings.posting.level = logging.WARNING  # the reconciler posts the events users read
    k8s.load_credentials()
    memo.cluster = k8s.KubernetesCluster()
    refuse_other_crds(memo.cluster)
    memo.locks = {}
    job_token_key = os.environ.get("TUNEWRIGHT_JOB_TOKEN_KEY", "")
    if len(job_token_key) < MIN_JOB_TOKEN_KEY:  # the chart makes one (kept across upgrades) in a Secret of its own
        raise kopf.PermanentError(f"TUNEWRIGHT_JOB_TOKEN_KEY: set it to a random string of at least "
                                  f"{MIN_JOB_TOKEN_KEY} characters: each job's telemetry token is derived from it")
    memo.settings = ClusterSettings(
        job_token_key=job_token_key.encode(),
        api_url=os.environ.get("TUNEWRIGHT_API_URL", "http://tunewright-api:8000"),
        ttl_seconds_after_finished=int(os.environ.get("TUNEWRIGHT_TTL_SECONDS_AFTER_FINISHED", "600")),
        default_checkpoint_storage=os.environ.get("TUNEWRIGHT_DEFAULT_CHECKPOINT_STORAGE") or None)
    memo.summaries = ApiSummaries(memo.settings)


def refuse_other_crds(cluster: k8s.Cluster) -> None:
    """Run only on this release's CRDs: on another's, the API server would prune or refuse the status this
    operator writes (and kopf re-run handlers whose progress was pruned), so stop with the fix instead."""
    try:
        installed = [crd for name in crds.crd_names() if (crd := cluster.get("CustomResourceDefinition", None, name))]
    except k8s.KubernetesError as error:  # an install without the chart's grant to read them: say so, go on
        logging.getLogger(__name__).warning("the CRDs were not checked against this release's: %s", error)
        return
    if stale := crds.stale_crds(installed):
        raise kopf.PermanentError(
            f"{'; '.join(stale)}: apply this release's CRDs (`kubectl apply --server-side -f "
            f"charts/tunewright/crds/` from the chart of this operator's version; Helm installs CRDs once and "
            f"never upgrades them); the operator starts once they are")


def _reconcile(body: kopf.Body | dict, memo: kopf.Memo, logger) -> None:
    """One reconcile of a job at a time (the create handler, the timer and RayJob events run concurrently),
    on the job as it is now rather than as the event that woke us saw it."""
    meta = body["metadata"]
    with memo.locks.setdefault(meta["uid"], threading.Lock()):
        job = memo.cluster.get("FineTuneJob", meta["namespace"], meta["name"])
        if job is None or job["metadata"]["uid"] != meta["uid"]:
            return  # deleted (or re-created under the same name: that one has its own events)
        outcome = reconcile(job, memo.cluster, memo.settings, datetime.now(UTC), memo.get("summaries"))
    logger.info("%s: %s (%s)", outcome.phase, outcome.reason, outcome.message[:200])


@kopf.on.resume(*FINETUNEJOBS)
@kopf.on.create(*FINETUNEJOBS)
@kopf.on.update(*FINETUNEJOBS, field="spec")
def finetunejob_changed(body: kopf.Body, memo: kopf.Memo, logger, **_) -> None:
    _reconcile(body, memo, logger)


@kopf.timer(*FINETUNEJOBS, interval=MIRROR_SECONDS, initial_delay=MIRROR_SECONDS,
            when=lambda status, **_: status.get("phase") not in TERMINAL_PHASES)
def finetunejob_mirror(body: kopf.Body, memo: kopf.Memo, logger, **_) -> None:
    _reconcile(body, memo, logger)


@kopf.on.event("ray.io", "v1", "rayjobs", labels={JOB_LABEL: kopf.PRESENT})
def rayjob_changed(body: kopf.Body, memo: kopf.Memo, logger, **_) -> None:
    """KubeRay wrote the RayJob's status: mirror it into its FineTuneJob now, not at the next timer."""
    for owner in body["metadata"].get("ownerReferences", []):
        if owner.get("kind") == "FineTuneJob":
            _reconcile({"metadata": {"namespace": body["metadata"]["namespace"], "name": owner["name"],
                                     "uid": owner["uid"]}}, memo, logger)


@kopf.on.delete(*FINETUNEJOBS)
def finetunejob_deleted(body: kopf.Body, memo: kopf.Memo, logger, **_) -> None:
    logger.info("deleted: %s", ", ".join(clean_up(dict(body), memo.cluster)) or "nothing was created")


@kopf.on.resume(*GPUPOOLS)
@kopf.on.create(*GPUPOOLS)
@kopf.on.update(*GPUPOOLS, field="spec")
@kopf.timer(*GPUPOOLS, interval=DISCOVERY_SECONDS)
def gpupool_discovery(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    spec = GPUPoolSpec.model_validate(body["spec"])
    nodes = memo.cluster.list("Node", None, label_selector=pools.selector(spec) or None)
    status = pools.discovered(spec, nodes, body["metadata"].get("generation"))
    memo.cluster.patch_status("GPUPool", None, body["metadata"]["name"],
                              status.model_dump(by_alias=True, mode="json", exclude_none=True))
