"""The training loop, top to bottom: config → data, model, optimizer → train_step → `Trainer.run`.

The same `train` runs in one process, under torchrun and inside a Ray Train worker; what differs
(process group, device, where checkpoints go) arrives in `Runtime`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tunewright_core.records import (
    CheckpointRecord,
    EndRecord,
    EvalMetrics,
    EvalRecord,
    ExportPaths,
    StartRecord,
    StepRecord,
)
from tunewright_jobs import checkpoint as ckpt
from tunewright_jobs.bf16_adamw import Bf16AdamW
from tunewright_jobs.checkpoint import CheckpointStore
from tunewright_jobs.components import SLOW_RANK_ENV as SLOW_RANK_ENV  # where tests and benchmarks import it
from tunewright_jobs.components import step_components
from tunewright_jobs.config import JobConfig, total_steps, warmup_steps
from tunewright_jobs.data import (
    IGNORE_INDEX,
    EpochBatches,
    Rows,
    StepInputs,
    chat_prompt,
    eval_rows,
    micro_batches,
    read_jsonl,
    stop_token_ids,
    tokenize_dataset,
)
from tunewright_jobs.evaluate import exact_match, validation_metrics
from tunewright_jobs.export import export_final
from tunewright_jobs.fp8 import keep_frozen_casts
from tunewright_jobs.gpu_activity import GpuActivitySampler, pack, unpack_sum
from tunewright_jobs.kernels import Kernels, compile_blocks, for_evaluation, loss_sum, to_device
from tunewright_jobs.kernels import prepare as prepare_kernels
from tunewright_jobs.metrics import HttpSink, JsonlSink, MetricsSink, NullSink, PhaseTimer, TeeSink
from tunewright_jobs.model import (
    load_model,
    load_tokenizer,
    parameter_counts,
    transformer_blocks,
)
from tunewright_jobs.parallel import Dist, MasterWeights, gradient_sync, wrap_model
from tunewright_jobs.preference import (
    Pair,
    PairBatches,
    PreferenceObjective,
    prompt_and_answer,
    reference_copy,
    tokenize_pairs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    dist: Dist
    checkpoints: CheckpointStore


@dataclass
class StepStats:
    loss_sum: torch.Tensor  # this rank's summed loss (device tensor: read at log time only)
    targets: int  # what the loss is a mean over in the global batch: labelled tokens (sft) or pairs (dpo)
    tokens: int  # non-padding tokens in the global batch
    grad_norm: torch.Tensor
    lr: float
    statistics: torch.Tensor  # this rank's sums of the objective's own statistics (none for sft)


# --- building blocks ---------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(cfg: JobConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in params:
        (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on biases and norms
    groups = [{"params": decay, "weight_decay": cfg.hyperparameters.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.hyperparameters.optimizer_state == "bf16":  # bf16 weights and moments, rounded stochastically
        return Bf16AdamW(groups, lr=cfg.hyperparameters.learning_rate, betas=(0.9, 0.999),
                         seed=cfg.hyperparameters.seed)
    # One fused kernel per parameter group, which also clips (`clip_gradients`). Offloaded parameters (on the
    # host while the job's device is a GPU) take the foreach implementation.
    fused = not cfg.strategy.cpu_offload
    return torch.optim.AdamW(groups, lr=cfg.hyperparameters.learning_rate, betas=(0.9, 0.999),
                             fused=fused, foreach=not fused)


def clip_gradients(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                   max_norm: float | None) -> torch.Tensor:
    """The gradients' total norm (before clipping), and their clipping to `max_norm`. The fused optimizer
    divides each gradient by its `grad_scale` as it reads it (as it does for `GradScaler`), which saves
    clip_grad_norm_'s own multiply: a read of every gradient and its launches."""
    # each group's own flag decides its step (a resumed optimizer takes its checkpoint's)
    if not all(group.get("fused") for group in optimizer.param_groups):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the norm over every shard
        norm = norm.full_tensor()
    # clip_grad_norm_'s factor, min(1, max_norm / (norm + 1e-6)), as the divisor the optimizer applies
    optimizer.grad_scale = None if max_norm is None else torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def lr_multiplier(schedule: str, step: int, warmup: int, total: int) -> float:
    """Linear warmup to the peak, then cosine or linear decay to 0 at `total` (or constant)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(cfg: JobConfig, optimizer, steps: int):
    warmup = warmup_steps(cfg, steps)
    schedule = cfg.hyperparameters.lr_schedule
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(schedule, s, warmup, steps))


# --- the objectives ----------------------------------------------------------------------------------


class NextTokenObjective:
    """Cross-entropy of every labelled token (`method.objective: sft`) on packed rows. The objective is what
    the loop asks for a step's micro-batches, their loss, the record's own fields and the evaluation; DPO's
    is `preference.PreferenceObjective`."""

    statistics = 0

    def __init__(self, cfg: JobConfig, model, kernels: Kernels, dist: Dist, pad_id: int):
        self.cfg, self.model, self.kernels, self.dist, self.pad_id = cfg, model, kernels, dist, pad_id
        self.no_statistics = torch.zeros(0, device=dist.device)

    def micro_batches(self, batch: Rows) -> StepInputs:
        dist, targets = self.dist, int((batch.labels != IGNORE_INDEX).sum())
        mbs = [to_device(mb, dist.device, self.kernels)
               for mb in micro_batches(batch, dist.rank, dist.world_size, self.cfg.strategy.micro_batch_size)]
        return StepInputs(targets, int(batch.real_tokens.sum()), mbs)

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum(self.model, batch, self.kernels), self.no_statistics

    def step_fields(self, sums: list[float], targets: int) -> dict:
        return {}

    def evaluate(self, rows: Rows) -> dict[str, float]:
        cfg = self.cfg
        return validation_metrics(self.model, rows, self.dist, cfg.strategy.micro_batch_size, self.pad_id,
                                  cfg.eval.max_batches)


def build_objective(cfg: JobConfig, model, frozen, kernels: Kernels, dist: Dist, pad_id: int):
    """The run's objective over the wrapped `model`; `frozen`: DPO's reference copy (`reference_copy`)."""
    if cfg.method.objective == "dpo":
        return PreferenceObjective(cfg, model, frozen, kernels, dist, pad_id)
    return NextTokenObjective(cfg, model, kernels, dist, pad_id)


# --- one optimizer step ------------------------------------------------------------------------------


def train_step(cfg: JobConfig, model, objective, masters: MasterWeights, optimizer, scheduler, batch,
               dist: Dist, timer: PhaseTimer) -> StepStats:
    """Forward/backward over this rank's micro-batches, then clip and step.

    The loss is the mean over the global batch's units (every labelled token, or every preference pair; all
    micro-batches, all ranks), whatever the packing: each micro-batch's summed loss is divided by that global
    count (known to every rank, since each sees the whole global batch), times the world size that gradient
    averaging divides by.
    """
    inputs = objective.micro_batches(batch)
    scale = dist.world_size / max(inputs.units, 1)
    mbs = inputs.micro_batches
    timer.start_step()
    total = torch.zeros((), device=dist.device)
    statistics = torch.zeros(objective.statistics, device=dist.device)
    try:
        for i, mb in enumerate(mbs):
            gradient_sync(model, cfg, last_micro_batch=i == len(mbs) - 1)
            masters.last_micro_batch(i == len(mbs) - 1)
            loss, sums = objective.loss(mb)
            (loss * scale).backward()
            total += loss.detach()
            statistics += sums
        timer.mark("forward_backward")
        grad_norm = clip_gradients(optimizer, masters.trainable, cfg.hyperparameters.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        masters.refresh()  # after the gradients are freed, the copies take their place; after a failure too
    scheduler.step()
    timer.mark("optimizer")
    return StepStats(total, inputs.units, inputs.tokens, grad_norm.detach(), lr, statistics)


# --- the run -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    batches: EpochBatches | PairBatches
    steps: int
    train_examples: int  # examples, or preference pairs
    truncated: int
    val_rows: Rows | list[Pair] | None  # the validation set as its objective evaluates it: rows, or pairs
    val_records: list[dict] | None


def prepare_data(cfg: JobConfig, tokenizer) -> PreparedData:
    """Read, validate, tokenize and size the datasets: every error surfaces here, before training."""
    if cfg.dataset.format == "preference":
        return prepare_pairs(cfg, tokenizer)
    ds, hp = cfg.dataset, cfg.hyperparameters
    train_data = tokenize_dataset(tokenizer, read_jsonl(ds.train, ds.format), ds.format, hp.seq_len, ds.train)
    batches = EpochBatches(train_data, hp.seq_len, tokenizer.pad_token_id, ds.packing, hp.seed,
                           cfg.batch_plan().global_batch_size)
    val_rows = val_records = None
    if ds.validation:
        val_records = read_jsonl(ds.validation, ds.format)
        val_data = tokenize_dataset(tokenizer, val_records, ds.format, hp.seq_len, ds.validation)
        val_rows = eval_rows(val_data, hp.seq_len, tokenizer.pad_token_id, ds.packing)
    return PreparedData(batches, total_steps(cfg, batches.steps_per_epoch), len(train_data.examples),
                        train_data.truncated, val_rows, val_records)


def prepare_pairs(cfg: JobConfig, tokenizer) -> PreparedData:
    """`prepare_data` for preference pairs: batches of pairs; the validation pairs in file order."""
    ds, hp = cfg.dataset, cfg.hyperparameters
    train_data = tokenize_pairs(tokenizer, read_jsonl(ds.train, ds.format), hp.seq_len, ds.train)
    batches = PairBatches(train_data, hp.seed, cfg.batch_plan().global_batch_size)
    val_pairs = val_records = None
    if ds.validation:
        val_records = read_jsonl(ds.validation, ds.format)
        val_pairs = tokenize_pairs(tokenizer, val_records, hp.seq_len, ds.validation).pairs
    return PreparedData(batches, total_steps(cfg, batches.steps_per_epoch), len(train_data.pairs),
                        train_data.truncated, val_pairs, val_records)


def preflight(cfg: JobConfig) -> PreparedData:
    """What a launcher runs before asking for workers or GPUs."""
    return prepare_data(cfg, load_tokenizer(cfg))


def answer_pairs(cfg: JobConfig, tokenizer, records: list[dict]) -> tuple[list[str], list[str]]:
    records = records[: cfg.eval.exact_match_max_examples]
    if cfg.dataset.format == "chat":
        pairs = [chat_prompt(tokenizer, r["messages"]) for r in records]
    elif cfg.dataset.format == "preference":  # scored against the chosen answer
        pairs = [prompt_and_answer(tokenizer, r) for r in records]
    else:
        pairs = [(r["prompt"], r["completion"]) for r in records]
    return [p for p, _ in pairs], [a for _, a in pairs]


@dataclass(frozen=True)
class Every:
    """Due after every `interval`-th of a run's `steps` steps (None: never). After the last step only `last`
    ones are: the run's end evaluates and saves for itself."""
    interval: int | None
    steps: int
    last: bool = False

    def due(self, done: int) -> bool:
        if done == self.steps:
            return self.last
        return bool(self.interval) and done % self.interval == 0


