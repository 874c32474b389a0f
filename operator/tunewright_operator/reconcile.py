"""Reconciling a FineTuneJob: validate → resolve its pool → plan → create what runs it → mirror its state.

Written against `Cluster`, the few API-server calls the operator makes (k8s.py implements it with the
Kubernetes client; tests use an in-memory one), so each step can be checked and interrupted. Every step
first looks at what exists, so a reconcile that dies after any write and runs again ends with exactly one
of each object and a consistent status. The operator is the only writer of a FineTuneJob's status.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, cast

from pydantic import ValidationError

from tunewright_core.k8s import AlreadyExists, Cluster
from tunewright_core.names import (
    DATASET_BYTES_ANNOTATION,
    MODEL_SHAPE_ANNOTATION,
    PLAN_ANNOTATION,
    QUEUE_LABEL,
    SPEC_HASH_ANNOTATION,
    TOKEN_HASH_ANNOTATION,
    job_id_of,
)
from tunewright_core.plan_of_record import adopted_plan, spec_hash
from tunewright_core.planner import calibration
from tunewright_core.planner.jobs import dataset_tokens_of, plan_job
from tunewright_core.planner.models import ModelProfile, from_hf_config, lookup
from tunewright_core.planner.search import NoPlan
from tunewright_core.pools import ResolvedPool, resolve_pool
from tunewright_core.spec import (
    TERMINAL_PHASES,
    FineTuneJobSpec,
    FineTuneJobStatus,
    GPUPoolSpec,
    JobPlan,
    JobProgress,
    JobTelemetry,
    described_errors,
)
from tunewright_core.status import (
    CONDITION_OF_PHASE,
    Observation,
    PodProblem,
    held_cost,
    observe,
    pod_problem,
    set_condition,
    with_condition,
)
from tunewright_core.storage import NotRunnable
from tunewright_operator import manifests

MAX_SHAPE_CHARACTERS = 16384


class Summaries(Protocol):
    def __call__(self, target: manifests.Target, token: str) -> dict | None:
        """The API's summary of the job (`status`, `progress`, `telemetry`), None when it has none."""


@dataclass(frozen=True)
class Outcome:
    """What one reconcile decided (for the handler's log; a live job is looked at again by the timer)."""

    phase: str
    reason: str
    message: str


