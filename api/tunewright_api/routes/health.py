import hmac
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, text
from sqlmodel import Session, select

from tunewright_api.auth import SessionDep, bearer_token, token_of
from tunewright_api.deps import SettingsDep
from tunewright_api.errors import ApiError
from tunewright_api.models import Job, Tenant
from tunewright_api.prometheus import HISTOGRAM, gauge
from tunewright_api.schemas import Health, Readiness
from tunewright_api.services.diagnosis import job_telemetry_latest
from tunewright_api.settings import Settings

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    return Health()


@router.get("/readyz")
def readyz(session: SessionDep, request: Request) -> Readiness:
    try:
        session.exec(text("SELECT 1"))
    except Exception as err:  # noqa: BLE001 (readiness reports any database failure)
        raise ApiError(503, f"database not reachable: {type(err).__name__}") from None
    return Readiness(backend=request.app.state.settings.backend)


# What each running job reports: (metric, help, the value in its telemetry's `latest`)
RUNNING_JOB_GAUGES = (
    ("tunewright_job_tokens_per_second", "Trained tokens per second, all workers (latest step).", "tokensPerSecond"),
    ("tunewright_job_mfu", "Model FLOPs utilization, measured (planner's FLOPs and peak).", "mfu"),
    ("tunewright_job_comm_share", "Share of the step in collectives (last profiler window).", "commShare"),
    ("tunewright_job_comm_share_exposed", "Share of the step in collectives no compute hides.", "commShareExposed"),
    ("tunewright_job_sm_active", "Share of SM time busy, mean over GPUs (NVML GPM SM_UTIL, latest step).",
     "smActive"),
    ("tunewright_job_tensor_active", "Share of SM time issuing tensor-core work (NVML GPM, latest step).",
     "tensorActive"),
    ("tunewright_job_dram_bandwidth_share", "Share of peak DRAM bandwidth used (NVML GPM, latest step).",
     "dramBandwidth"),
    ("tunewright_job_kernel_active", "Share of time any kernel ran, however small (NVML utilization.gpu).",
     "kernelActive"),
    ("tunewright_job_gpu_busy_share", "Share of the profiled steps any GPU kernel ran (not SM-active).",
     "gpuBusyShare"),
    ("tunewright_job_goodput", "Step time over the time the GPUs were held.", "goodput"),
    ("tunewright_job_cost_usd", "GPUs held x time x the pool's price, so far.", "costUSD"),
)


def sees_each_job(session: Session, settings: Settings, authorization: str | None) -> bool:
    """Whether a /metrics caller may see tenants' names and job ids: with the metrics token or an admin token
    (anyone else who reaches the port gets the totals); a token that is neither is refused, not ignored, so
    a misconfigured scraper is told."""
    if authorization is None:
        return False
    # as bytes: compare_digest refuses str with characters outside ASCII (a stray header would be a 500)
    if settings.metrics_token and hmac.compare_digest(bearer_token(authorization).encode(),
                                                      settings.metrics_token.encode()):
        return True
    if not token_of(session, authorization).admin:
        raise HTTPException(403, "per-job metrics need the metrics token (TUNEWRIGHT_METRICS_TOKEN) or an admin "
                                 "token; without a token /metrics answers the totals")
    return True


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {
    "description": "The Prometheus text exposition format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
def prometheus(session: SessionDep, settings: SettingsDep,
               authorization: Annotated[str | None, Header()] = None) -> str:
    lines = ["# HELP tunewright_jobs Jobs by status.", "# TYPE tunewright_jobs gauge"]
    for status, count in session.exec(select(Job.status, func.count()).group_by(Job.status)).all():
        lines.append(f'tunewright_jobs{{status="{status}"}} {count}')
    if sees_each_job(session, settings, authorization):
        running = session.exec(select(Job, Tenant.name).join(Tenant, Tenant.id == Job.tenant_id)
                               .where(Job.status == "running")).all()
        latest = [({"job_id": job.id, "tenant": tenant},
                   job_telemetry_latest(session, job, job.plan).model_dump(by_alias=True))
                  for job, tenant in running]
        for name, help_text, key in RUNNING_JOB_GAUGES:
            lines += gauge(name, help_text, [(labels, values.get(key)) for labels, values in latest])
        lines += gauge("tunewright_job_step", "Optimizer steps done.",
                       [(labels, values["step"]) for labels, values in latest])
    else:
        lines.append("# each running job's series (tunewright_job_*, by tenant and job) need the metrics token "
                     "or an admin token: Authorization: Bearer <token>")
    lines += HISTOGRAM.lines()
    return "\n".join(lines) + "\n"
