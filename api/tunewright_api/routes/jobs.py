"""Native jobs: POST the FineTuneJob spec; list, get, cancel, events, metrics, checkpoints."""

import hmac
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from pydantic import BaseModel
from sqlmodel import select

from tunewright_api.auth import CurrentTenant, SessionDep, hash_token, new_token
from tunewright_api.backends.local import add_event
from tunewright_api.errors import ApiError
from tunewright_api.models import Job, JobEvent, JobPublic, ListEnvelope, MetricPoint, StoredFile
from tunewright_api.routes.files import owned_file
from tunewright_api.routes.pools import gpus_found, profile_for
from tunewright_api.states import TERMINAL
from tunewright_operator.jobconfig import global_batch, runtime_config
from tunewright_operator.planner import calibration
from tunewright_operator.planner.estimate import Layout
from tunewright_operator.planner.hardware import GPUS, LINKS, Pool, gpu_from_product_name
from tunewright_operator.planner.jobs import layout_of, plan_job
from tunewright_operator.planner.search import NoPlan
from tunewright_operator.spec import FineTuneJobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
internal = APIRouter(prefix="/v1/internal/jobs", tags=["internal"])
MAX_MICRO_BATCH = 8
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")


def owned_job(session, tenant, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None or job.tenant_id != tenant.id:  # another tenant's job does not exist for you
        raise ApiError(404, f"no job {job_id}", "job_id", "not_found")
    return job


def resolve_dataset(session, tenant, value: str | None, param: str) -> StoredFile | None:
    if value is None:
        return None
    if not FILE_ID.match(value):
        raise ApiError(422, f"{value!r} is not an uploaded file id (file-...): upload it with POST /v1/files",
                       param, "invalid_file")
    try:
        return owned_file(session, tenant, value)
    except ApiError:
        raise ApiError(422, f"no file {value}", param, "file_not_found") from None


def planned_layout(spec: FineTuneJobSpec, settings, train: StoredFile) -> tuple[Layout, dict]:
    """This machine's GPUs as a one-node pool, planned like any other; predictions stored with the job."""
    gpu_type = settings.local_gpu_type or next(filter(None, map(gpu_from_product_name, gpus_found())), None)
    if gpu_type not in GPUS:
        raise ApiError(422, f"cannot plan for local GPUs of type {gpu_type!r}: set TUNEWRIGHT_LOCAL_GPU_TYPE to one "
                            f"of {', '.join(GPUS)}", "resources", "unknown_gpu")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    pool = Pool("local", calibration.for_gpu(gpu_type), settings.local_gpus, 1, LINKS[settings.local_gpu_link], None,
                settings.local_price_per_gpu_hour, host_gib)
    cal, _ = calibration.load()
    # without maxSteps, steps follow from the data: ~4 bytes of JSONL per token is the estimate until the run counts
    try:
        chosen = plan_job(spec, pool, cal, profile_for(spec.model.source), dataset_tokens=max(1, train.bytes // 4))
    except NoPlan as err:
        raise ApiError(422, str(err), "resources", "no_plan") from None
    layout = layout_of(chosen)
    return layout, {"strategy": chosen.strategy, "workers": chosen.gpus, "useGPU": True,
                    "microBatch": chosen.micro_batch, "gradAccum": chosen.grad_accum,
                    "cpuOffload": chosen.cpu_offload,
                    "explanation": f"local pool ({settings.local_gpus} x {gpu_type}): {chosen.explanation}",
                    "predicted": chosen.predicted.model_dump(), "rejected": [r.model_dump() for r in chosen.rejected]}


def local_layout(spec: FineTuneJobSpec, settings) -> tuple[Layout, str]:
    """On a CPU-only machine: DDP over `local_workers` CPU workers (the planner models GPUs, not CPUs)."""
    workers = max(1, min(settings.local_workers, os.cpu_count() or 1))
    strategy = spec.resources.strategy
    if strategy == "auto":
        strategy = "ddp" if workers > 1 else "single"
    if strategy == "single":
        workers = 1
    if strategy == "hsdp":
        raise ApiError(422, "hsdp needs several nodes; the local pool is one machine", "resources.strategy",
                       "invalid_value")
    batch = global_batch(spec)
    if batch % workers:
        raise ApiError(422, f"a global batch of {batch} sequences does not divide over {workers} workers",
                       "hyperparameters.globalBatchSize", "invalid_value")
    per_worker = batch // workers
    micro = max(m for m in range(1, min(per_worker, MAX_MICRO_BATCH) + 1) if per_worker % m == 0)
    layout = Layout(strategy, workers, 1, micro, per_worker // micro, False,
                    shard_group=workers if strategy == "fsdp" else 1)
    why = (f"local pool: {strategy} on {workers} CPU worker{'s' if workers > 1 else ''} (Ray, gloo), micro-batch "
           f"{micro} x {per_worker // micro} accumulation = {batch} sequences per step")
    return layout, why


@router.post("", status_code=201)
def create_job(spec: FineTuneJobSpec, request: Request, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(submit(spec, request, session, tenant))


def submit(spec: FineTuneJobSpec, request: Request, session, tenant, **columns) -> Job:
    """Validate the spec against this tenant's files, plan it, and queue it on the backend."""
    settings, backend = request.app.state.settings, request.app.state.backend
    if spec.suspend:
        raise ApiError(422, "the local backend cannot hold a suspended job; submit it when it should run",
                       "suspend", "unsupported")
    train = resolve_dataset(session, tenant, spec.dataset.train, "dataset.train")
    validation = resolve_dataset(session, tenant, spec.dataset.validation, "dataset.validation")
    if train.format != spec.dataset.format:
        raise ApiError(422, f"{train.id} holds {train.format} records, the spec says {spec.dataset.format}",
                       "dataset.format", "invalid_value")
    if settings.local_gpus > 0:
        layout, plan = planned_layout(spec, settings, train)
    else:
        layout, why = local_layout(spec, settings)
        plan = {"strategy": layout.strategy, "workers": layout.gpus, "useGPU": False,
                "microBatch": layout.micro_batch, "gradAccum": layout.grad_accum, "explanation": why}
    job = Job(tenant_id=tenant.id, model=spec.model.source, spec=spec.model_dump(by_alias=True, exclude_none=True),
              **columns)
    telemetry_token = new_token()
    job.telemetry_token_hash = hash_token(telemetry_token)
    run_dir = backend.run_dir(job)
    job.plan = plan
    job.config = runtime_config(
        spec, layout, settings.local_gpus > 0, name=job.id, output_dir=str(run_dir / "output"), train=train.path,
        validation=validation.path if validation else None, checkpoint_storage=str(run_dir / "checkpoints"),
        telemetry_endpoint=f"{settings.public_url.rstrip('/')}/v1/internal/jobs/{job.id}/telemetry")
    backend.prepare(job, telemetry_token)
    session.add(job)
    add_event(session, job, f"queued; plan: {plan['explanation']}")
    session.commit()
    return job


def page_of_jobs(session, tenant, after: str | None, limit: int) -> tuple[list[Job], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    query = select(Job).where(Job.tenant_id == tenant.id).order_by(Job.created_at.desc(), Job.id.desc())
    jobs = list(session.exec(query).all())
    if after is not None:
        ids = [j.id for j in jobs]
        if after not in ids:
            raise ApiError(404, f"no job {after}", "after", "not_found")
        jobs = jobs[ids.index(after) + 1:]
    return jobs[:limit], len(jobs) > limit


@router.get("")
def list_jobs(session: SessionDep, tenant: CurrentTenant, after: str | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListEnvelope:
    jobs, more = page_of_jobs(session, tenant, after, limit)
    return ListEnvelope(data=[JobPublic.of(j) for j in jobs], has_more=more)


@router.get("/{job_id}")
def get_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(owned_job(session, tenant, job_id))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, request: Request, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.of(cancel_owned(request, session, tenant, job_id, "job_id"))


def cancel_owned(request: Request, session, tenant, job_id: str, param: str) -> Job:
    job = owned_job(session, tenant, job_id)
    if job.status in TERMINAL:
        raise ApiError(409, f"job {job_id} already {job.status}", param, "already_finished")
    request.app.state.backend.cancel(session, job)
    session.refresh(job)
    return job


@router.get("/{job_id}/events")
def job_events(job_id: str, session: SessionDep, tenant: CurrentTenant,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> ListEnvelope:
    owned_job(session, tenant, job_id)
    return events_page(session, job_id, limit)


def events_page(session, job_id: str, limit: int) -> ListEnvelope:
    """Newest first, in OpenAI's event shape."""
    events = session.exec(select(JobEvent).where(JobEvent.job_id == job_id)
                          .order_by(JobEvent.id.desc()).limit(limit + 1)).all()
    data = [{"id": f"ftevent-{e.id}", "object": "fine_tuning.job.event", "created_at": int(e.created_at.timestamp()),
             "level": e.level, "message": e.message, "type": e.type, "data": e.data} for e in events[:limit]]
    return ListEnvelope(data=data, has_more=len(events) > limit)


@router.get("/{job_id}/metrics")
def job_metrics(job_id: str, session: SessionDep, tenant: CurrentTenant,
                max_points: Annotated[int, Query(ge=2, le=10000)] = 500) -> ListEnvelope:
    """Per-step metrics, downsampled to at most `max_points` (evenly, always keeping the last step)."""
    owned_job(session, tenant, job_id)
    points = session.exec(select(MetricPoint).where(MetricPoint.job_id == job_id).order_by(MetricPoint.step)).all()
    if len(points) > max_points:
        stride = len(points) / (max_points - 1)
        points = [points[int(i * stride)] for i in range(max_points - 1)] + [points[-1]]
    return ListEnvelope(data=[{"step": p.step, "time": p.time, **p.data} for p in points])


@router.get("/{job_id}/checkpoints")
def job_checkpoints(job_id: str, session: SessionDep, tenant: CurrentTenant) -> ListEnvelope:
    return ListEnvelope(data=checkpoints(owned_job(session, tenant, job_id)))


def checkpoints(job: Job) -> list[dict]:
    """Committed checkpoints, newest first, in OpenAI's checkpoint shape (plus where they are)."""
    root = Path(job.config["checkpoint"]["storage"]) / job.id if job.config else None
    steps = sorted(root.glob("step_*")) if root and root.is_dir() else []
    out = []
    for path in reversed(steps):
        metrics_file = path / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        out.append({"id": f"ftckpt-{job.id.removeprefix('ftjob-')}-{path.name}", "object": "fine_tuning.job.checkpoint",
                    "created_at": int(path.stat().st_mtime), "step_number": int(path.name.removeprefix("step_")),
                    "fine_tuned_model_checkpoint": str(path), "fine_tuning_job_id": job.id,
                    "metrics": {"step": metrics.get("step"), "train_loss": metrics.get("loss")}})
    return out


class TelemetryBatch(BaseModel):
    records: list[dict[str, Any]]


@internal.post("/{job_id}/telemetry", status_code=204)
def ingest(job_id: str, batch: TelemetryBatch, session: SessionDep,
           authorization: Annotated[str | None, Header()] = None) -> None:
    """Workers' metrics, authenticated by the job's own token (not a tenant token)."""
    job = session.get(Job, job_id)
    presented = hash_token((authorization or "").removeprefix("Bearer ").strip())
    if job is None or not hmac.compare_digest(presented, job.telemetry_token_hash):
        raise ApiError(401, "invalid telemetry token for this job")
    for record in batch.records:
        event = record.get("event")
        if event == "start":
            job.total_steps = record.get("total_steps")
        elif event == "step":
            data = {k: v for k, v in record.items() if k not in ("event", "step", "time")}
            session.add(MetricPoint(job_id=job.id, step=record["step"], time=record.get("time", 0.0), data=data))
            job.step, job.loss = record["step"], record.get("loss")
            job.tokens_per_second = record.get("tokens_per_second")
            job.trained_tokens += int(record.get("tokens", 0))
            add_event(session, job, f"step {record['step']}: training loss={record.get('loss', float('nan')):.4f}",
                      type_="metrics", data={"step": record["step"], "train_loss": record.get("loss"),
                                             "total_steps": job.total_steps})
        elif event == "comm":
            job.comm = {k: v for k, v in record.items() if k not in ("event", "time")}
            add_event(session, job, f"step {record['step']}: communication {record.get('comm_share', 0):.1%} of the "
                                    f"step ({record.get('comm_share_exposed', 0):.1%} exposed)",
                      type_="metrics", data=job.comm)
        elif event == "eval":
            data = {k: v for k, v in record.items() if k not in ("event", "time", "samples")}
            add_event(session, job, f"evaluation at step {record.get('step')}", type_="metrics", data=data)
    session.add(job)
    session.commit()
