"""The telemetry records: the runtime's second typed contract, after the job config.

Rank 0 of the runtime (`tunewright_jobs`) emits them, one JSON object per line of `metrics.jsonl` and, when
`metrics.endpoint` is set, the same objects POSTed to the API as `{"records": [...]}`. Defined once, here,
with their bounds: the runtime makes them (unknown fields refused, so a misspelt field fails where the record
is made); the API accepts each kind in its `accepted_form` (only what it needs required, unknown fields
ignored so a newer runtime's additions do not break an older API, a diverged value stored as null).

Every record has:
- `event`: its kind, one of the literals below (the discriminator);
- `time`: wall-clock UNIX seconds, to the millisecond, when the record was made;
- `step`: optimizer steps completed when it was made (0 before training).

Fields that are not optional are always present; optional ones are present as `null` when absent. Units
are in the names (`_seconds`, `_gib`, `tokens`); a `share` is a fraction in [0, 1]. Floats may be the JSON
extensions `NaN` / `Infinity` (a diverged loss), as Python's `json` writes and reads them.
A resumed run trains the steps past its checkpoint again and emits their records again: `metrics.jsonl`
drops the earlier ones on resume; a consumer of the POSTed records should let the latest of a step win.

`start` (once, when a run starts from step 0; a resumed run does not emit it again)
    total_steps, steps_per_epoch: optimizer steps of the run and of one epoch.
    strategy: single | ddp | fsdp | hsdp.  workers: ranks.  device: cpu | cuda.
    micro_batch_size, grad_accum, global_batch_size: sequences per micro-batch, micro-batches per rank per
    step, sequences per optimizer step.  seq_len: tokens per sequence.
    parameters, trainable_parameters: model parameters, all and trained.
    train_examples: training examples after tokenizing; truncated_examples: those cut to seq_len.
`step` (every `metrics.log_every_steps` steps and at the last; one record covers the steps since the last)
    epoch: 0-based epoch of the last step.  loss: mean cross-entropy over every labelled token of those steps,
    all ranks.  learning_rate, grad_norm: of the last step (the norm before clipping).
    tokens: non-padding tokens trained, all ranks.  tokens_per_second: tokens over the wall time.
    step_seconds, data_seconds, forward_backward_seconds, optimizer_seconds: per step, the wall time and its
    parts (waiting for data; forward and backward; clipping and the optimizer step) on rank 0.
    peak_memory_gib, peak_memory_reserved_gib: rank 0's peak GPU memory allocated / reserved by PyTorch
    since the process started; CUDA only.
    sm_active_share, tensor_active_share, dram_bandwidth_share: over the window, mean over ranks, from
    NVML GPM (`gpu_activity.py`): the share of SM time busy, of SM time issuing tensor-core work, and of
    peak DRAM bandwidth used. null where not read, with gpu_activity_unavailable saying why.
    kernel_active_share: NVML `utilization.gpu` over the window (any kernel running, however small), mean
    over ranks; null where not read.
    With `method.objective: dpo` a step's batch is preference pairs: loss is the mean DPO loss over the
    window's pairs, and over them (null otherwise): chosen_reward, rejected_reward: the mean reward of the
    chosen and of the rejected answers (beta x the answer's log-probability ratio to the reference model);
    reward_margin: the mean of chosen less rejected reward; preference_accuracy: the share of pairs whose
    chosen reward is the higher.
`eval` (at step 0 of a fresh run, every `eval.every_steps`, and at the end; only with a validation set)
    val_loss: mean cross-entropy over the validation set's labelled tokens (at most `eval.max_batches`
    micro-batches per rank).  val_token_accuracy: share of those tokens predicted exactly.
    exact_match: share of validation answers generated exactly (greedy, after stripping);
    exact_match_examples: how many were scored. Both only when exact match ran (`eval.exact_match`: at step 0
    and at the end), else null.
    With `method.objective: dpo`, over the validation pairs: val_loss is the mean DPO loss,
    val_token_accuracy that of the chosen answers' tokens; preference_accuracy, reward_margin as in `step`
    (null otherwise).
`comm` (after each profiled window, `metrics.profile`; `step`: the window's last step, counted from 1)
    profiled_steps: steps in the window.  profiled_step_seconds: wall time per step in the window.
    comm_share: share of the window spent in collectives, mean over ranks; comm_share_exposed: the part no
    compute overlaps.  comm_seconds_per_step, exposed_comm_seconds_per_step: the same as seconds per step.
    comm_share_max_rank, comm_share_exposed_max_rank: the worst rank's shares.
    wait_seconds_per_step, transfer_seconds_per_step: comm_seconds_per_step split into waiting for the
    slowest rank and the rest, mean over ranks (commshare.Stragglers says how it is estimated).
    rank_own_seconds_min / _median / _max: per rank, the step time less its exposed communication (its
    own work); slowest_rank: the rank with the most, the one the others wait for.
`checkpoint` (once a checkpoint is complete in its store)
    uri: where it lives (a path, or a URI for remote storage), as its store names it.
    train_loss: `loss` of the last `step` record this process emitted (null when none yet).
    keep_last: the store keeps only the newest keep_last checkpoints and deletes older ones, so records
    of older checkpoints name folders that are gone.
`end` (once, after the final evaluation and, with `checkpoint.final`, the last checkpoint and the export;
rank 0 also writes it to `<output_dir>/result.json`)
    steps: optimizer steps of the run.  final_loss: as `train_loss` above, at the end.
    eval_before, eval_after: the evaluation's fields (as in `eval`) before training (null on a resumed run)
    and at the end; null without a validation set.
    export: paths of the exported `adapter` (LoRA), `merged` (LoRA with `checkpoint.export_merged`) and
    `model` (full fine-tuning) folders, `<output_dir>/final/...`; null where not exported.
    strategy, workers: as in `start`.  resumed_from_step: the checkpoint step the run resumed from, 0 if none.
"""