class LogWindow:
    """The steps since the last `step` record: their stats, their phases' and data's times, and the wall time
    they took, less the evaluations and checkpoints within it (`paused`): they are no step's."""

    def __init__(self, dist: Dist, gpu_activity: bool, objective):
        self.dist, self.objective = dist, objective
        self.timer = PhaseTimer(dist.device)
        self.gpu_activity = GpuActivitySampler(dist.device, enabled=gpu_activity)
        self.restart()

    def restart(self) -> None:
        self.steps: list[StepStats] = []
        self.epoch = 0  # of the latest step
        self.started, self.data_seconds, self.paused = time.perf_counter(), 0.0, 0.0

    def add(self, stats: StepStats, epoch: int, data_seconds: float) -> None:
        self.steps.append(stats)
        self.epoch = epoch
        self.data_seconds += data_seconds

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.paused += time.perf_counter() - started

    def record(self, step: int) -> StepRecord:
        """Collective: every rank reads its own GPU and adds its loss."""
        return summarize_window(step, self.epoch, self.steps, self.timer.collect(), self.data_seconds,
                                time.perf_counter() - self.started - self.paused, self.dist, self.gpu_activity,
                                self.objective)

    def close(self) -> None:
        self.gpu_activity.close()


class Trainer:
    """One run of a job. Everything is built once, at the step the run resumes from (the metrics file and the
    profiler's first window depend on it); `run` is the loop. What a run does only when asked for around its
    steps is in `components`."""

    def __init__(self, cfg: JobConfig, runtime: Runtime):
        self.cfg, self.dist, self.checkpoints = cfg, runtime.dist, runtime.checkpoints
        self.tokenizer = load_tokenizer(cfg)
        self.data = prepare_data(cfg, self.tokenizer)
        self.steps = self.data.steps
        self.build_model()
        self.optimizer = build_optimizer(cfg, self.masters.trainable)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.steps)
        self.start_step = self.resume()
        self.sink = open_sink(cfg, self.dist, self.start_step)
        self.components = step_components(cfg, self.dist, self.steps, self.start_step, self.sink)
        self.validating = self.data.val_rows is not None
        self.log_every = Every(cfg.metrics.log_every_steps, self.steps, last=True)
        self.evaluate_every = Every(cfg.eval.every_steps if self.validating else None, self.steps)
        self.save_every = Every(cfg.checkpoint.every_steps, self.steps)
        self.train_loss: float | None = None  # of the last logged window

    def build_model(self) -> None:
        """The model wrapped for the strategy, its master weights and kernels, and what the `start` record and
        exact match read off the model before it is wrapped."""
        cfg, dist = self.cfg, self.dist
        # Same seed on every rank while new weights (LoRA adapters) are drawn: FSDP keeps each rank's own
        # shard of them, so they must agree. Afterwards each rank gets its own stream, for dropout.
        seed_everything(cfg.hyperparameters.seed)
        model = load_model(cfg, dist.device)
        self.total_params, self.trainable_params = parameter_counts(model)
        # Exact match scores answers cut where the exported model's generation stops.
        self.stop_ids = stop_token_ids(self.tokenizer, cfg.dataset.format, model.generation_config.eos_token_id)
        self.kernels = prepare_kernels(cfg, model, dist.device)
        frozen = reference_copy(cfg, model, dist)  # DPO's reference in full fine-tuning: the initial weights
        blocks = transformer_blocks(model)  # found by class name, which sharding changes
        self.model, self.masters = wrap_model(cfg, model, dist)
        if cfg.strategy.precision == "fp8":  # where the weights now are, before the blocks are traced
            log.info("fp8: %d frozen weights kept as their FP8 casts", keep_frozen_casts(blocks, dist.device))
        if self.kernels.compile_blocks:
            compile_blocks(blocks, self.kernels.recompute)
        self.objective = build_objective(cfg, self.model, frozen, self.kernels, dist, self.tokenizer.pad_token_id)
        seed_everything(cfg.hyperparameters.seed + 1 + dist.rank)
        self.model.train()

    def resume(self) -> int:
        """The step the run starts at: the latest checkpoint's (model, optimizer and schedule restored), or 0."""
        with self.checkpoints.latest() as path:
            if path is None:
                return 0
            with self.masters.masters_installed():
                state = ckpt.read_checkpoint(path, self.model, self.optimizer, self.scheduler, self.dist)
            self.masters.refresh()
            log.info("resumed from %s at step %d", path, state["step"])
            return state["step"]

    def run(self) -> dict:
        """From the resumed step to the last: each step, then its record, evaluation and checkpoint if due."""
        eval_before = self.start()
        # opened after `start`, whose evaluation is no step's time
        self.window = LogWindow(self.dist, self.cfg.metrics.gpu_activity, self.objective)
        try:
            for step in range(self.start_step, self.steps):
                self.step(step)
                done = step + 1
                if self.log_every.due(done):
                    self.log(done)
                if self.evaluate_every.due(done):
                    with self.window.pause():
                        self.evaluate(done, with_exact_match=False)
                if self.save_every.due(done):
                    with self.window.pause():
                        self.save(done)
        finally:
            self.components.close()
        return self.finish(eval_before)

    def start(self) -> EvalMetrics | None:
        """A new run's `start` record, and its evaluation before training (a resumed run had both)."""
        if self.start_step > 0:
            return None
        cfg, data, plan = self.cfg, self.data, self.cfg.batch_plan()
        self.sink.emit(StartRecord(step=0, total_steps=self.steps, steps_per_epoch=data.batches.steps_per_epoch,
                                   strategy=cfg.strategy.type, workers=self.dist.world_size,
                                   device=self.dist.device.type, micro_batch_size=plan.micro_batch_size,
                                   grad_accum=plan.grad_accum, global_batch_size=plan.global_batch_size,
                                   seq_len=cfg.hyperparameters.seq_len, parameters=self.total_params,
                                   trainable_parameters=self.trainable_params,
                                   train_examples=data.train_examples, truncated_examples=data.truncated))
        return self.evaluate(0, cfg.eval.exact_match) if self.validating else None

    def step(self, step: int) -> None:
        """Optimizer step `step` (from 0), between the components' points around it; it joins the log window."""
        started = time.perf_counter()
        epoch, batch = self.data.batches.step_rows(step)
        data_seconds = time.perf_counter() - started
        self.components.before_step(step)
        stats = train_step(self.cfg, self.model, self.objective, self.masters, self.optimizer, self.scheduler, batch,
                           self.dist, self.window.timer)
        self.window.add(stats, epoch, data_seconds)
        self.components.after_step(step)

    def log(self, done: int) -> None:
        """The `step` record of the steps up to `done`; the next window starts after it is written."""
        record = self.window.record(done)
        self.sink.emit(record)
        self.train_loss = record.loss
        self.window.restart()

    def evaluate(self, step: int, with_exact_match: bool) -> EvalMetrics:
        """Validation loss and accuracy (and exact match of generated answers), as an `eval` record."""
        cfg, model, tokenizer = self.cfg, self.model, self.tokenizer
        with for_evaluation(model):
            scores = self.objective.evaluate(self.data.val_rows)
            if with_exact_match:
                prompts, refs = answer_pairs(cfg, tokenizer, self.data.val_records)
                scores |= exact_match(model, tokenizer, prompts, refs, self.dist, cfg.eval.max_new_tokens,
                                      self.stop_ids)
        self.sink.emit(EvalRecord(step=step, **scores))
        return EvalMetrics(**scores)

    def save(self, step: int) -> None:
        """The checkpoint of step `step`, and its record."""
        started = time.perf_counter()
        with self.masters.masters_installed():
            self.checkpoints.save(step, {"step": step, "loss": self.train_loss},
                                  lambda path: self.write_checkpoint(path, step))
        self.sink.emit(CheckpointRecord(step=step, uri=self.checkpoints.location(step), train_loss=self.train_loss,
                                        keep_last=self.cfg.checkpoint.keep_last,
                                        seconds=time.perf_counter() - started))

    def write_checkpoint(self, path: Path, step: int) -> None:
        """This rank's part of the checkpoint: model, optimizer, schedule, and where the data stands."""
        per_epoch = self.data.batches.steps_per_epoch
        trainer_state = {"step": step, "epoch": step // per_epoch, "step_in_epoch": step % per_epoch,
                         "total_steps": self.steps, "world_size": self.dist.world_size, "config_name": self.cfg.name}
        ckpt.write_checkpoint(path, self.model, self.optimizer, self.scheduler, trainer_state, self.dist)

    def finish(self, eval_before: EvalMetrics | None) -> dict:
        """After the last step: the final evaluation, checkpoint and export; the `end` record, result.json."""
        self.window.close()
        eval_after = self.evaluate(self.steps, self.cfg.eval.exact_match) if self.validating else None
        exported = self.save_and_export() if self.cfg.checkpoint.final else ExportPaths()
        end = EndRecord(step=self.steps, steps=self.steps, final_loss=self.train_loss, eval_before=eval_before,
                        eval_after=eval_after, export=exported, strategy=self.cfg.strategy.type,
                        workers=self.dist.world_size, resumed_from_step=self.start_step)
        self.sink.emit(end)
        self.sink.close()
        result = end.model_dump(mode="json")
        if self.dist.is_main:
            (Path(self.cfg.output_dir) / "result.json").write_text(json.dumps(result, indent=2))
        return result

    def save_and_export(self) -> ExportPaths:
        """The final checkpoint (`checkpoint.final`), and the model exported in Hugging Face format."""
        # a run resumed from the final checkpoint itself: saving it again would collide
        if self.start_step < self.steps:
            self.save(self.steps)
        with self.masters.masters_installed():
            return export_final(self.cfg, self.model, self.tokenizer, self.dist)


