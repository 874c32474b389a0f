"""The kopf handlers: small, each one call into the reconciler (`kopf run -m tunewright_operator.handlers`).

kopf keeps its bookkeeping in annotations, so the FineTuneJob's status has one writer: the reconciler.
Run one replica (the chart's Deployment uses `Recreate`): two operators would both reconcile; kopf's
peering can stand guard against a second one but is not leader election.
"""

from __future__ import annotations

import importlib.metadata
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
    check_crds(memo.cluster)
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
    memo.pools_stop = threading.Event()
    threading.Thread(target=rediscover_pools, args=(memo.cluster, memo.pools_stop), name="pool-discovery",
                     daemon=True).start()


def check_crds(cluster: k8s.Cluster) -> None:
    """Run only on CRDs that take what this operator writes: on others the API server would refuse or prune
    its status (and kopf re-run handlers whose progress was pruned). Missing ones are waited for (a GitOps
    sync may bring them after the operator); incompatible ones stop it, naming the fields and the fix."""
    try:
        installed = [crd for name in (c["metadata"]["name"] for c in crds.crds().values())
                     if (crd := cluster.get("CustomResourceDefinition", None, name))]
    except k8s.KubernetesError as error:
        if error.status != 403:
            raise kopf.TemporaryError(f"reading the CRDs to check them: {error}", delay=15) from error
        # an install without the chart's grant to read them: say so, go on
        logging.getLogger(__name__).warning("the CRDs were not checked against this release's: %s", error)
        return
    if missing := crds.missing_crds(installed):
        raise kopf.TemporaryError(f"waiting for the CRDs {', '.join(missing)} to be installed: {apply_crds()}",
                                  delay=30)
    if wrong := crds.incompatible_crds(installed):
        raise kopf.PermanentError(f"{'; '.join(wrong)}: {apply_crds()}; the operator starts once they are")


def apply_crds() -> str:
    try:
        version = f" --version {importlib.metadata.version('tunewright')}"
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return (f"apply this release's CRDs (`helm show crds CHART{version} | kubectl apply --server-side "
            f"--force-conflicts -f -`, CHART being what you install: the repository's tunewright chart, a folder "
            f"or a .tgz; Helm installs CRDs once and never upgrades them)")


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
def gpupool_discovery(body: kopf.Body, memo: kopf.Memo, **_) -> None:
    discover_pool(memo.cluster, dict(body))


@kopf.on.cleanup()
def stop_pool_discovery(memo: kopf.Memo, **_) -> None:
    if stop := memo.get("pools_stop"):  # absent when startup stopped before making it
        stop.set()


def discover_pool(cluster: k8s.Cluster, gpupool: dict) -> None:
    spec = GPUPoolSpec.model_validate(gpupool["spec"])
    nodes = cluster.list("Node", None, label_selector=pools.selector(spec) or None)
    status = pools.discovered(spec, nodes, gpupool["metadata"].get("generation"))
    cluster.patch_status("GPUPool", None, gpupool["metadata"]["name"],
                         status.model_dump(by_alias=True, mode="json", exclude_none=True))


def rediscover_pools(cluster: k8s.Cluster, stop: threading.Event, interval: float = DISCOVERY_SECONDS) -> None:
    """Every pool's nodes read again each `interval` (nodes come and go while pools stay as they are), until
    `stop`. One loop rather than kopf's per-pool timer: a timer puts kopf's finalizer on every GPUPool, and
    `helm uninstall` removes the operator before the pools it made, which would then hang in Terminating
    (kopf takes the finalizer off pools that have it, as no handler needs it now)."""
    log = logging.getLogger(__name__)
    while not stop.wait(interval):
        try:
            found = cluster.list("GPUPool")
        except Exception as error:  # an API server away or refusing for a while: the loop must outlive it
            log.warning("GPUPools not listed for discovery (tried again in %.0f s): %s", interval, error)
            continue
        for gpupool in found:
            try:
                discover_pool(cluster, gpupool)
            except Exception:  # one pool's failure must not end the others' discovery
                log.exception("GPUPool %s: node discovery failed", gpupool["metadata"]["name"])
