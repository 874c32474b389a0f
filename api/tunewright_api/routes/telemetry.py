"""The workers' telemetry endpoint: authenticated by the job's own token, not a tenant's."""

from typing import Annotated

from fastapi import APIRouter, Header

from tunewright_api.auth import SessionDep
from tunewright_api.services import telemetry
from tunewright_api.telemetry import MAX_REPORTED_REJECTIONS, TelemetryBatch, TelemetryReceipt, parse_records

router = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])


@router.post("/{job_id}/telemetry")
def ingest(job_id: str, batch: TelemetryBatch, session: SessionDep,
           authorization: Annotated[str | None, Header()] = None) -> TelemetryReceipt:
    """Applies the records it accepts; says which it refused and why (the runtime logs them)."""
    token = (authorization or "").removeprefix("Bearer ").strip()
    job = telemetry.authenticated_job(session=session, job_id=job_id, token=token)
    accepted, rejected = parse_records(batch.records)
    telemetry.ingest(session=session, job=job, records=accepted)
    return TelemetryReceipt(accepted=len(accepted), rejected=rejected[:MAX_REPORTED_REJECTIONS])
