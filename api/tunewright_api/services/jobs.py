"""Jobs: submit, find, page, cancel, and what a job has recorded (events, metrics, checkpoints, logs).

Both job surfaces (native and OpenAI-compatible) call these; each function owns its transaction.
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlmodel import Session, select
from sqlmodel import delete as sql_delete

from tunewright_api.auth import hash_token, new_token
from tunewright_api.backends import AlreadyFinished, Backend
from tunewright_api.errors import ApiError
from tunewright_api.models import (
    Checkpoint,
    Job,
    JobEvent,
    MetricPoint,
    StoredFile,
    Tenant,
    add_event,
)
from tunewright_api.schemas import (
    CheckpointList,
    CheckpointMetrics,
    CheckpointPublic,
    EventList,
    EventPublic,
    LogLines,
    MetricPointList,
    MetricPointPublic,
)
from tunewright_api.services import hub
from tunewright_api.services.artifacts import export_folders
from tunewright_api.services.files import owned_file
from tunewright_api.services.plans import check_model_source, is_hub_name, profile_for
from tunewright_api.states import TERMINAL
from tunewright_core.planner.jobs import sized_for_data
from tunewright_core.spec import FineTuneJobSpec

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")


def owned_job(*, session: Session, tenant: Tenant, job_id: str, param: str = "job_id") -> Job:
    job = session.get(Job, job_id)
    if job is None or job.tenant_id != tenant.id:  # another tenant's job does not exist for you
        raise ApiError(404, f"no job {job_id}", param, "not_found")
    return job


def dataset_file(*, session: Session, tenant: Tenant, value: str | None, param: str) -> StoredFile | None:
    """An uploaded file of this tenant's, named by id (never a server path: a tenant must not read the
    server's files)."""
    if value is None:
        return None
    if not FILE_ID.match(value):
        raise ApiError(422, f"{value!r} is not an uploaded file id (file-...): upload it with POST /v1/files",
                       param, "invalid_file")
    try:
        return owned_file(session=session, tenant=tenant, file_id=value)
    except ApiError:
        raise ApiError(422, f"no file {value}", param, "file_not_found") from None


def submit(*, session: Session, backend: Backend, tenant: Tenant, spec: FineTuneJobSpec,
           train_param: str = "dataset.train", validation_param: str = "dataset.validation",
           suffix: str | None = None, metadata: dict[str, str] | None = None, data_dir: Path,
           model_roots: list[Path] | None = None, model_param: str = "model.source",
           sizes_param: str = "") -> Job:
    """Check the spec against the tenant's files, plan it on the backend, and queue it."""
    if spec.suspend:
        raise ApiError(422, "this backend cannot hold a suspended job; submit it when it should run",
                       "suspend", "unsupported")
    spec = readable_model(spec, session=session, tenant=tenant, data_dir=data_dir, model_roots=model_roots,
                          param=model_param)
    if is_hub_name(spec.model.source) and (why := hub.refusal(spec.model.source, hub.availability(
            spec.model.source.removeprefix("hf://"), revision=spec.model.revision), backend.runs_here)):
        raise ApiError(422, why, model_param, "model_not_found")
    if (reference := dpo_reference(spec)) is not None and is_hub_name(reference) and (why := hub.refusal(
            reference, hub.availability(reference.removeprefix("hf://")), backend.runs_here)):
        raise ApiError(422, why, reference_param(model_param), "model_not_found")
    train = dataset_file(session=session, tenant=tenant, value=spec.dataset.train, param=train_param)
    validation = dataset_file(session=session, tenant=tenant, value=spec.dataset.validation, param=validation_param)
    if train.format != spec.dataset.format:
        raise ApiError(422, f"{train.id} holds {train.format} records, the spec says {spec.dataset.format}",
                       "dataset.format", "invalid_value")
    if validation is not None and validation.format != spec.dataset.format:  # the run reads both as one format
        raise ApiError(422, f"{validation.id} holds {validation.format} records, the training file "
                            f"{spec.dataset.format}", validation_param, "invalid_value")
    spec, sizing = fit_to_data(spec, train, sizes_param=sizes_param)
    planned = backend.plan(spec, train)
    plan = planned.plan
    telemetry_token = new_token()
    job = Job(tenant_id=tenant.id, model=spec.model.source, spec=spec.model_dump(by_alias=True, exclude_none=True),
              plan=plan, telemetry_token_hash=hash_token(telemetry_token),
              suffix=suffix, job_metadata=metadata)
    backend.submit(session, job, spec, planned, train, validation, telemetry_token)
    session.add(job)
    add_event(session, job, f"queued; plan: {plan.explanation}" + (f"; {sizing}" if sizing else ""))
    session.commit()
    return job


