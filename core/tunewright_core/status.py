"""From what KubeRay reports to what a FineTuneJob says (pure).

A RayJob has no conditions: its `jobDeploymentStatus` (the cluster's lifecycle), `jobStatus` (the Ray
job's) and `reason`/`message` are read together, with what the pods' events say when a cluster cannot
start, into a phase and one condition whose reason a user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tunewright_core.spec import Condition, Phase

# Ray job states that end it (KubeRay's IsJobTerminal)
TERMINAL_JOB_STATUSES = {"STOPPED", "SUCCEEDED", "FAILED"}
# pod event reasons that explain a cluster that does not start, most telling first
POD_PROBLEMS = ("FailedScheduling", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                "FailedMount", "CrashLoopBackOff")
# the condition each phase sets, and to what (types follow Kubernetes' CamelCase convention)
LIFECYCLE = {"Running", "Suspended", "Succeeded", "Failed", "Cancelled"}
CONDITION_OF_PHASE = {"Pending": ("Planned", "False"), "Planned": ("Planned", "True"), "Queued": ("Running", "False"),
                      "Running": ("Running", "True"), "Suspended": ("Suspended", "True"),
                      "Succeeded": ("Succeeded", "True"), "Failed": ("Failed", "True"),
                      "Cancelled": ("Cancelled", "True")}


@dataclass(frozen=True)
class PodProblem:
    """The newest telling event of the job's pods (e.g. FailedScheduling: '0/8 nodes are available: ...')."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observation:
    phase: Phase
    reason: str
    message: str


def observe(ray_status: dict | None, *, suspend_requested: bool, backoff_limit: int,
            pod_problem: PodProblem | None = None) -> Observation:
    """The FineTuneJob's phase and why, from the RayJob's status (None: KubeRay has not written one yet)."""
    status = ray_status or {}
    deployment = status.get("jobDeploymentStatus", "")
    job = status.get("jobStatus", "")
    reason, message = status.get("reason", ""), status.get("message", "")
    failed_attempts = int(status.get("failed") or 0)

    if deployment == "Complete":
        if job == "SUCCEEDED":
            return Observation("Succeeded", "Succeeded", "training finished; the result is in checkpoint storage")
        return Observation("Cancelled", "Stopped", message or "the Ray job was stopped")
    if deployment in ("Failed", "ValidationFailed"):
        return _failure(deployment, reason, message, failed_attempts, backoff_limit)
    if deployment in ("Suspending", "Suspended"):
        if suspend_requested:
            done = deployment == "Suspended"
            return Observation("Suspended", "Suspended" if done else "Suspending",
                               "held by spec.suspend; set it to false to resume from the newest checkpoint"
                               if done else "stopping the Ray cluster (spec.suspend); the checkpoints stay")
        return Observation("Queued", "WaitingForAdmission",
                           "the RayJob is suspended by its queue (Kueue): it starts when admitted")
    if deployment == "Retrying":
        return Observation("Queued", "Retrying",
                           f"attempt {failed_attempts} failed ({message or reason or 'no reason given'}); "
                           f"a new Ray cluster resumes from the newest checkpoint "
                           f"({backoff_limit - failed_attempts} retries left)")
    if deployment == "Running" and job == "RUNNING":
        return Observation("Running", "Training", "the Ray job is running")
    if deployment == "Running" and job in TERMINAL_JOB_STATUSES:
        if job == "SUCCEEDED":
            return Observation("Succeeded", "Succeeded", "training finished; the result is in checkpoint storage")
        return Observation("Running", "Finishing", f"the Ray job ended ({job}); KubeRay is settling the RayJob")
    if pod_problem is not None:
        return Observation("Queued", _problem_reason(pod_problem.reason), pod_problem.message)
    if deployment in ("Initializing", "Waiting"):
        return Observation("Queued", "ClusterStarting", "starting the Ray cluster: pods scheduling, images pulling")
    if deployment == "Running":
        return Observation("Queued", "Submitting", "the Ray cluster is up; the job is being submitted")
    return Observation("Queued", "WaitingForKubeRay", "the RayJob is created; waiting for KubeRay to start it")


def _problem_reason(event_reason: str) -> str:
    return {"FailedScheduling": "Unschedulable", "ErrImagePull": "ImagePullBackOff"}.get(event_reason, event_reason)


def _failure(deployment: str, reason: str, message: str, failed_attempts: int, backoff_limit: int) -> Observation:
    if deployment == "ValidationFailed" or reason == "ValidationFailed":
        return Observation("Failed", "RayJobInvalid", f"KubeRay refused the RayJob: {message}")
    if reason == "DeadlineExceeded":
        return Observation("Failed", "DeadlineExceeded",
                           "the run exceeded resources.deadlineSeconds; raise it, or let the planner pick a faster "
                           "layout (more GPUs)")
    if reason == "SubmissionFailed":
        return Observation("Failed", "SubmissionFailed", f"the job could not be submitted to Ray: {message}")
    if backoff_limit and failed_attempts > backoff_limit:
        return Observation("Failed", "BackoffLimitExceeded",
                           f"failed {failed_attempts} times (resources.maxRetries {backoff_limit}); last: "
                           f"{message or reason}")
    return Observation("Failed", reason or "Failed", message or "the Ray job failed; see the job's logs")


def pod_problem(events: list[dict]) -> PodProblem | None:
    """The newest telling Warning among the pods' events (core/v1 Event objects); at the same time, the
    most telling."""
    warnings = [e for e in events if e.get("type") == "Warning" and e.get("reason") in POD_PROBLEMS]
    if not warnings:
        return None
    # the newest: an hour-old FailedScheduling must not hide that the pods are now pulling their image
    newest = max(warnings, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                          POD_PROBLEMS[::-1].index(e["reason"])))
    return PodProblem(newest["reason"], newest.get("message", ""))


def set_condition(conditions: list[Condition], kind: str, status: str, reason: str, message: str,
                  generation: int, now: datetime) -> list[Condition]:
    """One condition set; its transition time changes only when its status does (Kubernetes' convention)."""
    previous = next((c for c in conditions if c.type == kind), None)
    since = previous.last_transition_time if previous and previous.status == status else now
    updated = Condition(type=kind, status=status, observed_generation=generation, last_transition_time=since,
                        reason=reason, message=message[:32768])
    return sorted([c for c in conditions if c.type != kind] + [updated], key=lambda c: c.type)


def with_condition(conditions: list[Condition], observation: Observation, generation: int,
                   now: datetime) -> list[Condition]:
    """The phase's condition set, and any other lifecycle condition that was True set False with the new
    reason."""
    wanted, wanted_status = CONDITION_OF_PHASE[observation.phase]
    out = set_condition(conditions, wanted, wanted_status, observation.reason, observation.message, generation, now)
    for c in list(out):
        if c.type in LIFECYCLE and c.type != wanted and c.status == "True":
            out = set_condition(out, c.type, "False", observation.reason, observation.message, generation, now)
    return out


def held_cost(gpus: int, price_per_gpu_hour: float, start: datetime | None, end: datetime) -> float | None:
    """What the job's GPUs cost while held: from when KubeRay started its Ray cluster to its end (or now),
    start-up and retries included, as a bill counts them. None before anything started."""
    if start is None:
        return None
    return round(gpus * max((end - start).total_seconds(), 0.0) / 3600 * price_per_gpu_hour, 2)
