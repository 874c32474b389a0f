"""Datasets: upload (validated by the runtime's own validator), list, get, content, delete. OpenAI-shaped."""

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from tunewright_api.auth import CurrentTenant, SessionDep
from tunewright_api.models import FilePublic
from tunewright_api.routes.links import links_from
from tunewright_api.schemas import Deleted, FileList, download
from tunewright_api.services import files

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("", status_code=200, responses=links_from(200, "id", "file_id", ("get", "/v1/files/{file_id}"),
                                                        ("get", "/v1/files/{file_id}/content"),
                                                        ("delete", "/v1/files/{file_id}")))
def upload(request: Request, session: SessionDep, tenant: CurrentTenant, file: UploadFile,
           purpose: Annotated[str, Form()] = "fine-tune") -> FilePublic:
    settings = request.app.state.settings
    stored = files.upload(session=session, tenant=tenant, data_dir=settings.data_dir,
                          max_bytes=settings.max_upload_bytes, content=file.file, filename=file.filename,
                          purpose=purpose)
    return FilePublic.of(stored)


@router.get("")
def list_files(session: SessionDep, tenant: CurrentTenant, purpose: str | None = None,
               sha256: Annotated[str | None, Query(pattern=r"^[0-9a-fA-F]{64}$")] = None, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10000)] = 10000) -> FileList:
    """Newest first (OpenAI's defaults); `after` a file id: the page of older ones; `sha256`: the uploads of
    exactly these bytes (a client finds what it already uploaded)."""
    page, more = files.page_of_files(session=session, tenant=tenant, purpose=purpose, sha256=sha256, after=after,
                                     limit=limit)
    return FileList(data=[FilePublic.of(f) for f in page], has_more=more)


@router.get("/{file_id}")
def get_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FilePublic:
    return FilePublic.of(files.owned_file(session=session, tenant=tenant, file_id=file_id))


@router.get("/{file_id}/content", response_class=FileResponse, responses=download(
    "The file's bytes: a dataset as uploaded (JSONL), or a job's results (CSV).", "application/jsonl", "text/csv"))
def file_content(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FileResponse:
    f = files.owned_file(session=session, tenant=tenant, file_id=file_id)
    return FileResponse(f.path, media_type="text/csv" if f.format == "csv" else "application/jsonl",
                        filename=f.filename)


@router.delete("/{file_id}")
def delete_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> Deleted:
    files.delete(session=session, tenant=tenant, file_id=file_id)
    return Deleted(id=file_id, object="file")
