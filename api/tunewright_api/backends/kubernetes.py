"""The kubernetes backend: a job is a FineTuneJob in its tenant's namespace, run by the operator.

Tenant → namespace: `<prefix><tenant>` (prefix `TUNEWRIGHT_KUBERNETES_NAMESPACE_PREFIX`, default `tw-`),
labelled `tunewright.dev/tenant=<tenant>`: the API creates it so when the tenant first submits, and refuses
one that exists unlabelled (an administrator hands a namespace to a tenant by labelling it). Every
FineTuneJob in such a namespace is that tenant's job, whoever created it: one made with kubectl appears
in the tenant's job list under the id the operator also uses (`job_id_of`).

One writer per field. The operator alone writes FineTuneJob status; the API writes the spec (creating the
job, suspending it to cancel) and its own database. The API follows each FineTuneJob's phase into the job's
status and events; progress, metrics and checkpoints reach the API from the workers as telemetry records,
as on the local backend. The workers' token is made by the operator (a Secret the API never reads): the API
trusts the sha256 the operator annotates on the FineTuneJob, only for a job of the namespace's tenant.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from urllib3.exceptions import HTTPError as TransportError

from tunewright_api.backends import AlreadyFinished, Planned, Ticker
from tunewright_api.errors import ApiError
from tunewright_api.models import ClusterRef, Job, StoredFile, Tenant, add_event, now
from tunewright_api.services.plans import (
    efficiency_learnt,
    learn_efficiency,
    learn_links,
    plan_on,
    profile_for,
)
from tunewright_api.settings import Settings
from tunewright_api.states import TERMINAL
from tunewright_core.k8s import AlreadyExists, KubernetesCluster, KubernetesError, load_credentials
from tunewright_core.names import (
    DATASET_BYTES_ANNOTATION,
    JOB_ID_ANNOTATION,
    MODEL_SHAPE_ANNOTATION,
    PLAN_ANNOTATION,
    TENANT_LABEL,
    TOKEN_HASH_ANNOTATION,
    job_id_of,
)
from tunewright_core.plan_of_record import plan_annotation
from tunewright_core.planner.hardware import Pool
from tunewright_core.planner.jobs import dataset_tokens_of
from tunewright_core.planner.models import hf_config, lookup
from tunewright_core.pools import (
    ResolvedPool,
    learns_efficiency,
    learnt_links,
    measured_links_of,
    resolve_pool,
    status_as_read,
    teaches,
)
from tunewright_core.spec import (
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPoolSpec,
    JobPlan,
    MeasuredEfficiency,
    MeasuredLinks,
)
from tunewright_core.status import CONDITION_OF_PHASE
from tunewright_core.storage import NotRunnable, check_runnable

log = logging.getLogger(__name__)
MANAGED_BY = {"app.kubernetes.io/managed-by": "tunewright-api"}
# a FineTuneJob missing from this many complete listings in a row, for a job recorded at least this long ago,
# was deleted
VANISHED_AFTER_SYNCS, VANISHED_AFTER_SECONDS = 3, 5.0
LOG_CONTAINER = "ray-head"  # the Ray driver runs the training job's entrypoint on the head
STATUS_OF_PHASE = {"Pending": "queued", "Planned": "queued", "Queued": "queued", "Suspended": "queued",
                   "Running": "running", "Succeeded": "succeeded", "Failed": "failed", "Cancelled": "cancelled"}


def tenant_namespace(prefix: str, tenant: str) -> str:
    namespace = f"{prefix}{tenant}"
    if len(namespace) > 63:
        raise ApiError(422, f"tenant {tenant!r} with the namespace prefix {prefix!r} makes a namespace name over 63 "
                            "characters: use a shorter tenant name or prefix", "tenant", "invalid_value")
    return namespace


def tenant_of_namespace(prefix: str, namespace: str) -> str | None:
    return namespace.removeprefix(prefix) if namespace.startswith(prefix) and len(namespace) > len(prefix) else None


def finetunejob_for(job: Job, spec: FineTuneJobSpec, namespace: str, train: StoredFile, planned: Planned) -> dict:
    """The FineTuneJob the API creates for a job (pure): with its plan of record, which the operator adopts,
    and the model's shape when the operator's catalog lacks it (the API read its config.json), for a plan
    made again after a change."""
    annotations = {JOB_ID_ANNOTATION: job.id, DATASET_BYTES_ANNOTATION: str(train.bytes),
                   PLAN_ANNOTATION: plan_annotation(spec, planned.plan.pool, planned.pool, planned.plan)}
    if lookup(spec.model.source) is None and planned.profile is not None:
        annotations[MODEL_SHAPE_ANNOTATION] = json.dumps(hf_config(planned.profile), sort_keys=True)
    return {"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": job.id, "namespace": namespace, "labels": dict(MANAGED_BY),
                         "annotations": annotations},
            "spec": spec.model_dump(by_alias=True, mode="json", exclude_none=True)}


@dataclass(frozen=True)
class Observed:
    """What the API takes from a FineTuneJob (pure: `observed`)."""

    phase: str | None
    status: str
    reason: str
    message: str
    plan: JobPlan | None
    started: bool  # its RayJob exists: the spec can no longer change what runs
    started_at: datetime | None
    finished_at: datetime | None
    token_hash: str


STATUS_FIELDS = {field.alias or name for name, field in FineTuneJobStatus.model_fields.items()}


def observed(ftj: dict) -> Observed:
    raw = ftj.get("status") or {}
    try:  # what this API knows of the status: a field a newer operator adds is no reason to stop following
        status = FineTuneJobStatus.model_validate({k: v for k, v in raw.items() if k in STATUS_FIELDS})
    except ValidationError:
        status = FineTuneJobStatus(phase=raw.get("phase") if raw.get("phase") in STATUS_OF_PHASE else None)
    phase = status.phase or "Pending"
    kind, truth = CONDITION_OF_PHASE[phase]  # the condition the operator sets for this phase
    condition = next((c for c in status.conditions if (c.type, c.status) == (kind, truth)), None)
    return Observed(
        phase=status.phase, status=STATUS_OF_PHASE[phase],
        reason=condition.reason if condition else ("Submitted" if status.phase is None else phase),
        message=condition.message if condition else "waiting for the operator",
        plan=status.plan,
        started=bool(status.ray_job_name), started_at=status.start_time, finished_at=status.completion_time,
        token_hash=(ftj["metadata"].get("annotations") or {}).get(TOKEN_HASH_ANNOTATION, ""))


class KubernetesBackend:
    runs_here = False  # the workers fetch models with their own cache and network

    def __init__(self, settings: Settings, engine: Engine, cluster=None):
        self.settings, self.engine = settings, engine
        self.prefix = settings.kubernetes_namespace_prefix
        self.cluster = cluster
        self._lock = threading.Lock()
        self._follower = Ticker("tunewright-kubernetes-backend", self.sync, settings.kubernetes_sync_seconds,
                                at_once=True)

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.cluster is None:
            load_credentials()
            self.cluster = KubernetesCluster(component="tunewright-api")
        self._follower.start()

    def stop(self) -> None:
        self._follower.stop(timeout=10)

    # --- pools and plans -----------------------------------------------------------------------------
    def pools(self) -> list[dict]:
        return [{"object": "pool", "name": p["metadata"]["name"], **p["spec"], "status": status_as_read(p)}
                for p in sorted(self.cluster.list("GPUPool"), key=lambda p: p["metadata"]["name"])]

    def pool(self, name: str) -> Pool | None:
        found = self.cluster.get("GPUPool", None, name)
        return ResolvedPool.of(found).planner_pool() if found else None

    def plan(self, spec: FineTuneJobSpec, train: StoredFile) -> Planned:
        """The job's plan of record, on the pool the operator would resolve: written onto the FineTuneJob,
        where the operator adopts it."""
        resolved = resolve_pool(spec, self.cluster)
        if resolved.spec is None:
            raise ApiError(422, resolved.why_not, "resources.pool", "unknown_pool")
        profile = profile_for(spec.model.source, param="model.source")
        plan = plan_on(spec=spec, profile=profile, pool=resolved.planner_pool(),
                       dataset_tokens=dataset_tokens_of(train.bytes), spec_param=None)
        return Planned(plan, profile, resolved.spec)

    def learn_links(self, session: Session, job: Job, transfer_seconds: float, at: float) -> str | None:
        """Fold a window's measured transfer into the GPUPool the job was planned on, where it learns its
        links: a merge patch of status.measuredLinks, which the operator's discovery leaves alone. Two
        windows folded at once may lose one of them (a running mean of 50: a small loss, no lock taken)."""
        plan = job.plan
        if plan is None or not teaches(plan):
            return None
        try:
            found = self.cluster.get("GPUPool", None, plan.pool)
            if found is None:  # a pool described to the API, not a GPUPool
                return learn_links(session, job, transfer_seconds, at)
            spec = GPUPoolSpec.model_validate(found["spec"])
            if not spec.learn_links:
                return None
            measured = measured_links_of(found)
            learnt = learnt_links(plan, plan.pool, spec.intra_node, spec.inter_node,
                                  measured.model_dump(by_alias=True, exclude_none=True) if measured else {},
                                  transfer_seconds, job.id, at)
            if learnt is None:
                return None
            links, said = learnt
            self.cluster.patch_status("GPUPool", None, plan.pool,
                                      {"measuredLinks": MeasuredLinks.model_validate(links).model_dump(
                                          by_alias=True, mode="json", exclude_none=True)})
        except (KubernetesError, ValidationError, OSError, TransportError) as err:
            # what a pool learns never costs the job its telemetry (e.g. a chart older than the learning,
            # whose RBAC cannot patch GPUPool status): said in the API's log, the batch goes on
            log.warning("pool %s did not learn from job %s's profiler window: %s", plan.pool, job.id, err)
            return None
        return said

    def learn_efficiency(self, session: Session, job: Job, step_seconds: float, exposed_comm_seconds: float,
                         at: float) -> str | None:
        """Fold a window's measured compute into the GPUPool the job was planned on, where it learns: a merge
        patch of status.measuredEfficiency (as learn_links does with status.measuredLinks)."""
        plan = job.plan
        if plan is None or not learns_efficiency(plan):
            return None
        try:
            found = self.cluster.get("GPUPool", None, plan.pool)
            if found is None:  # a pool described to the API, not a GPUPool
                return learn_efficiency(session, job, step_seconds, exposed_comm_seconds, at)
            pool = ResolvedPool.of(found)
            if pool.spec is None or not pool.spec.learn_links:
                return None
            measured = pool.efficiency.model_dump(by_alias=True) if pool.efficiency else None
            learnt = efficiency_learnt(job, plan.pool, pool.spec.gpu, measured, pool.planner_pool(), step_seconds,
                                       exposed_comm_seconds, at)
            if learnt is None:
                return None
            efficiency, said = learnt
            written = MeasuredEfficiency.model_validate(efficiency).model_dump(by_alias=True, mode="json",
                                                                               exclude_none=True)
            # a merge patch keeps keys it does not name: those of a record of the earlier form are removed
            before = (found.get("status") or {}).get("measuredEfficiency") or {}
            written = {**dict.fromkeys(before.keys() - written.keys()), **written}
            self.cluster.patch_status("GPUPool", None, plan.pool, {"measuredEfficiency": written})
        except (KubernetesError, ValidationError, OSError, TransportError) as err:
            log.warning("pool %s did not learn from job %s's profiler window: %s", plan.pool, job.id, err)
            return None
        return said

    # --- the work ------------------------------------------------------------------------------------
    def submit(self, session: Session, job: Job, spec: FineTuneJobSpec, planned: Planned, train: StoredFile,
               validation: StoredFile | None, telemetry_token: str) -> None:
        """The tenant's namespace (once) and the FineTuneJob. The workers' token is the operator's."""
        tenant = session.get(Tenant, job.tenant_id)
        namespace = tenant_namespace(self.prefix, tenant.name)
        storage = self.settings.kubernetes_checkpoint_storage
        if spec.checkpoint.storage is None and storage:  # e.g. the OpenAI route, which has no such field
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"storage": storage})})
            job.spec = spec.model_dump(by_alias=True, exclude_none=True)
        try:  # what the operator would refuse (storage and data it cannot mount), refused now
            check_runnable(spec, planned.plan)
        except NotRunnable as err:
            raise ApiError(422, str(err), str(err).split(":", 1)[0], "invalid_value") from None
        existing = self.cluster.get("Namespace", None, namespace)
        if existing is None:
            with contextlib.suppress(AlreadyExists):  # made meanwhile by a concurrent submit
                existing = self.cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                    "name": namespace, "labels": {TENANT_LABEL: tenant.name, **MANAGED_BY}}})
            existing = existing or self.cluster.get("Namespace", None, namespace)
        if (existing["metadata"].get("labels") or {}).get(TENANT_LABEL) != tenant.name:
            raise ApiError(409, f"namespace {namespace} exists but is not labelled {TENANT_LABEL}={tenant.name}: "
                                "an administrator labels it to give it to this tenant", "tenant", "namespace_not_owned")
        self.cluster.create(finetunejob_for(job, spec, namespace, train, planned))
        job.telemetry_token_hash = ""  # until the operator annotates its token's hash
        job.cluster = ClusterRef(namespace=namespace, name=job.id)

    def cancel(self, session: Session, job: Job) -> None:
        """Suspend (the RayJob stops at once and frees its GPUs), then delete the FineTuneJob (its finalizer
        cleans up what the operator made)."""
        with self._lock:
            session.refresh(job)
            if job.status in TERMINAL:
                raise AlreadyFinished(job.status)
            if where := job.cluster:
                self.cluster.patch("FineTuneJob", where.namespace, where.name, {"spec": {"suspend": True}})
                self.cluster.delete("FineTuneJob", where.namespace, where.name)
            job.status, job.finished_at = "cancelled", now()
            add_event(session, job, "cancelled by the user: the FineTuneJob was suspended and deleted")
            session.add(job)
            session.commit()

    def forget(self, job: Job) -> None:
        """Its FineTuneJob, if it is still there (the operator's finalizer cleans up what it made; its volume's
        checkpoints and export stay: the claim is the tenant's)."""
        if where := job.cluster:
            self.cluster.delete("FineTuneJob", where.namespace, where.name)

    def logs(self, job: Job, lines: int) -> list[str]:
        """The Ray driver's output, from the head pod of the job's Ray cluster."""
        where = job.cluster
        ftj = self.cluster.get("FineTuneJob", where.namespace, where.name) if where else None
        ray_job_name = ((ftj or {}).get("status") or {}).get("rayJobName")
        ray_job = self.cluster.get("RayJob", where.namespace, ray_job_name) if ray_job_name else None
        ray_cluster = ((ray_job or {}).get("status") or {}).get("rayClusterName")
        if not ray_cluster:
            return []
        heads = self.cluster.list("Pod", where.namespace,
                                  label_selector=f"ray.io/cluster={ray_cluster},ray.io/node-type=head")
        text = self.cluster.log(where.namespace, heads[0]["metadata"]["name"], LOG_CONTAINER, lines) if heads else None
        return (text or "").splitlines()[-lines:]

    # --- following the FineTuneJobs --------------------------------------------------------------------
    def tenant_namespaces(self) -> dict[str, str]:
        """namespace → tenant: the namespaces labelled with the tenant their name maps to (the API labels
        those it creates; an administrator labels one to hand it to a tenant)."""
        found = {}
        for namespace in self.cluster.list("Namespace", label_selector=TENANT_LABEL):
            name, labels = namespace["metadata"]["name"], namespace["metadata"].get("labels") or {}
            if tenant_of_namespace(self.prefix, name) == labels.get(TENANT_LABEL):
                found[name] = labels[TENANT_LABEL]
        return found

    def sync(self) -> None:
        """Every FineTuneJob of a tenant's namespace into that tenant's job, each in its own transaction;
        a job whose FineTuneJob several complete listings in a row lacked (deleted) is cancelled."""
        tenants = self.tenant_namespaces()
        listed = [ftj for ftj in self.cluster.list("FineTuneJob") if ftj["metadata"]["namespace"] in tenants]
        present = {(ftj["metadata"]["namespace"], ftj["metadata"]["name"]) for ftj in listed}
        for ftj in listed:
            with self._lock, Session(self.engine) as session:
                try:
                    self._follow(session, tenants[ftj["metadata"]["namespace"]], ftj)
                    session.commit()
                except Exception:
                    session.rollback()
                    log.exception("following FineTuneJob %s/%s failed", ftj["metadata"]["namespace"],
                                  ftj["metadata"]["name"])
        with self._lock, Session(self.engine) as session:
            for job in session.exec(select(Job).where(Job.status.not_in(TERMINAL))).all():
                if job.cluster:
                    self._count_absence(session, job, (job.cluster.namespace, job.cluster.name) in present)
            session.commit()

    def _count_absence(self, session: Session, job: Job, present: bool) -> None:
        assert job.cluster is not None, "called for jobs on the cluster"
        missed = 0 if present else job.cluster.missed + 1
        if missed != job.cluster.missed:
            job.cluster = job.cluster.model_copy(update={"missed": missed})
            session.add(job)
        # the FineTuneJob is made before the job's row commits: a listing taken meanwhile lacks it
        if missed >= VANISHED_AFTER_SYNCS and now() - job.created_at > timedelta(seconds=VANISHED_AFTER_SECONDS):
            job.status, job.finished_at = "cancelled", now()
            add_event(session, job, f"its FineTuneJob {job.cluster.namespace}/{job.cluster.name} was deleted",
                      level="warning")

    def _follow(self, session: Session, tenant_name: str, ftj: dict) -> None:
        meta = ftj["metadata"]
        tenant = session.exec(select(Tenant).where(Tenant.name == tenant_name)).first()
        if tenant is None:
            return
        job_id = job_id_of(meta)
        job = session.get(Job, job_id)
        if job is not None and job.tenant_id != tenant.id:
            log.warning("FineTuneJob %s/%s names job %s of another tenant: ignored", meta["namespace"], meta["name"],
                        job_id)
            return
        seen = observed(ftj)
        spec = ftj.get("spec") or {}
        if job is None and meta.get("deletionTimestamp"):
            return  # going away (its job was deleted, or kubectl deleted it before the API saw it)
        if job is None:
            by_api = (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY[
                "app.kubernetes.io/managed-by"]
            age = now() - datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
            if by_api and age < timedelta(seconds=VANISHED_AFTER_SECONDS):
                return  # its submit is committing the job's row now
            job = Job(id=job_id, tenant_id=tenant.id, spec=spec, status="queued", model="")
            add_event(session, job, f"created as FineTuneJob {meta['namespace']}/{meta['name']} " + (
                "(its submit did not complete: adopted)" if by_api else "(kubectl)"))
        if not seen.started:  # until it runs, the FineTuneJob's spec is the job's (kubectl may edit it)
            job.spec = spec
            job.model = str((spec.get("model") or {}).get("source", ""))[:1024]
        job.cluster = (job.cluster or ClusterRef(namespace=meta["namespace"], name=meta["name"])).model_copy(
            update={"namespace": meta["namespace"], "name": meta["name"]})
        if seen.token_hash:
            job.telemetry_token_hash = seen.token_hash
        if seen.plan:
            job.plan = seen.plan
        if job.status not in TERMINAL and (seen.status, seen.reason) != (job.status, job.cluster.reason):
            level = "error" if seen.status == "failed" else "info"
            add_event(session, job, f"{seen.phase or 'Pending'} ({seen.reason}): {seen.message}", level=level)
            job.status = seen.status
            job.cluster = job.cluster.model_copy(update={"reason": seen.reason})
            if seen.status == "failed":
                job.error_code, job.error_message = seen.reason, seen.message
        job.started_at = job.started_at or seen.started_at
        if job.status in TERMINAL:
            job.finished_at = job.finished_at or seen.finished_at or now()
        session.add(job)
