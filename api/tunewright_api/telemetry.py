"""What workers report, and a job's progress and measured telemetry beside the plan's predictions: pure.

The records are the runtime's contract (`tunewright_jobs.telemetry` defines what it emits); these models
are what the API accepts of them, with bounds, and a contract test holds the two together. Fields the API
does not use are ignored, so a newer runtime's additions do not break an older API.

Communication share comes from the runtime's profiler windows (`comm` records). MFU and cost are derived
with the plan's own definitions, so that measured and predicted compare exactly: MFU scales with tokens/s
(same model FLOPs, same GPUs, same peak), and cost is the time the GPUs have been held at the plan's
price per second (GPUs x price per GPU-hour).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from tunewright_core.spec import JobPlan, JobProgress, JobTelemetry

MAX_STEP = 10**9
MAX_RECORDS_PER_BATCH = 1000
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Count = Annotated[int, Field(ge=0, le=10**15)]


def _finite_or_none(value):
    """A diverged run reports NaN or infinity (the runtime's JSON allows them; SQL JSON does not): kept as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


# a measured value that may have diverged (or come from an empty window)
Measured = Annotated[Annotated[float, Field(ge=-1e12, le=1e12)] | None, BeforeValidator(_finite_or_none)]
MeasuredShare = Annotated[Annotated[float, Field(ge=0, le=1)] | None, BeforeValidator(_finite_or_none)]
Share = Annotated[float, Field(ge=0, le=1)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    step: Step
    time: Annotated[float, Field(ge=0, le=1e11)] = 0.0  # UNIX seconds when the runtime emitted it


class StartRecord(_Record):
    event: Literal["start"]
    total_steps: Annotated[int, Field(gt=0, le=MAX_STEP)]


class StepRecord(_Record):
    """One logged window of optimizer steps (one step when logging every step)."""

    event: Literal["step"]
    epoch: Step = 0
    loss: Measured
    learning_rate: Measured
    grad_norm: Measured
    tokens: Count
    tokens_per_second: Annotated[float, Field(ge=0, le=1e12)]
    step_seconds: Seconds
    data_seconds: Seconds
    forward_backward_seconds: Seconds
    optimizer_seconds: Seconds
    peak_memory_gib: Annotated[float, Field(ge=0, le=1e6)] | None = None
    peak_memory_reserved_gib: Annotated[float, Field(ge=0, le=1e6)] | None = None
    # NVML GPM over the window (mean over ranks); kernel-active is NVML's utilization.gpu
    sm_active_share: Share | None = None
    tensor_active_share: Share | None = None
    dram_bandwidth_share: Share | None = None
    kernel_active_share: Share | None = None
    gpu_activity_unavailable: Annotated[str, Field(max_length=500)] | None = None

    def metrics(self) -> dict:
        """What a metrics point keeps: everything but the envelope."""
        return self.model_dump(exclude={"event", "step", "time"}, exclude_none=True)


class CommRecord(_Record):
    """A profiler window's communication share (docs/architecture.md, "Telemetry definitions")."""

    event: Literal["comm"]
    profiled_steps: Annotated[int, Field(gt=0, le=MAX_STEP)]
    profiled_step_seconds: Seconds
    comm_share: Share
    comm_share_exposed: Share
    comm_seconds_per_step: Seconds
    exposed_comm_seconds_per_step: Seconds
    comm_share_max_rank: Share
    comm_share_exposed_max_rank: Share
    # the collectives' time split into waiting for the slowest rank and transfer; each rank's own work
    wait_seconds_per_step: Seconds | None = None
    transfer_seconds_per_step: Seconds | None = None
    rank_own_seconds_min: Seconds | None = None
    rank_own_seconds_median: Seconds | None = None
    rank_own_seconds_max: Seconds | None = None
    slowest_rank: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    # what the window itself added to the run, and the step the next one opens at
    window_cost_seconds: Seconds | None = None
    next_window_step: Step | None = None
    # the window's GPU kernels (absent on the CPU): where the compute went, and how busy the GPU was
    matmul_seconds_per_step: Seconds | None = None
    attention_seconds_per_step: Seconds | None = None
    other_compute_seconds_per_step: Seconds | None = None
    gpu_busy_share: Share | None = None


class EvalRecord(_Record):
    event: Literal["eval"]
    val_loss: Measured
    val_token_accuracy: MeasuredShare
    exact_match: MeasuredShare = None
    exact_match_examples: Count | None = None


class CheckpointRecord(_Record):
    """A checkpoint committed by the runtime's store; the store keeps only the newest `keep_last`."""

    event: Literal["checkpoint"]
    uri: Annotated[str, Field(min_length=1, max_length=4096)]
    train_loss: Measured = None
    keep_last: Annotated[int, Field(gt=0, le=10**6)]
    seconds: Seconds | None = None  # writing it (the training waited)


class Export(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    adapter: Annotated[str, Field(max_length=4096)] | None = None
    merged: Annotated[str, Field(max_length=4096)] | None = None
    model: Annotated[str, Field(max_length=4096)] | None = None


class EndRecord(_Record):
    """The run's result (what it also writes to result.json): kept whole, bounded by the batch size."""

    model_config = ConfigDict(extra="allow", frozen=True)
    event: Literal["end"]
    final_loss: Measured = None
    export: Export = Field(default_factory=Export)


TelemetryRecord = Annotated[StartRecord | StepRecord | CommRecord | EvalRecord | CheckpointRecord | EndRecord,
                            Field(discriminator="event")]


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
            "runtime's telemetry contract (tunewright_jobs.telemetry): fix the worker that sent them")


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
