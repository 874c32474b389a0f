"""What a finished job exported (the adapter, the merged or the full model), listed and served file by file."""

from __future__ import annotations

from pathlib import Path

from sqlmodel import Session, select

from tunewright_api.errors import ApiError
from tunewright_api.models import Job, Tenant
from tunewright_api.schemas import ArtifactPublic

MAX_LISTED = 10_000  # files per listing: an export holds tens


def export_folder(job: Job) -> Path:
    """`<output_dir>/final`, the folder the runtime moves whole exports into; 409 when there is none here."""
    export = {name: where for name, where in ((job.result or {}).get("export") or {}).items() if where}
    if job.status != "succeeded" or not export:
        raise ApiError(409, f"job {job.id} is {job.status} and has no exported model"
                            + ("" if job.status in ("failed", "cancelled") else " yet"), "job_id", "no_artifacts")
    on_volume = [where for where in export.values() if "://" in where]
    if on_volume:
        raise ApiError(409, f"job {job.id}'s model is on the cluster's volume ({on_volume[0]}): copy it from a pod "
                            "that mounts the claim, e.g. kubectl cp", "job_id", "artifacts_on_cluster")
    # the folder this server's run wrote (never one the run's telemetry names: a run could name any folder)
    folder = final_folder(job)
    if folder is None or not folder.is_dir():
        raise ApiError(410, f"job {job.id}'s exported model is no longer on this server ({folder.name} is gone)",
                       "job_id", "artifacts_gone")
    return folder


def final_folder(job: Job) -> Path | None:
    """`<run_dir>/output/final`: where this server's run of the job moves its exports (the local backend's
    layout), resolved; None for a job whose run is not on this server."""
    return Path(job.run_dir).resolve() / "output" / "final" if job.run_dir else None


def export_folders(session: Session, tenant: Tenant) -> list[Path]:
    """The folders this server holds the tenant's exports in (each succeeded job's `final`, from where the
    server ran it, not from what the run reported): what of the data folder a job of this tenant's may read
    (fine-tuning its own model further)."""
    jobs = session.exec(select(Job).where(Job.tenant_id == tenant.id, Job.status == "succeeded")).all()
    return sorted({folder for job in jobs if (folder := final_folder(job)) is not None})


def listing(job: Job) -> list[ArtifactPublic]:
    """Every file of the export, by its path in it (`adapter/adapter_config.json`) and size; links not followed."""
    folder = export_folder(job)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    return [ArtifactPublic(path=p.relative_to(folder).as_posix(), bytes=p.stat().st_size) for p in files[:MAX_LISTED]]


def artifact_file(job: Job, path: str) -> Path:
    """One file of the export; anything outside it (`..`, absolute paths, links) does not exist."""
    folder = export_folder(job).resolve()
    wanted = (folder / path).resolve()
    try:
        found = folder in wanted.parents and wanted.is_file() and not (folder / path).is_symlink()
    except OSError:  # e.g. longer than a path may be, once under the export's folder: no file of the export
        found = False
    if not found:
        raise ApiError(404, f"job {job.id} exported no file {path!r}", "path", "not_found")
    return wanted
