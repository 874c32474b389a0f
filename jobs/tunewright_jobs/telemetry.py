"""The telemetry records: the runtime's second typed contract, after the job config.

Rank 0 emits them, one JSON object per line of `metrics.jsonl` and, when `metrics.endpoint` is set, the
same objects POSTed to the API as `{"records": [...]}`. The API parses them with models of its own; this
module is the reference they follow.

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
`eval` (at step 0 of a fresh run, every `eval.every_steps`, and at the end; only with a validation set)
    val_loss: mean cross-entropy over the validation set's labelled tokens (at most `eval.max_batches`
    micro-batches per rank).  val_token_accuracy: share of those tokens predicted exactly.
    exact_match: share of validation answers generated exactly (greedy, after stripping);
    exact_match_examples: how many were scored. Both only when exact match ran (`eval.exact_match`: at step 0
    and at the end), else null.
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

import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from tunewright_jobs.config import StrategyType


def _now() -> float:
    return round(time.time(), 3)


class _Strict(BaseModel):
    # Unknown fields are refused, so a misspelt field fails where the record is made.
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Record(_Strict):
    event: str  # narrowed to one literal by each kind
    time: float = Field(default_factory=_now)
    step: int


class StartRecord(_Record):
    event: Literal["start"] = "start"
    total_steps: int
    steps_per_epoch: int
    strategy: StrategyType
    workers: int
    device: Literal["cpu", "cuda"]
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    seq_len: int
    parameters: int
    trainable_parameters: int
    train_examples: int
    truncated_examples: int


class StepRecord(_Record):
    event: Literal["step"] = "step"
    epoch: int
    loss: float
    learning_rate: float
    grad_norm: float
    tokens: int
    tokens_per_second: float
    step_seconds: float
    data_seconds: float
    forward_backward_seconds: float
    optimizer_seconds: float
    peak_memory_gib: float | None = None
    peak_memory_reserved_gib: float | None = None
    sm_active_share: float | None = None
    tensor_active_share: float | None = None
    dram_bandwidth_share: float | None = None
    kernel_active_share: float | None = None
    gpu_activity_unavailable: str | None = None


class EvalMetrics(_Strict):
    val_loss: float
    val_token_accuracy: float
    exact_match: float | None = None
    exact_match_examples: int | None = None


class EvalRecord(EvalMetrics, _Record):
    event: Literal["eval"] = "eval"


class CommRecord(_Record):
    event: Literal["comm"] = "comm"
    profiled_steps: int
    profiled_step_seconds: float
    comm_share: float
    comm_share_exposed: float
    comm_seconds_per_step: float
    exposed_comm_seconds_per_step: float
    comm_share_max_rank: float
    comm_share_exposed_max_rank: float
    wait_seconds_per_step: float | None = None
    transfer_seconds_per_step: float | None = None
    rank_own_seconds_min: float | None = None
    rank_own_seconds_median: float | None = None
    rank_own_seconds_max: float | None = None
    slowest_rank: int | None = None
    # what the window added to the run (its wall time, analysis included, less its steps' usual time) and
    # where the next one opens (spaced to keep the windows within metrics.profile.max_overhead)
    window_cost_seconds: float | None = None
    next_window_step: int | None = None
    # GPU kernels of the window (mean over ranks; absent on the CPU): matrix products, attention, the rest
    # of the compute, and the share of the window any kernel ran
    matmul_seconds_per_step: float | None = None
    attention_seconds_per_step: float | None = None
    other_compute_seconds_per_step: float | None = None
    gpu_busy_share: float | None = None


class CheckpointRecord(_Record):
    event: Literal["checkpoint"] = "checkpoint"
    uri: str
    train_loss: float | None
    keep_last: int
    seconds: float | None = None  # writing it, all ranks (the training waits for it)


class ExportPaths(_Strict):
    adapter: str | None = None
    merged: str | None = None
    model: str | None = None


class EndRecord(_Record):
    event: Literal["end"] = "end"
    steps: int
    final_loss: float | None
    eval_before: EvalMetrics | None
    eval_after: EvalMetrics | None
    export: ExportPaths
    strategy: StrategyType
    workers: int
    resumed_from_step: int


TelemetryRecord = Annotated[
    StartRecord | StepRecord | EvalRecord | CommRecord | CheckpointRecord | EndRecord,
    Field(discriminator="event"),
]
_RECORD = TypeAdapter(TelemetryRecord)


def read_records(path: str | Path) -> list[TelemetryRecord]:
    """Every record of a `metrics.jsonl` file; a line that breaks the contract raises, naming the field."""
    return [_RECORD.validate_json(line) for line in Path(path).read_text().splitlines() if line.strip()]