def dpo_reference(spec: FineTuneJobSpec) -> str | None:
    """The model a dpo job starts from and is held near, where the spec names one apart from model.source."""
    return spec.method.dpo.reference if spec.method.objective == "dpo" else None


def reference_param(model_param: str) -> str:
    """Where method.dpo.reference is in a request whose model.source is at `model_param`."""
    return model_param.removesuffix("model.source") + "method.dpo.reference" if model_param.endswith(
        "model.source") else "method.dpo.reference"


def readable_model(spec: FineTuneJobSpec, *, session: Session, tenant: Tenant, data_dir: Path,
                   model_roots: list[Path] | None, param: str) -> FineTuneJobSpec:
    """The spec naming its model as the run must read it (a local path resolved), once this tenant may; and a
    dpo job's reference model, which the run reads as well (its starting weights), the same way."""
    source = check_model_source(spec.model.source, model_roots, param=param, data_dir=data_dir,
                                own_exports=lambda: export_folders(session, tenant))
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"source": source})})
    if (reference := dpo_reference(spec)) is not None:
        resolved = check_model_source(reference, model_roots, param=reference_param(param), data_dir=data_dir,
                                      own_exports=lambda: export_folders(session, tenant))
        dpo = spec.method.dpo.model_copy(update={"reference": resolved})
        spec = spec.model_copy(update={"method": spec.method.model_copy(update={"dpo": dpo})})
    return spec


def fit_to_data(spec: FineTuneJobSpec, train: StoredFile, *, sizes_param: str = "",
                spec_param: str | None = None) -> tuple[FineTuneJobSpec, str | None]:
    """Sizes the spec leaves open chosen from the uploaded data (a small dataset must not fail a minute into
    the queue for a default it never asked for); sizes it sets that the data cannot fill refused now.

    A refusal names `sizes_param` when given (the OpenAI surface's batch_size), else the spec's field, under
    `spec_param` (where the spec sits in the request body; None: the body is the spec)."""
    if train.characters is None or train.longest_characters is None:
        return spec, None  # uploaded before files kept their size in text
    try:
        profile = profile_for(spec.model.source, param="model.source")
    except ApiError:
        profile = None  # not profiled here (a hub model outside the catalog): no positions to respect
    try:
        return sized_for_data(spec, examples=train.examples, characters=train.characters,
                              longest_characters=train.longest_characters,
                              max_positions=profile.max_positions if profile else 0)
    except ValueError as err:
        field = str(err).partition(":")[0]
        param = sizes_param or ".".join(filter(None, (spec_param, field)))
        raise ApiError(422, str(err), param, "dataset_too_small") from None


