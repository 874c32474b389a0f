"""Every RayJob state KubeRay reports maps to a FineTuneJob phase and a reason a user can act on."""

from datetime import UTC, datetime, timedelta

import pytest

from tunewright_core.spec import PHASES
from tunewright_core.status import PodProblem, held_cost, observe, pod_problem, with_condition

UNSCHEDULABLE = PodProblem("FailedScheduling", "0/8 nodes are available: 8 Insufficient nvidia.com/gpu.")


@pytest.mark.parametrize(("deployment", "job", "extra", "suspend", "problem", "phase", "reason"), [
    (None, None, {}, False, None, "Queued", "WaitingForKubeRay"),
    ("", "", {}, False, None, "Queued", "WaitingForKubeRay"),
    ("Initializing", "", {}, False, None, "Queued", "ClusterStarting"),
    ("Initializing", "", {}, False, UNSCHEDULABLE, "Queued", "Unschedulable"),
    ("Initializing", "", {}, False, PodProblem("ErrImagePull", "pull access denied"), "Queued", "ImagePullBackOff"),
    ("Waiting", "", {}, False, None, "Queued", "ClusterStarting"),
    ("Running", "PENDING", {}, False, None, "Queued", "Submitting"),
    ("Running", "RUNNING", {}, False, None, "Running", "Training"),
    ("Running", "RUNNING", {}, False, UNSCHEDULABLE, "Running", "Training"),  # running wins over old events
    ("Running", "SUCCEEDED", {}, False, None, "Succeeded", "Succeeded"),
    ("Running", "FAILED", {}, False, None, "Running", "Finishing"),
    ("Complete", "SUCCEEDED", {}, False, None, "Succeeded", "Succeeded"),
    ("Complete", "STOPPED", {}, False, None, "Cancelled", "Stopped"),
    ("Failed", "FAILED", {"reason": "AppFailed", "message": "exit 1", "failed": 1}, False, None, "Failed", "AppFailed"),
    ("Failed", "FAILED", {"reason": "AppFailed", "message": "OOM", "failed": 3}, False, None, "Failed",
     "BackoffLimitExceeded"),
    ("Failed", "RUNNING", {"reason": "DeadlineExceeded"}, False, None, "Failed", "DeadlineExceeded"),
    ("Failed", "", {"reason": "SubmissionFailed", "message": "submitter exited"}, False, None, "Failed",
     "SubmissionFailed"),
    ("Failed", "FAILED", {"reason": "JobDeploymentStatusTransitionGracePeriodExceeded"}, False, None, "Failed",
     "JobDeploymentStatusTransitionGracePeriodExceeded"),
    ("ValidationFailed", "", {"reason": "ValidationFailed", "message": "bad spec"}, False, None, "Failed",
     "RayJobInvalid"),
    ("Retrying", "FAILED", {"failed": 1, "message": "worker died"}, False, None, "Queued", "Retrying"),
    ("Suspending", "", {}, True, None, "Suspended", "Suspending"),
    ("Suspended", "", {}, True, None, "Suspended", "Suspended"),
    ("Suspended", "", {}, False, None, "Queued", "WaitingForAdmission"),  # suspended by Kueue, not the user
])
def test_rayjob_states_become_phases_with_actionable_reasons(deployment, job, extra, suspend, problem, phase, reason):
    status = None if deployment is None else {"jobDeploymentStatus": deployment, "jobStatus": job, **extra}
    got = observe(status, suspend_requested=suspend, backoff_limit=2, pod_problem=problem)
    assert (got.phase, got.reason) == (phase, reason) and got.phase in PHASES and got.message
    if problem and phase == "Queued":
        assert got.message == problem.message  # the scheduler's own words: which resource is short


def test_retries_say_how_many_are_left():
    got = observe({"jobDeploymentStatus": "Retrying", "failed": 1, "message": "NCCL timeout"},
                  suspend_requested=False, backoff_limit=3)
    assert "NCCL timeout" in got.message and "2 retries left" in got.message


def test_the_most_telling_pod_event_is_chosen():
    events = [{"type": "Normal", "reason": "Scheduled", "message": "ok"},
              {"type": "Warning", "reason": "BackOff", "message": "restarting"},
              {"type": "Warning", "reason": "ImagePullBackOff", "message": "image x:1 not found",
               "lastTimestamp": "2026-12-01T10:00:00Z"},
              {"type": "Warning", "reason": "FailedScheduling", "message": "0/8 nodes: Insufficient nvidia.com/gpu",
               "lastTimestamp": "2026-12-01T09:00:00Z"}]
    assert pod_problem(events) == PodProblem("ImagePullBackOff", "image x:1 not found")  # the newest
    same_time = [{**e, "lastTimestamp": "2026-12-01T10:00:00Z"} for e in events]
    assert pod_problem(same_time).reason == "FailedScheduling"  # then the most telling
    assert pod_problem(events[:2]) is None


def test_conditions_change_their_transition_time_only_with_their_status():
    t0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    queued = observe({"jobDeploymentStatus": "Initializing"}, suspend_requested=False, backoff_limit=0)
    first = with_condition([], queued, 1, t0)
    assert [(c.type, c.status, c.reason) for c in first] == [("Running", "False", "ClusterStarting")]
    running = observe({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, suspend_requested=False,
                      backoff_limit=0)
    second = with_condition(first, running, 1, t0 + timedelta(minutes=5))
    again = with_condition(second, running, 1, t0 + timedelta(minutes=9))
    assert again == second and second[0].last_transition_time == t0 + timedelta(minutes=5)
    assert (second[0].status, second[0].reason) == ("True", "Training")
    done = with_condition(again, observe({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"},
                                         suspend_requested=False, backoff_limit=0), 1, t0 + timedelta(hours=1))
    assert {c.type: (c.status, c.reason) for c in done} == {"Running": ("False", "Succeeded"),
                                                            "Succeeded": ("True", "Succeeded")}


@pytest.mark.parametrize(("gpus", "price", "hours", "cost"), [
    (8, 2.5, 2.0, 40.0),      # GPUs x hours x price
    (1, 3.99, 0.25, 1.0),     # rounded to cents
    (4, 2.0, -1.0, 0.0),      # a clock skewed behind the start costs nothing, never a negative
])
def test_held_cost(gpus, price, hours, cost):
    start = datetime(2026, 12, 1, tzinfo=UTC)
    assert held_cost(gpus, price, start, start + timedelta(hours=hours)) == cost


def test_nothing_is_held_before_the_ray_cluster_starts():
    assert held_cost(8, 2.5, None, datetime(2026, 12, 1, tzinfo=UTC)) is None
