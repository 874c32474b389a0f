"""Datasets: upload (validated by the runtime's own validator), list, get, content, delete. OpenAI-shaped."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import FileResponse
from sqlmodel import select

from tunewright_api.auth import CurrentTenant, SessionDep
from tunewright_api.errors import ApiError
from tunewright_api.models import FilePublic, Job, ListEnvelope, StoredFile, new_id
from tunewright_api.states import TERMINAL

router = APIRouter(prefix="/v1/files", tags=["files"])
PURPOSES = {"fine-tune"}


def owned_file(session, tenant, file_id: str) -> StoredFile:
    f = session.get(StoredFile, file_id)
    if f is None or f.tenant_id != tenant.id:  # another tenant's file does not exist for you
        raise ApiError(404, f"no file {file_id}", "file_id", "not_found")
    return f


def validate_dataset(path: Path) -> dict:
    """The training runtime decides what trains: ask it (a separate process, no import across the boundary)."""
    proc = subprocess.run([sys.executable, "-m", "tunewright_jobs.validate", str(path)],
                          capture_output=True, text=True, timeout=600)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"dataset validator failed: {proc.stderr[-500:]}") from None


@router.post("", status_code=200)
def upload(request: Request, session: SessionDep, tenant: CurrentTenant, file: UploadFile,
           purpose: Annotated[str, Form()] = "fine-tune") -> FilePublic:
    if purpose not in PURPOSES:
        raise ApiError(422, f"purpose must be one of {sorted(PURPOSES)}", "purpose", "invalid_value")
    settings = request.app.state.settings
    file_id = new_id("file")
    folder = (settings.data_dir / "files" / tenant.id).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{file_id}.partial"
    size = 0
    with partial.open("wb") as out:
        while chunk := file.file.read(1 << 20):
            size += len(chunk)
            if size > settings.max_upload_bytes:
                out.close()
                partial.unlink()
                raise ApiError(413, f"file larger than {settings.max_upload_bytes} bytes", "file", "too_large")
            out.write(chunk)
    checked = validate_dataset(partial)
    if "errors" in checked:
        partial.unlink()
        name = file.filename or "upload"
        errors = [e.replace(partial.name, name).replace(str(partial), name) for e in checked["errors"]]
        raise ApiError(422, "dataset rejected: " + "; ".join(errors), "file", "invalid_file")
    final = folder / f"{file_id}.jsonl"
    shutil.move(partial, final)
    stored = StoredFile(id=file_id, tenant_id=tenant.id, filename=file.filename or "upload.jsonl", purpose=purpose,
                        bytes=size, format=checked["format"], examples=checked["examples"], path=str(final))
    session.add(stored)
    session.commit()
    return FilePublic.of(stored)


@router.get("")
def list_files(session: SessionDep, tenant: CurrentTenant) -> ListEnvelope:
    files = session.exec(select(StoredFile).where(StoredFile.tenant_id == tenant.id)
                         .order_by(StoredFile.created_at.desc())).all()
    return ListEnvelope(data=[FilePublic.of(f) for f in files])


@router.get("/{file_id}")
def get_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FilePublic:
    return FilePublic.of(owned_file(session, tenant, file_id))


@router.get("/{file_id}/content")
def file_content(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FileResponse:
    f = owned_file(session, tenant, file_id)
    return FileResponse(f.path, media_type="application/jsonl", filename=f.filename)


@router.delete("/{file_id}")
def delete_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> dict:
    f = owned_file(session, tenant, file_id)
    jobs = session.exec(select(Job).where(Job.tenant_id == tenant.id)).all()
    if any(j.status not in TERMINAL and file_id in (j.spec["dataset"].get("train"), j.spec["dataset"].get("validation"))
           for j in jobs):
        raise ApiError(409, f"{file_id} is used by a job that has not finished", "file_id", "in_use")
    Path(f.path).unlink(missing_ok=True)
    session.delete(f)
    session.commit()
    return {"id": file_id, "object": "file", "deleted": True}
