"""The workers' telemetry endpoint: authenticated by the job's own token, not a tenant's."""

from typing import Annotated

from fastapi import APIRouter, Header

from tunewright_api.auth import SessionDep
from tunewright_api.services import telemetry
from tunewright_api.telemetry import TelemetryBatch

router = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])


@router.post("/{job_id}/telemetry", status_code=204)
def ingest(job_id: str, batch: TelemetryBatch, session: SessionDep,
           authorization: Annotated[str | None, Header()] = None) -> None:
    token = (authorization or "").removeprefix("Bearer ").strip()
    job = telemetry.authenticated_job(session=session, job_id=job_id, token=token)
    telemetry.ingest(session=session, job=job, records=batch.records)
