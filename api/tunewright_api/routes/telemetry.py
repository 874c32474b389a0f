"""The workers' telemetry endpoint: authenticated by the job's own token, not a tenant's."""

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import FileResponse

from tunewright_api.auth import SessionDep, bearer_token
from tunewright_api.errors import ApiError
from tunewright_api.schemas import download
from tunewright_api.services import telemetry
from tunewright_api.telemetry import (
    MAX_REPORTED_REJECTIONS,
    JobSummary,
    TelemetryBatch,
    TelemetryReceipt,
    parse_records,
    refusal_of_batch,
)

router = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])


@router.post("/{job_id}/telemetry")
def ingest(job_id: str, batch: TelemetryBatch, session: SessionDep, request: Request,
           authorization: Annotated[str | None, Header()] = None) -> TelemetryReceipt:
    """Applies the records it accepts; says which it refused and why (the runtime logs them). A batch of
    which no record is valid is refused whole (422)."""
    job = telemetry.authenticated_job(session=session, job_id=job_id, token=bearer_token(authorization))
    accepted, rejected = parse_records(batch.records)
    if (refusal := refusal_of_batch(accepted, rejected)) is not None:
        raise ApiError(422, refusal, "records", "no_valid_record")
    telemetry.ingest(session=session, job=job, records=accepted, data_dir=request.app.state.settings.data_dir,
                     learn=request.app.state.backend)
    return TelemetryReceipt(accepted=len(accepted), rejected=rejected[:MAX_REPORTED_REJECTIONS])


@router.get("/{job_id}/files/{file_id}", response_class=FileResponse,
            responses=download("The dataset's bytes (JSONL).", "application/jsonl"))
def dataset(job_id: str, file_id: str, session: SessionDep,
            authorization: Annotated[str | None, Header()] = None) -> FileResponse:
    """A dataset the job names, for its workers on a cluster (never any other file, nor another tenant's)."""
    job = telemetry.authenticated_job(session=session, job_id=job_id, token=bearer_token(authorization))
    stored = telemetry.dataset_of(session=session, job=job, file_id=file_id)
    return FileResponse(stored.path, media_type="application/jsonl", filename=f"{stored.id}.jsonl")


@router.get("/{job_id}/summary")
def summary(job_id: str, session: SessionDep, authorization: Annotated[str | None, Header()] = None) -> JobSummary:
    """Progress and measured telemetry (what `tunewright get` shows), for the operator's FineTuneJob status."""
    job = telemetry.authenticated_job(session=session, job_id=job_id, token=bearer_token(authorization),
                                      finished_ok=True)
    return JobSummary(status=job.status, progress=job.progress(), telemetry=job.telemetry(job.plan))
