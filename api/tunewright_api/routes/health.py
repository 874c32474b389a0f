from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, text
from sqlmodel import select

from tunewright_api.auth import SessionDep
from tunewright_api.errors import ApiError
from tunewright_api.models import Job

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(session: SessionDep, request: Request) -> dict:
    try:
        session.exec(text("SELECT 1"))
    except Exception as err:  # noqa: BLE001 (readiness reports any database failure)
        raise ApiError(503, f"database not reachable: {type(err).__name__}") from None
    return {"status": "ready", "backend": request.app.state.settings.backend}


@router.get("/metrics", response_class=PlainTextResponse)
def prometheus(session: SessionDep) -> str:
    lines = ["# HELP tunewright_jobs Jobs by status.", "# TYPE tunewright_jobs gauge"]
    for status, count in session.exec(select(Job.status, func.count()).group_by(Job.status)).all():
        lines.append(f'tunewright_jobs{{status="{status}"}} {count}')
    return "\n".join(lines) + "\n"