def page_of_jobs(*, session: Session, tenant: Tenant, after: str | None, limit: int,
                 status: str | None = None) -> tuple[list[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    query = select(Job).where(Job.tenant_id == tenant.id).order_by(Job.created_at.desc(), Job.id.desc())
    if status is not None:
        query = query.where(Job.status == status)
    if after is not None:
        anchor = owned_job(session=session, tenant=tenant, job_id=after, param="after")
        query = query.where((Job.created_at < anchor.created_at)
                            | ((Job.created_at == anchor.created_at) & (Job.id < anchor.id)))
    jobs = list(session.exec(query.limit(limit + 1)).all())
    return jobs[:limit], len(jobs) > limit


def cancel(*, session: Session, backend: Backend, tenant: Tenant, job_id: str, param: str,
           finished_status: int = 409) -> Job:
    """`finished_status`: what cancelling an ended job answers (409 natively; OpenAI's surface says 400)."""
    job = owned_job(session=session, tenant=tenant, job_id=job_id, param=param)
    try:
        if job.status in TERMINAL:
            raise AlreadyFinished(job.status)
        backend.cancel(session, job)
    except AlreadyFinished as finished:
        raise ApiError(finished_status, f"job {job_id} already {finished}", param, "already_finished") from None
    session.refresh(job)
    return job


def delete(*, session: Session, backend: Backend, tenant: Tenant, job_id: str) -> None:
    """A finished job, its records, and what its backend kept for it; a job still queued or running is
    refused (cancel it first: deleting must never leave a run going unseen)."""
    job = owned_job(session=session, tenant=tenant, job_id=job_id)
    if job.status not in TERMINAL:
        raise ApiError(409, f"job {job_id} is {job.status}: cancel it first", "job_id", "not_finished")
    backend.forget(job)
    for table in (JobEvent, MetricPoint, Checkpoint):
        session.exec(sql_delete(table).where(table.job_id == job.id))
    session.delete(job)
    session.commit()


def cursor(value: str | None, prefix: str, param: str = "after") -> int | None:
    """The number in a page cursor (`after`: the last id of the previous page), or 422 naming it."""
    if value is None:
        return None
    number = value.removeprefix(prefix).rsplit("-", 1)[-1]
    if not value.startswith(prefix) or not number.isdigit() or len(number) > 18:
        raise ApiError(422, f"{value!r} is not an id from this list ({prefix}...)", param, "invalid_value")
    return int(number)


def events_page(*, session: Session, tenant: Tenant, job_id: str, param: str, limit: int,
                after: str | None = None) -> EventList:
    """Newest first, in OpenAI's event shape; `after` an event id: the page of older ones."""
    owned_job(session=session, tenant=tenant, job_id=job_id, param=param)
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if (older_than := cursor(after, "ftevent-")) is not None:
        query = query.where(JobEvent.id < older_than)
    events = session.exec(query.order_by(JobEvent.id.desc()).limit(limit + 1)).all()
    data = [EventPublic(id=f"ftevent-{e.id}", created_at=int(e.created_at.timestamp()), level=e.level,
                        message=e.message, type=e.type, data=e.data) for e in events[:limit]]
    return EventList(data=data, has_more=len(events) > limit)


def metric_points(*, session: Session, tenant: Tenant, job_id: str, max_points: int) -> MetricPointList:
    """Per-step metrics, downsampled to at most `max_points` (evenly, always keeping the last step)."""
    owned_job(session=session, tenant=tenant, job_id=job_id)
    return MetricPointList(data=[MetricPointPublic.model_validate({"step": p.step, "time": p.time, **p.data})
                                 for p in sampled_points(session, job_id, max_points)])


def sampled_points(session: Session, job_id: str, max_points: int) -> list[MetricPoint]:
    """The job's metric points in step order, evenly downsampled to at most `max_points` (the last kept)."""
    points = session.exec(select(MetricPoint).where(MetricPoint.job_id == job_id).order_by(MetricPoint.step)).all()
    if len(points) > max_points:
        stride = len(points) / (max_points - 1)
        points = [points[int(i * stride)] for i in range(max_points - 1)] + [points[-1]]
    return points


def checkpoints(*, session: Session, tenant: Tenant, job_id: str, param: str, limit: int,
                after: str | None = None) -> CheckpointList:
    """Committed checkpoints as the runtime registered them, newest first, in OpenAI's checkpoint shape;
    `after` a checkpoint id: the page of older ones."""
    job = owned_job(session=session, tenant=tenant, job_id=job_id, param=param)
    query = select(Checkpoint).where(Checkpoint.job_id == job.id)
    if (before_step := cursor(after, f"ftckpt-{job.id.removeprefix('ftjob-')}-")) is not None:
        query = query.where(Checkpoint.step < before_step)
    rows = session.exec(query.order_by(Checkpoint.step.desc()).limit(limit + 1)).all()
    data = [CheckpointPublic(id=f"ftckpt-{job.id.removeprefix('ftjob-')}-{c.step:08d}",
                             created_at=int(c.created_at.timestamp()), step_number=c.step,
                             fine_tuned_model_checkpoint=c.uri, fine_tuning_job_id=job.id,
                             metrics=CheckpointMetrics(step=c.step, train_loss=c.train_loss)) for c in rows[:limit]]
    return CheckpointList(data=data, has_more=len(rows) > limit)


def log_lines(*, session: Session, backend: Backend, tenant: Tenant, job_id: str, lines: int) -> LogLines:
    job = owned_job(session=session, tenant=tenant, job_id=job_id)
    return LogLines(data=backend.logs(job, lines))
