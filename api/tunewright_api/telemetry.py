"""What workers report, and a job's progress and measured telemetry beside the plan's predictions: pure.

The records are defined once (`tunewright_core.records`), with their bounds; the API accepts each in its
`accepted_form`: what it reads is required, fields it does not know are ignored, so a newer runtime's
additions do not break an older API.

Communication share comes from the runtime's profiler windows (`comm` records). MFU and cost are derived
with the plan's own definitions, so that measured and predicted compare exactly: MFU scales with tokens/s
(same model FLOPs, same GPUs, same peak), and cost is the time the GPUs have been held at the plan's
price per second (GPUs x price per GPU-hour).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from tunewright_core import records
from tunewright_core.records import accepted_form
from tunewright_core.spec import JobPlan, JobProgress, JobTelemetry

MAX_RECORDS_PER_BATCH = 1000

# each record kind as the API accepts it (tunewright_core.records defines them, with their bounds): what the
# API reads is required, the rest may be absent
StartRecord = accepted_form(records.StartRecord, needs=("total_steps",))
StepRecord = accepted_form(records.StepRecord, defaults={"epoch": 0}, needs=(
    "loss", "learning_rate", "grad_norm", "tokens", "tokens_per_second", "step_seconds", "data_seconds",
    "forward_backward_seconds", "optimizer_seconds"))
EvalRecord = accepted_form(records.EvalRecord, needs=("val_loss", "val_token_accuracy"))
CommRecord = accepted_form(records.CommRecord, needs=(
    "profiled_steps", "profiled_step_seconds", "comm_share", "comm_share_exposed", "comm_seconds_per_step",
    "exposed_comm_seconds_per_step", "comm_share_max_rank", "comm_share_exposed_max_rank"))
CheckpointRecord = accepted_form(records.CheckpointRecord, needs=("uri", "keep_last"))
EndRecord = accepted_form(records.EndRecord, needs=(), defaults={"export": records.ExportPaths()})
TelemetryRecord = Annotated[StartRecord | StepRecord | CommRecord | EvalRecord | CheckpointRecord | EndRecord,
                            Field(discriminator="event")]


def step_metrics(record: BaseModel) -> dict:
    """What a metrics point keeps of a `step` record: everything but the envelope."""
    return record.model_dump(exclude={"event", "step", "time"}, exclude_none=True)


class TelemetryBatch(BaseModel):
    """Records are checked one by one: one the API refuses costs that record, not the batch around it."""

    records: Annotated[list[dict], Field(max_length=MAX_RECORDS_PER_BATCH)]


class Rejected(BaseModel):
    index: int
    error: str


class TelemetryReceipt(BaseModel):
    accepted: int
    rejected: list[Rejected] = Field(description="The first few refused records and why.")


class JobSummary(BaseModel):
    """What the API knows of a run, for the operator to show in the FineTuneJob's status."""

    status: str
    progress: JobProgress
    telemetry: JobTelemetry


_RECORD: TypeAdapter = TypeAdapter(TelemetryRecord)
MAX_REPORTED_REJECTIONS = 20


def parse_records(raw: list[dict]) -> tuple[list[TelemetryRecord], list[Rejected]]:
    accepted, rejected = [], []
    for index, record in enumerate(raw):
        try:
            accepted.append(_RECORD.validate_python(record))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "record"
            rejected.append(Rejected(index=index, error=f"{where}: {first['msg']}"))
    return accepted, rejected


def refusal_of_batch(accepted: list[TelemetryRecord], rejected: list[Rejected]) -> str | None:
    """Why a batch is refused whole: it holds records and none is valid (a broken worker must be noticed,
    not answered 200). None when some record is valid, or none was sent. Names each refused field and why."""
    if accepted or not rejected:
        return None
    reasons = "; ".join(f"record {r.index}: {r.error}" for r in rejected[:MAX_REPORTED_REJECTIONS])
    more = f" (and {len(rejected) - MAX_REPORTED_REJECTIONS} more)" if len(rejected) > MAX_REPORTED_REJECTIONS else ""
    return (f"no record of the batch is valid, none was applied: {reasons}{more}. Records must follow the "
            "runtime's telemetry contract (tunewright_core.records): fix the worker that sent them")


def aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # SQLite drops the zone


def progress(status: str, step: int, total_steps: int | None, loss: float | None, tokens_per_second: float | None,
             trained_tokens: int, started_at: datetime | None, now: datetime) -> JobProgress:
    eta = None
    if status == "running" and total_steps and step:
        # the training pace (the latest step's tokens/s) when known: time since the start also holds the
        # start-up (a minute for a small job), which made early estimates hours long
        if tokens_per_second and trained_tokens:
            per_step = trained_tokens / step / tokens_per_second
        elif started_at is not None:
            per_step = (now - aware(started_at)).total_seconds() / step
        else:
            per_step = None
        eta = None if per_step is None else max(0.0, per_step * (total_steps - step))
    percent = round(100 * step / total_steps, 1) if total_steps else None
    return JobProgress(step=step, total_steps=total_steps, percent=percent, loss=loss,
                       tokens_per_second=tokens_per_second, trained_tokens=trained_tokens, eta_seconds=eta)


def measured(plan: JobPlan | None, comm: dict | None, tokens_per_second: float | None, started_at: datetime | None,
             finished_at: datetime | None, now: datetime) -> JobTelemetry:
    comm = comm or {}
    out = JobTelemetry(comm_share=comm.get("comm_share"), comm_share_exposed=comm.get("comm_share_exposed"),
                       comm_share_max_rank=comm.get("comm_share_max_rank"), comm_measured_at_step=comm.get("step"))
    predicted = plan.predicted if plan else None
    if predicted is None:
        return out  # CPU runs: no peak FLOP/s, no price
    if tokens_per_second and predicted.tokens_per_second:
        out.mfu = predicted.mfu * tokens_per_second / predicted.tokens_per_second
    if started_at is not None and predicted.duration_seconds:
        held = (aware(finished_at or now) - aware(started_at)).total_seconds()
        out.cost_usd = max(0.0, held) * predicted.cost_usd / predicted.duration_seconds
    return out
