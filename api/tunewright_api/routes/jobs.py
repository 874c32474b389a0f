"""Native jobs: POST the FineTuneJob spec; list, get, cancel, events, metrics, telemetry, diagnosis,
checkpoints, logs."""

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from tunewright_api.auth import CurrentTenant, SessionDep
from tunewright_api.deps import BackendDep, SettingsDep
from tunewright_api.diagnosis import Diagnosis
from tunewright_api.models import JobPublic
from tunewright_api.routes.links import links_from
from tunewright_api.schemas import (
    ArtifactList,
    Deleted,
    JobCheckpointList,
    JobEventList,
    JobList,
    JobTelemetryReport,
    LogLines,
    MetricPointList,
    download,
)
from tunewright_api.services import artifacts, diagnosis, jobs
from tunewright_api.states import JobStatus
from tunewright_core.spec import FineTuneJobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=201, responses=links_from(201, "id", "job_id", *(
    (method, f"/v1/jobs/{{job_id}}{tail}") for method, tail in (
        ("get", ""), ("post", "/cancel"), ("get", "/events"), ("get", "/metrics"), ("get", "/checkpoints"),
        ("get", "/logs"), ("get", "/telemetry"), ("get", "/diagnosis")))))
def create_job(spec: FineTuneJobSpec, session: SessionDep, backend: BackendDep, settings: SettingsDep,
               tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(jobs.submit(session=session, backend=backend, tenant=tenant, spec=spec,
                                    data_dir=settings.data_dir, model_roots=settings.model_roots))


@router.get("")
def list_jobs(session: SessionDep, tenant: CurrentTenant, after: str | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20, status: JobStatus | None = None) -> JobList:
    """Newest first; `status` narrows to jobs in that state."""
    page, more = jobs.page_of_jobs(session=session, tenant=tenant, after=after, limit=limit, status=status)
    return JobList(data=[JobPublic.of(j) for j in page], has_more=more)


@router.get("/{job_id}")
def get_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(jobs.owned_job(session=session, tenant=tenant, job_id=job_id))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, session: SessionDep, backend: BackendDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(jobs.cancel(session=session, backend=backend, tenant=tenant, job_id=job_id, param="job_id"))


@router.delete("/{job_id}")
def delete_job(job_id: str, session: SessionDep, backend: BackendDep, tenant: CurrentTenant) -> Deleted:
    """A finished job and everything kept for it here (its records, run folder, checkpoints and export);
    its results file stays among the tenant's files."""
    jobs.delete(session=session, backend=backend, tenant=tenant, job_id=job_id)
    return Deleted(id=job_id, object="tunewright.job")


@router.get("/{job_id}/events")
def job_events(job_id: str, session: SessionDep, tenant: CurrentTenant, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> JobEventList:
    return JobEventList.of(jobs.events_page(session=session, tenant=tenant, job_id=job_id, param="job_id",
                                            limit=limit, after=after))


@router.get("/{job_id}/metrics")
def job_metrics(job_id: str, session: SessionDep, tenant: CurrentTenant,
                max_points: Annotated[int | None, Query(alias="maxPoints", ge=2, le=10000,
                                                        description="At most this many points (default 500).")] = None,
                max_points_before: Annotated[int | None, Query(alias="max_points", ge=2, le=10000, deprecated=True,
                                                               description="Use maxPoints.")] = None
                ) -> MetricPointList:
    """Per-step metrics, downsampled to at most `maxPoints` (evenly, always keeping the last step)."""
    # max_points: the name this query had before the native routes were all camelCase, still understood
    points = max_points or max_points_before or 500
    return jobs.metric_points(session=session, tenant=tenant, job_id=job_id, max_points=points)


@router.get("/{job_id}/telemetry")
def job_telemetry(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobTelemetryReport:
    """Measured beside predicted, now and over time: tokens/s, MFU, communication share, GPU busy share,
    goodput, data wait, cost (so far, per million trained tokens, projected); per step and per profiler window."""
    return diagnosis.job_telemetry(session=session, tenant=tenant, job_id=job_id)


@router.get("/{job_id}/diagnosis")
def job_diagnosis(job_id: str, session: SessionDep, tenant: CurrentTenant) -> Diagnosis:
    """Why is it slow? Predicted and measured per component of a step, what dominates, what explains the gap
    to the prediction, and what to do about it."""
    return diagnosis.job_diagnosis(session=session, tenant=tenant, job_id=job_id)


@router.get("/{job_id}/checkpoints")
def job_checkpoints(job_id: str, session: SessionDep, tenant: CurrentTenant, after: str | None = None,
                    limit: Annotated[int, Query(ge=1, le=100)] = 100) -> JobCheckpointList:
    return JobCheckpointList.of(jobs.checkpoints(session=session, tenant=tenant, job_id=job_id, param="job_id",
                                                 limit=limit, after=after))


@router.get("/{job_id}/logs")
def job_logs(job_id: str, session: SessionDep, backend: BackendDep, tenant: CurrentTenant,
             lines: Annotated[int, Query(ge=1, le=10000)] = 200) -> LogLines:
    """The last `lines` lines the run printed, oldest first."""
    return jobs.log_lines(session=session, backend=backend, tenant=tenant, job_id=job_id, lines=lines)


@router.get("/{job_id}/artifacts")
def job_artifacts(job_id: str, session: SessionDep, tenant: CurrentTenant) -> ArtifactList:
    """The files the job exported (adapter, merged or full model), by path; each is served by the route below."""
    return ArtifactList(data=artifacts.listing(jobs.owned_job(session=session, tenant=tenant, job_id=job_id)))


@router.get("/{job_id}/artifacts/{path:path}", response_class=FileResponse,
            responses=download("The file's bytes.", "application/octet-stream"))
def job_artifact(job_id: str, path: str, session: SessionDep, tenant: CurrentTenant) -> FileResponse:
    found = artifacts.artifact_file(jobs.owned_job(session=session, tenant=tenant, job_id=job_id), path)
    return FileResponse(found, media_type="application/octet-stream", filename=found.name)