def train(cfg: JobConfig, runtime: Runtime) -> dict:
    return Trainer(cfg, runtime).run()


def open_sink(cfg: JobConfig, dist: Dist, start_step: int) -> MetricsSink:
    if not dist.is_main:
        return NullSink()
    file_sink = JsonlSink(cfg.metrics_path, resume_step=start_step if start_step else None)
    if cfg.metrics.endpoint is None:
        return file_sink
    return TeeSink(file_sink, HttpSink(cfg.metrics.endpoint, os.environ.get("TUNEWRIGHT_TELEMETRY_TOKEN")))


def summarize_window(step: int, epoch: int, window: list[StepStats], phases: dict[str, float],
                     data_seconds: float, wall: float, dist: Dist, gpu_activity: GpuActivitySampler,
                     objective) -> StepRecord:
    """The `step` record of the steps since the last log (one step when logging every step)."""
    loss_sum, *statistics = torch.stack([torch.cat([s.loss_sum[None], s.statistics]) for s in window]).sum(0).tolist()
    activity = gpu_activity.read()
    loss_sum, *sums = dist.all_reduce_sum([loss_sum, *statistics, *pack(activity)])
    statistics, activity_sums = sums[:len(statistics)], sums[len(statistics):]
    sm_active, tensor_active, dram_bandwidth, kernel_active = unpack_sum(activity_sums)
    targets = sum(s.targets for s in window)
    tokens = sum(s.tokens for s in window)
    cuda = dist.device.type == "cuda"
    return StepRecord(
        step=step,
        epoch=epoch,
        loss=loss_sum / max(targets, 1),
        learning_rate=window[-1].lr,
        grad_norm=window[-1].grad_norm.item(),
        tokens=tokens,
        tokens_per_second=tokens / wall,
        step_seconds=wall / len(window),
        data_seconds=data_seconds / len(window),
        forward_backward_seconds=phases.get("forward_backward", 0.0) / len(window),
        optimizer_seconds=phases.get("optimizer", 0.0) / len(window),
        peak_memory_gib=torch.cuda.max_memory_allocated(dist.device) / 2**30 if cuda else None,
        peak_memory_reserved_gib=torch.cuda.max_memory_reserved(dist.device) / 2**30 if cuda else None,
        sm_active_share=sm_active, tensor_active_share=tensor_active, dram_bandwidth_share=dram_bandwidth,
        kernel_active_share=kernel_active,
        gpu_activity_unavailable=activity.unavailable if sm_active is None else None,
        **objective.step_fields(statistics, targets),
    )