from __future__ import annotations

import math
import time
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, create_model, model_validator

MAX_STEP = 10**9
Strategy = Literal["single", "ddp", "fsdp", "hsdp"]  # the spec's and the job config's strategies


def _now() -> float:
    return round(time.time(), 3)


def _bounded_when_finite(value: float | None) -> float | None:
    if value is not None and math.isfinite(value) and abs(value) > 1e12:
        raise ValueError("must be within ±1e12")
    return value


def _share_when_finite(value: float | None) -> float | None:
    if value is not None and math.isfinite(value) and not 0 <= value <= 1:
        raise ValueError("a share is within [0, 1]")
    return value


Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Steps = Annotated[int, Field(gt=0, le=MAX_STEP)]
Count = Annotated[int, Field(ge=0, le=10**15)]
Share = Annotated[float, Field(ge=0, le=1)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
GiB = Annotated[float, Field(ge=0, le=1e6)]
Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
# a measured value that may diverge (NaN, infinity: a diverged loss) or be unknown (null)
Measured = Annotated[float | None, AfterValidator(_bounded_when_finite)]
MeasuredShare = Annotated[float | None, AfterValidator(_share_when_finite)]


class _Strict(BaseModel):
    # Unknown fields are refused, so a misspelt field fails where the record is made.
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Record(_Strict):
    event: str  # narrowed to one literal by each kind
    time: Annotated[float, Field(ge=0, le=1e11)] = Field(default_factory=_now)
    step: Step


class StartRecord(_Record):
    event: Literal["start"] = "start"
    total_steps: Steps
    steps_per_epoch: Steps
    strategy: Strategy
    workers: Annotated[int, Field(gt=0, le=1_000_000)]
    device: Literal["cpu", "cuda"]
    micro_batch_size: Steps
    grad_accum: Steps
    global_batch_size: Steps
    seq_len: Steps
    parameters: Count
    trainable_parameters: Count
    train_examples: Count
    truncated_examples: Count


class StepRecord(_Record):
    """One logged window of optimizer steps (one step when logging every step)."""

    event: Literal["step"] = "step"
    epoch: Step
    loss: Measured
    learning_rate: Measured
    grad_norm: Measured
    tokens: Count
    tokens_per_second: Annotated[float, Field(ge=0, le=1e12)]
    step_seconds: Seconds
    data_seconds: Seconds
    forward_backward_seconds: Seconds
    optimizer_seconds: Seconds
    peak_memory_gib: GiB | None = None
    peak_memory_reserved_gib: GiB | None = None
    # NVML GPM over the window (mean over ranks); kernel-active is NVML's utilization.gpu
    sm_active_share: Share | None = None
    tensor_active_share: Share | None = None
    dram_bandwidth_share: Share | None = None
    kernel_active_share: Share | None = None
    gpu_activity_unavailable: Annotated[str, Field(max_length=500)] | None = None
    # objective dpo, over the window's preference pairs (mean rewards: beta x log-ratio to the reference)
    chosen_reward: Measured = None
    rejected_reward: Measured = None
    reward_margin: Measured = None
    preference_accuracy: MeasuredShare = None


class EvalMetrics(_Strict):
    val_loss: Measured
    val_token_accuracy: MeasuredShare
    exact_match: MeasuredShare = None
    exact_match_examples: Count | None = None
    # objective dpo, over the validation pairs
    preference_accuracy: MeasuredShare = None
    reward_margin: Measured = None


class EvalRecord(EvalMetrics, _Record):
    event: Literal["eval"] = "eval"


class CommRecord(_Record):
    """A profiler window's communication share (docs/architecture.md, "Telemetry definitions")."""

    event: Literal["comm"] = "comm"
    profiled_steps: Steps
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
    # what the window added to the run (its wall time, analysis included, less its steps' usual time) and
    # where the next one opens (spaced to keep the windows within metrics.profile.max_overhead)
    window_cost_seconds: Seconds | None = None
    next_window_step: Step | None = None
    # GPU kernels of the window (mean over ranks; absent on the CPU): matrix products, attention, the rest
    # of the compute, and the share of the window any kernel ran
    matmul_seconds_per_step: Seconds | None = None
    attention_seconds_per_step: Seconds | None = None
    other_compute_seconds_per_step: Seconds | None = None
    gpu_busy_share: Share | None = None


class CheckpointRecord(_Record):
    """A checkpoint committed by the runtime's store; the store keeps only the newest `keep_last`."""

    event: Literal["checkpoint"] = "checkpoint"
    uri: Path_
    train_loss: Measured
    keep_last: Annotated[int, Field(gt=0, le=10**6)]
    seconds: Seconds | None = None  # writing it, all ranks (the training waits for it)


class ExportPaths(_Strict):
    adapter: Path_ | None = None
    merged: Path_ | None = None
    model: Path_ | None = None


class EndRecord(_Record):
    """The run's result (what it also writes to result.json)."""

    event: Literal["end"] = "end"
    steps: Step
    final_loss: Measured
    eval_before: EvalMetrics | None
    eval_after: EvalMetrics | None
    export: ExportPaths
    strategy: Strategy
    workers: Annotated[int, Field(gt=0, le=1_000_000)]
    resumed_from_step: Step


TelemetryRecord = Annotated[
    StartRecord | StepRecord | EvalRecord | CommRecord | CheckpointRecord | EndRecord,
    Field(discriminator="event"),
]
_RECORD = TypeAdapter(TelemetryRecord)


def read_records(path: str | Path) -> list[TelemetryRecord]:
    """Every record of a `metrics.jsonl` file; a line that breaks the contract raises, naming the field."""
    return [_RECORD.validate_json(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --- the form the API accepts ------------------------------------------------------------------------------

def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _as_stored(value: Any, model: type[BaseModel] | None) -> Any:
    """A value as the API keeps it: non-finite floats as null (SQL's JSON has no NaN), and of a nested
    record only the fields its model knows."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict) and model is not None:
        return {k: _as_stored(v, next(iter(_models_in(model.model_fields[k].annotation)), None))
                for k, v in value.items() if k in model.model_fields}
    return value


class _Accepted(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    _record: ClassVar[type[BaseModel]]

    @model_validator(mode="before")
    @classmethod
    def _as_the_api_keeps_it(cls, raw: Any) -> Any:
        return _as_stored(raw, cls._record) if isinstance(raw, dict) else raw


def accepted_form(record: type[_Record], needs: tuple[str, ...], defaults: dict[str, Any] | None = None
                  ) -> type[BaseModel]:
    """The record as the API accepts it: the same fields with the same bounds, of which only `needs` (and
    `event`, `step`) must be sent; the rest default to `defaults` or null. Unknown fields, here and in
    nested records, are ignored; a non-finite value is read as null (refused where null is not allowed)."""
    defaults = {"time": 0.0, **(defaults or {})}
    fields: dict[str, Any] = {}
    for name, field in record.model_fields.items():
        annotation: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        if name in ("event", "step", *needs):
            fields[name] = (annotation, ...)
        else:
            fields[name] = (annotation | None, defaults.get(name))
    accepted = create_model(record.__name__, __base__=_Accepted, __doc__=record.__doc__, **fields)
    accepted._record = record
    return accepted
