"""Datasets: stored per tenant, validated at upload by the runtime's own validator."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from sqlmodel import Session, select

from tunewright_api.errors import ApiError
from tunewright_api.models import Job, StoredFile, Tenant, new_id
from tunewright_api.states import TERMINAL

PURPOSES = {"fine-tune"}
VALIDATION_SECONDS = 600  # at most, per upload
# An upload's .partial is written from the request's spool (its time changes with every chunk), then validated
# for at most VALIDATION_SECONDS, then renamed: one untouched for twice that is no upload's on any API replica
# sharing this folder, only what an upload killed on its way left behind.
STALE_PARTIAL_SECONDS = 2 * VALIDATION_SECONDS


def owned_file(*, session: Session, tenant: Tenant, file_id: str, param: str = "file_id") -> StoredFile:
    f = session.get(StoredFile, file_id)
    if f is None or f.tenant_id != tenant.id:  # another tenant's file does not exist for you
        raise ApiError(404, f"no file {file_id}", param, "not_found")
    return f


def page_of_files(*, session: Session, tenant: Tenant, purpose: str | None, sha256: str | None, after: str | None,
                  limit: int) -> tuple[list[StoredFile], bool]:
    query = select(StoredFile).where(StoredFile.tenant_id == tenant.id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    if sha256 is not None:
        query = query.where(StoredFile.sha256 == sha256.lower())
    if after is not None:
        anchor = owned_file(session=session, tenant=tenant, file_id=after, param="after")
        query = query.where((StoredFile.created_at < anchor.created_at)
                            | ((StoredFile.created_at == anchor.created_at) & (StoredFile.id < anchor.id)))
    page = list(session.exec(query.order_by(StoredFile.created_at.desc(), StoredFile.id.desc())
                             .limit(limit + 1)).all())
    return page[:limit], len(page) > limit


def validate_dataset(path: Path) -> dict:
    """The training runtime decides what trains: ask it (a separate process, no import across the boundary)."""
    proc = subprocess.run([sys.executable, "-m", "tunewright_jobs.validate", str(path)],
                          capture_output=True, text=True, timeout=VALIDATION_SECONDS)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"dataset validator failed: {proc.stderr[-500:]}") from None


def sweep_partials(partials: Iterable[Path]) -> None:
    """Remove what killed uploads left behind (at start-up, every tenant's; before each upload, its folder's)."""
    now = time.time()
    for partial in partials:
        with contextlib.suppress(FileNotFoundError):  # renamed by its upload, or swept by another replica, first
            if now - partial.stat().st_mtime > STALE_PARTIAL_SECONDS:
                partial.unlink()


def sweep_all_partials(data_dir: Path) -> None:
    sweep_partials((data_dir / "files").glob("*/*.partial"))


def upload(*, session: Session, tenant: Tenant, data_dir: Path, max_bytes: int, content: BinaryIO,
           filename: str | None, purpose: str) -> StoredFile:
    if purpose not in PURPOSES:
        raise ApiError(422, f"purpose must be one of {sorted(PURPOSES)}", "purpose", "invalid_value")
    file_id, tenant_id = new_id("file"), tenant.id
    # no database connection is held while the file is written and validated (seconds for a large one): a
    # burst of uploads must not take the pool from every other request
    session.close()
    folder = (data_dir / "files" / tenant_id).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    sweep_partials(folder.glob("*.partial"))
    partial, final = folder / f"{file_id}.partial", folder / f"{file_id}.jsonl"
    try:
        size, digest = 0, hashlib.sha256()
        # owner-only: a tenant's data is no other local user's to read
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            while chunk := content.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"file larger than {max_bytes} bytes", "file", "too_large")
                out.write(chunk)
                digest.update(chunk)
        checked = validate_dataset(partial)
        if "errors" in checked:
            name = filename or "upload"
            # the user's file name, never where the server keeps it
            errors = [e.replace(str(partial), name).replace(str(folder), "").replace(partial.name, name)
                      for e in checked["errors"]]
            raise ApiError(400, "dataset rejected: " + "; ".join(errors), "file", "invalid_file")  # OpenAI's
        shutil.move(partial, final)
    finally:
        partial.unlink(missing_ok=True)  # refused, failed or moved: no .partial stays behind
    stored = StoredFile(id=file_id, tenant_id=tenant_id, filename=filename or "upload.jsonl", purpose=purpose,
                        bytes=size, format=checked["format"], examples=checked["examples"], path=str(final),
                        sha256=digest.hexdigest(), characters=checked["characters"],
                        longest_characters=checked["longest_characters"])
    try:
        session.add(stored)
        session.commit()
    except Exception:
        final.unlink(missing_ok=True)  # no file without its row
        raise
    return stored


def delete(*, session: Session, tenant: Tenant, file_id: str) -> None:
    f = owned_file(session=session, tenant=tenant, file_id=file_id)
    jobs = session.exec(select(Job).where(Job.tenant_id == tenant.id, Job.status.not_in(TERMINAL))).all()
    if any(file_id in (j.spec["dataset"].get("train"), j.spec["dataset"].get("validation")) for j in jobs):
        raise ApiError(409, f"{file_id} is used by a job that has not finished", "file_id", "in_use")
    Path(f.path).unlink(missing_ok=True)
    session.delete(f)
    session.commit()