def reconcile(job: dict, cluster: Cluster, settings: manifests.ClusterSettings, now: datetime,
              summaries: Summaries | None = None) -> Outcome:
    meta = job["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
    status = FineTuneJobStatus.model_validate(job.get("status") or {})
    target = manifests.Target(namespace, name, meta["uid"], job_id_of(meta))

    written = status  # what the API server holds

    def settle(observation: Observation, **fields) -> Outcome:
        nonlocal status, written
        updated = status.model_copy(update={
            "phase": observation.phase, "observed_generation": generation,
            "conditions": with_condition(status.conditions, observation, generation, now), **fields})
        if updated != written:
            cluster.patch_status("FineTuneJob", namespace, name,
                                 updated.model_dump(by_alias=True, mode="json", exclude_none=True))
        condition, _ = CONDITION_OF_PHASE[observation.phase]
        before = next((c for c in status.conditions if c.type == condition), None)
        if observation.phase != status.phase or before is None or before.reason != observation.reason:
            warning = observation.phase == "Failed" or observation.reason in ("Unschedulable", "ImagePullBackOff")
            cluster.event(job, "Warning" if warning else "Normal", observation.reason, observation.message)
        status = written = updated
        return Outcome(observation.phase, observation.reason, observation.message)

    if status.phase in TERMINAL_PHASES:
        if status.observed_generation in (None, generation):
            return Outcome(status.phase, "Finished", "nothing to do")
        ended = status.model_copy(update={"observed_generation": generation, "conditions": spec_applied(
            job, cluster, status, False, "JobEnded", f"the job has ended ({status.phase}): a changed spec runs "
            "nothing; create a new FineTuneJob (or delete and re-create this one) to run it", generation, now)})
        cluster.patch_status("FineTuneJob", namespace, name, ended.model_dump(by_alias=True, mode="json",
                                                                             exclude_none=True))
        return Outcome(status.phase, "JobEnded", "a spec change after the end was said, not applied")
    if meta.get("deletionTimestamp"):  # being deleted: create nothing more (the finalizer cleans up)
        return Outcome(status.phase or "Pending", "Deleting", "the job is being deleted")
    try:
        spec = FineTuneJobSpec.model_validate(job.get("spec") or {})
    except ValidationError as err:
        where, what = described_errors(err.errors(), FineTuneJobSpec)[0]
        return settle(Observation("Failed", "InvalidSpec", f"spec{'.' if where else ''}{where}: {what}"))

    ray_job = cluster.get("RayJob", namespace, manifests.ray_job_name(target))
    plan = status.plan
    if ray_job is None:
        replan = plan is None or status.observed_generation != generation  # (re)plan until something runs
        resolved = resolve_pool(spec, cluster, None if replan or plan is None else plan.pool)
        pool_name, pool = resolved.name, resolved.spec
        if pool is None:
            return settle(Observation("Pending", "PoolNotFound", resolved.why_not))
        assert pool_name is not None  # resolve_pool names every pool it finds
        if replan:
            try:  # the API's plan of record when it was made for this spec on this pool, else our own
                plan = (adopted_plan((meta.get("annotations") or {}).get(PLAN_ANNOTATION), spec, pool_name, pool)
                        or plan_on_pool(spec, resolved, job))
            except (NoPlan, ValueError) as err:
                return settle(Observation("Failed", "NoPlan", str(err)))
            settle(Observation("Planned", "Planned", plan.explanation), plan=plan)
        assert plan is not None  # planned just now, or kept (replan is false only with a plan)
        try:
            ray_job = create_run(cluster, job, target, spec, plan, pool, settings)
        except NotRunnable as err:
            return settle(Observation("Failed", "InvalidSpec", str(err)))
    else:
        if ray_job["spec"].get("suspend", False) != (desired := wants_suspend(spec, ray_job)):
            cluster.patch("RayJob", namespace, ray_job["metadata"]["name"], {"spec": {"suspend": desired}})
        status = status.model_copy(update={"conditions": note_spec_changes(job, ray_job, spec, cluster, status,
                                                                          generation, now)})

    ray_status = ray_job.get("status") or {}
    observation = observe(ray_status, suspend_requested=spec.suspend, backoff_limit=spec.resources.max_retries,
                          pod_problem=pod_problem_of(cluster, namespace, ray_status))
    start = kubernetes_time(ray_status.get("startTime")) or status.start_time
    end = kubernetes_time(ray_status.get("endTime")) if observation.phase in TERMINAL_PHASES else None
    progress, telemetry = measured_by_api(summaries, settings, target, status)
    return settle(observation, ray_job_name=ray_job["metadata"]["name"],
                  dashboard_url=ray_status.get("dashboardURL") or status.dashboard_url,
                  start_time=start, completion_time=end, progress=progress,
                  telemetry=with_held_cost(telemetry, plan, cluster, start, end or now))


def measured_by_api(summaries: Summaries | None, settings: manifests.ClusterSettings, target: manifests.Target,
                    status: FineTuneJobStatus) -> tuple[JobProgress | None, JobTelemetry | None]:
    """Progress and measured telemetry as the API summarizes the runtime's records (what `tunewright get`
    shows); what the status had when the API has nothing (yet) or cannot be reached. Cost stays ours."""
    found = summaries(target, manifests.job_token(settings, target)) if summaries else None
    if found is None:  # the API has nothing (yet) or cannot be reached
        return status.progress, status.telemetry
    try:
        progress = JobProgress.model_validate(found["progress"])
        telemetry = JobTelemetry.model_validate(found["telemetry"])
    except (TypeError, KeyError, ValidationError):
        return status.progress, status.telemetry
    return progress, telemetry.model_copy(update={"cost_usd": status.telemetry.cost_usd if status.telemetry else None})


def with_held_cost(telemetry: JobTelemetry | None, plan: JobPlan | None, cluster: Cluster, start: datetime | None,
                   end: datetime) -> JobTelemetry | None:
    """The telemetry with `costUSD` as the GPUs held so far cost at the planned pool's price (kept as it
    was when the pool is gone)."""
    pool = cluster.get("GPUPool", None, plan.pool) if plan and start else None
    if pool is None or plan is None:  # (a pool is read only with a plan)
        return telemetry
    cost = held_cost(plan.gpus, GPUPoolSpec.model_validate(pool["spec"]).price_per_gpu_hour, start, end)
    return (telemetry or JobTelemetry()).model_copy(update={"cost_usd": cost})


def kubernetes_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


SPEC_APPLIED = "SpecApplied"


def note_spec_changes(job: dict, ray_job: dict, spec: FineTuneJobSpec, cluster: Cluster,
                      status: FineTuneJobStatus, generation: int, now: datetime) -> list:
    """A running job takes only `suspend` from its spec: any other change is said (a condition and one
    Warning event), not silently ignored. Returns the conditions to write."""
    applied = ray_job["metadata"].get("annotations", {}).get(SPEC_HASH_ANNOTATION) == spec_hash(spec)
    if applied:
        return spec_applied(job, cluster, status, True, "Applied", "the running job matches its spec", generation, now)
    return spec_applied(job, cluster, status, False, "SpecChangeIgnored", "only spec.suspend can change once the "
                        "job's RayJob exists; delete and re-create the job to change anything else", generation, now)


def spec_applied(job: dict, cluster: Cluster, status: FineTuneJobStatus, applied: bool, reason: str, message: str,
                 generation: int, now: datetime) -> list:
    """The SpecApplied condition as it now stands, with one Warning event when a change stops applying
    (not one per reconcile). Returns the conditions to write."""
    before = next((c for c in status.conditions if c.type == SPEC_APPLIED), None)
    if applied and (before is None or before.status == "True"):
        return status.conditions
    if not applied and (before is None or before.status == "True" or before.reason != reason):
        cluster.event(job, "Warning", reason, message)
    return set_condition(status.conditions, SPEC_APPLIED, "True" if applied else "False", reason, message,
                         generation, now)


def wants_suspend(spec: FineTuneJobSpec, ray_job: dict) -> bool:
    """The RayJob's suspend as it should be: the user's, unless a queue (Kueue) holds it."""
    queued = QUEUE_LABEL in ray_job["metadata"].get("labels", {})
    return spec.suspend or (queued and ray_job["spec"].get("suspend", False))


def model_profile(source: str, annotations: dict) -> ModelProfile:
    """The catalog's profile, else the shape the `tunewright.dev/model-shape` annotation gives (config.json's
    keys: the API writes it for a model it can read; with kubectl, annotate it)."""
    profile = lookup(source)
    if profile is not None:
        return profile
    shape = annotations.get(MODEL_SHAPE_ANNOTATION)
    if not shape:
        raise ValueError(f"model.source: {source} is not in the planner's catalog: annotate the job with "
                         f"{MODEL_SHAPE_ANNOTATION} holding the model's config.json (its shape keys), or submit it "
                         "through the API, which reads it")
    where = f"metadata.annotations[{MODEL_SHAPE_ANNOTATION}]"
    if len(shape) > MAX_SHAPE_CHARACTERS:
        raise ValueError(f"{where}: longer than {MAX_SHAPE_CHARACTERS} characters")
    try:
        config = json.loads(shape)
    except ValueError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: a JSON object of config.json's keys, not {type(config).__name__}")
    for key, value in config.items():  # sizes: positive integers (a bool is a flag, not a size)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                not isinstance(value, int) or value <= 0):
            raise ValueError(f"{where}.{key}: must be a positive integer, got {value!r}")
    try:
        return from_hf_config(source, config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise ValueError(f"{where}: {err if isinstance(err, ValueError) else f'lacks or mistypes {err}'}") from None


def plan_on_pool(spec: FineTuneJobSpec, pool: ResolvedPool, job: dict) -> JobPlan:
    """On the pool with what its jobs measured (links, compute efficiency) where it learns them."""
    profile = model_profile(spec.model.source, job["metadata"].get("annotations") or {})
    described = pool.planner_pool()
    dataset_bytes = job["metadata"].get("annotations", {}).get(DATASET_BYTES_ANNOTATION)
    tokens = dataset_tokens_of(int(dataset_bytes)) if dataset_bytes and dataset_bytes.isdigit() else None
    cal, _ = calibration.load()
    return plan_job(spec, described, cal, profile, tokens)


def create_run(cluster: Cluster, job: dict, target: manifests.Target, spec: FineTuneJobSpec, plan: JobPlan,
               pool: GPUPoolSpec, settings: manifests.ClusterSettings) -> dict:
    """The token's hash on the FineTuneJob, the Secret holding the token, the ConfigMap, then the RayJob
    (last: it is what the next reconcile looks for). The operator reads neither a Secret nor a ConfigMap (its
    grant on them is create and delete): one an earlier reconcile left is replaced, which is safe while no
    RayJob runs with it, and the token is derived again rather than read back."""
    ray_job, config = manifests.ray_job(target, spec, plan, pool, settings)
    token = manifests.job_token(settings, target)
    # the API checks the workers' token against this hash (not a secret: a sha256 of 256 pseudo-random bits)
    digest = hashlib.sha256(token.encode()).hexdigest()
    if job["metadata"].get("annotations", {}).get(TOKEN_HASH_ANNOTATION) != digest:
        cluster.patch("FineTuneJob", target.namespace, target.name,
                      {"metadata": {"annotations": {TOKEN_HASH_ANNOTATION: digest}}})
    _replace(cluster, manifests.telemetry_secret(target, token))
    _replace(cluster, manifests.config_map(target, config))
    created = _create(cluster, ray_job)
    cluster.event(job, "Normal", "RayJobCreated", f"created RayJob {ray_job['metadata']['name']}: {plan.strategy} "
                                                  f"on {plan.gpus} GPU(s), {plan.nodes} node(s)")
    return created


def _replace(cluster: Cluster, obj: dict) -> None:
    """Created, or written over one a reconcile that died left (perhaps from an older spec or another key)."""
    try:
        cluster.create(obj)
    except AlreadyExists:
        cluster.delete(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        cluster.create(obj)


def _create(cluster: Cluster, obj: dict) -> dict:
    try:
        return cluster.create(obj)
    except AlreadyExists:  # created by an earlier reconcile that died before finishing
        # the object that AlreadyExists named: there unless deleted since (then None, as before)
        return cast(dict, cluster.get(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]))


def pod_problem_of(cluster: Cluster, namespace: str, ray_status: dict) -> PodProblem | None:
    """Why the Ray cluster's pods do not start, from their events (only while it is starting)."""
    cluster_name = ray_status.get("rayClusterName")
    if not cluster_name or ray_status.get("jobDeploymentStatus") not in ("Initializing", "Waiting", ""):
        return None
    pods = cluster.list("Pod", namespace, label_selector=f"ray.io/cluster={cluster_name}")
    names = {p["metadata"]["name"] for p in pods}
    events = [e for e in cluster.list("Event", namespace) if e.get("involvedObject", {}).get("name") in names]
    return pod_problem(events)


def clean_up(job: dict, cluster: Cluster) -> list[str]:
    """At deletion (behind the operator's finalizer): what the job created, deleted now rather than whenever
    garbage collection gets to it, so its GPUs are freed at once. Returns what was deleted."""
    meta = job["metadata"]
    target = manifests.Target(meta["namespace"], meta["name"], meta["uid"], "")
    name = manifests.ray_job_name(target)
    made = (("RayJob", name), ("ConfigMap", f"{name}-config"), ("Secret", f"{name}-telemetry"))
    return [f"{kind}/{object_name}" for kind, object_name in made if cluster.delete(kind, target.namespace, object_name)]
