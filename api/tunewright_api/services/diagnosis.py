"""A job's measured telemetry over time, and its diagnosis: read-only, one tenant's jobs."""

from __future__ import annotations

from statistics import median

from sqlmodel import Session, select

from tunewright_api.diagnosis import Diagnosis, Observed, diagnose
from tunewright_api.models import Job, JobEvent, MetricPoint, Tenant, now
from tunewright_api.schemas import (
    CommWindow,
    EvaluationPoint,
    JobTelemetryReport,
    RankOwnSeconds,
    TelemetryLatest,
    TelemetryPoint,
)
from tunewright_api.services.jobs import owned_job, sampled_points
from tunewright_api.telemetry import aware
from tunewright_core.spec import JobPlan

RECENT_POINTS = 50  # the steps a diagnosis reads: recent enough to be the job as it runs now
SERIES_POINTS = 500
# The step records' GPU activity (NVML GPM and utilization.gpu) as the telemetry names it
GPU_ACTIVITY = {"smActive": "sm_active_share", "tensorActive": "tensor_active_share",
                "dramBandwidth": "dram_bandwidth_share", "kernelActive": "kernel_active_share"}
NOT_REPORTED = "not reported: no step record has carried GPU activity yet"


def gpu_activity(point: dict | None) -> dict:
    """A metric point's GPU activity, camelCase; where SM-active is missing, the runtime's reason."""
    point = point or {}
    out = {name: point.get(field) for name, field in GPU_ACTIVITY.items()}
    out["smActiveUnavailable"] = (None if out["smActive"] is not None
                                  else point.get("gpu_activity_unavailable") or NOT_REPORTED)
    return out


def held_seconds(job: Job) -> float | None:
    if job.started_at is None:
        return None
    return max(0.0, (aware(job.finished_at or now()) - aware(job.started_at)).total_seconds())


def observed(session: Session, job: Job) -> Observed:
    recent = session.exec(select(MetricPoint).where(MetricPoint.job_id == job.id)
                          .order_by(MetricPoint.step.desc()).limit(RECENT_POINTS)).all()
    every = ((job.spec.get("checkpoint") or {}).get("everySteps"))
    return Observed(steps=job.step, points=[p.data for p in reversed(recent)], comm=job.comm,
                    checkpoint_seconds=job.checkpoint_seconds, held_seconds=held_seconds(job),
                    checkpoint_every=every)


def job_diagnosis(*, session: Session, tenant: Tenant, job_id: str) -> Diagnosis:
    job = owned_job(session=session, tenant=tenant, job_id=job_id)
    return diagnose(job.plan, observed(session, job))


def median_tokens_per_second(session: Session, job: Job) -> float | None:
    """The logged steps' median tokens/s: the run's pace, which neither the first step (it compiles) nor a
    short last one moves."""
    speeds = [v for v in session.exec(select(MetricPoint.data["tokens_per_second"].as_float())
                                      .where(MetricPoint.job_id == job.id)).all() if v is not None]
    return median(speeds) if speeds else None


def job_telemetry_latest(session: Session, job: Job, plan: JobPlan | None) -> TelemetryLatest:
    """The job's measured values now beside `plan` (the job's, parsed once by the caller), as its telemetry's
    `latest` and `/metrics` report them."""
    predicted = plan.predicted if plan else None
    measured = job.telemetry(plan)
    seen = observed(session, job)
    found = diagnose(plan, seen)
    cost = measured.cost_usd
    progress = job.progress()
    return TelemetryLatest.model_validate(measured.model_dump(by_alias=True) | {
        "step": job.step, "tokensPerSecond": job.tokens_per_second,
        "tokensPerSecondMedian": median_tokens_per_second(session, job),
        "goodput": found.goodput,
        "dataWaitShare": next((c.measured_share for c in found.components if c.name == "data wait"), None),
        "gpuBusyShare": (job.comm or {}).get("gpu_busy_share"),
        **gpu_activity(seen.points[-1] if seen.points else None),
        "costPerMillionTokensUSD": cost / job.trained_tokens * 1e6 if cost is not None and job.trained_tokens else None,
        "projectedCostUSD": (cost + progress.eta_seconds * predicted.cost_usd / predicted.duration_seconds
                             if cost is not None and progress.eta_seconds is not None and predicted
                             and predicted.duration_seconds else None),
    })


def job_telemetry(*, session: Session, tenant: Tenant, job_id: str) -> JobTelemetryReport:
    """The latest measured values beside the plan's, and their series: per logged step, per profiler window
    (communication and how busy the GPU was), and per evaluation (validation loss and accuracy)."""
    job = owned_job(session=session, tenant=tenant, job_id=job_id)
    plan = job.plan
    predicted = plan.predicted if plan else None
    latest = job_telemetry_latest(session, job, plan)
    points = sampled_points(session, job.id, SERIES_POINTS)

    def mfu(tokens_per_second: float | None) -> float | None:
        if not (tokens_per_second and predicted and predicted.tokens_per_second):
            return None
        return predicted.mfu * tokens_per_second / predicted.tokens_per_second

    series = [TelemetryPoint.model_validate({
        "step": p.step, "time": p.time, "loss": p.data.get("loss"), "tokensPerSecond": p.data.get("tokens_per_second"),
        "mfu": mfu(p.data.get("tokens_per_second")), "stepSeconds": p.data.get("step_seconds"),
        "dataSeconds": p.data.get("data_seconds"), "peakMemoryGiB": p.data.get("peak_memory_gib"),
        "rewardMargin": p.data.get("reward_margin"), "preferenceAccuracy": p.data.get("preference_accuracy"),
        **{name: p.data.get(field) for name, field in GPU_ACTIVITY.items()}}) for p in points]
    windows = session.exec(select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "metrics")
                           .order_by(JobEvent.id)).all()
    comm = [CommWindow(step=e.data["step"], comm_share=e.data["comm_share"],
                       comm_share_exposed=e.data["comm_share_exposed"], gpu_busy_share=e.data.get("gpu_busy_share"),
                       wait_seconds_per_step=e.data.get("wait_seconds_per_step"),
                       transfer_seconds_per_step=e.data.get("transfer_seconds_per_step"),
                       slowest_rank=e.data.get("slowest_rank"),
                       rank_own_seconds=RankOwnSeconds(min=e.data.get("rank_own_seconds_min"),
                                                       median=e.data.get("rank_own_seconds_median"),
                                                       max=e.data.get("rank_own_seconds_max")))
            for e in windows if e.data and "comm_share" in e.data]
    evaluations = [EvaluationPoint(step=e.data["step"], val_loss=e.data["val_loss"],
                                   val_token_accuracy=e.data.get("val_token_accuracy"),
                                   exact_match=e.data.get("exact_match"),
                                   preference_accuracy=e.data.get("preference_accuracy"),
                                   reward_margin=e.data.get("reward_margin"))
                   for e in windows if e.data and "val_loss" in e.data]
    return JobTelemetryReport(job_id=job.id, status=job.status, predicted=predicted, latest=latest, series=series,
                              comm=comm, evaluations=evaluations)
