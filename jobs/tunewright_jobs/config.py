"""The job config: the one typed contract of the training runtime.

JSON in, JSON out. Whoever launches a run (the CLI, the API's local backend, the operator) writes this
document; nothing else is read by the trainer. Validation errors name the field path and the reason.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
StrategyType = Literal["single", "ddp", "fsdp", "hsdp"]


class ConfigError(ValueError):
    """A job config that cannot run; the message lists every problem as `field.path: reason`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    source: str = Field(
        description="Local directory, or Hugging Face id (`org/name` or `hf://org/name`)."
    )
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit).")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto", description="Weights dtype for frozen (LoRA) weights. auto: bf16 on GPU, fp32 on CPU."
    )
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = Field(
        default="auto",
        description="auto: varlen (FlashAttention over each packed document) on CUDA where the model allows it, "
                    "else sdpa. varlen: that, or an error where it cannot run.",
    )
    trust_remote_code: bool = False

    @property
    def resolved_source(self) -> str:
        return self.source.removeprefix("hf://")


class LoraConfig(_Strict):
    r: PositiveInt = 16
    alpha: PositiveFloat = 32
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        description='Module names to adapt, or ["all-linear"] for every linear layer but the output head.',
    )
    quantization: Literal["none", "nf4"] = Field(
        default="none",
        description="The frozen base's linear layers (not the output head): none keeps model.dtype; nf4 (QLoRA) "
                    "loads them in 4-bit NF4 with double quantization through bitsandbytes, computing in the compute "
                    "dtype, each rank holding a whole copy (strategy single or ddp, no cpu_offload).",
    )


class DpoConfig(_Strict):
    """Direct Preference Optimization, as TRL's DPOTrainer computes it (loss_type sigmoid)."""

    beta: PositiveFloat = Field(default=0.1, description="How far the policy may move from the reference: the "
                                "reward of a completion is beta x its log-probability ratio to the reference.")
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = Field(
        default=0.0, description="Conservative DPO: the share of preference labels assumed flipped. 0: the "
                                 "sigmoid loss.")
    reference: str | None = Field(
        default=None,
        description="Model folder or Hugging Face id (e.g. an SFT run's merged export) that is both the reference "
                    "and the starting point of the policy; its tokenizer is model.source's. None: model.source.")

    @property
    def resolved_reference(self) -> str | None:
        return None if self.reference is None else self.reference.removeprefix("hf://")


class MethodConfig(_Strict):
    type: Literal["lora", "full"] = "lora"
    lora: LoraConfig = Field(default_factory=LoraConfig)
    objective: Literal["sft", "dpo"] = Field(
        default="sft", description="sft: next-token cross-entropy on the labelled tokens. dpo: preference pairs "
                                   "(dataset.format preference), against a frozen reference (method.dpo).")
    dpo: DpoConfig = Field(default_factory=DpoConfig)


class DatasetConfig(_Strict):
    train: str = Field(description="JSONL file of training examples.")
    validation: str | None = Field(default=None, description="Optional JSONL file of validation examples.")
    format: Literal["chat", "prompt_completion", "text", "preference"] = Field(
        default="chat", description="preference: pairs of a preferred and a rejected answer (method.objective dpo).")
    packing: bool = Field(
        default=True,
        description="Pack several examples per sequence; attention never crosses example boundaries. Preference "
                    "pairs: the sequences of each micro-batch's pairs packed together.",
    )

    @field_validator("format", mode="wrap")
    @classmethod
    def _format_of_an_objective(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        """A format that is none of them is told which objective each one trains."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("Input should be 'chat', 'prompt_completion' or 'text' (method.objective sft), or "
                             "'preference' (method.objective dpo)") from None


class Hyperparameters(_Strict):
    epochs: PositiveInt | None = 1
    max_steps: PositiveInt | None = Field(default=None, description="Optimizer steps; overrides epochs.")
    learning_rate: PositiveFloat = 2e-4
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.03
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    max_grad_norm: PositiveFloat | None = 1.0
    global_batch_size: PositiveInt | None = Field(
        default=None, description="Sequences (packed rows) per optimizer step; preference pairs with objective dpo."
    )
    global_batch_tokens: PositiveInt | None = Field(
        default=None, description="Tokens per optimizer step (= global_batch_size x seq_len)."
    )
    seq_len: PositiveInt = 2048
    seed: int = 42
    optimizer_state: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="Full fine-tuning's weights and AdamW moments: fp32 (master weights, computing on bf16 copies) "
                    "or bf16 (the model itself in bf16, each update rounded stochastically: 8 bytes a parameter "
                    "instead of 16; bf16_adamw.py).",
    )

    @model_validator(mode="after")
    def _one_batch_unit(self) -> Hyperparameters:
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set global_batch_size or global_batch_tokens, not both")
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs or max_steps")
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"global_batch_tokens ({self.global_batch_tokens}) must be a multiple of seq_len ({self.seq_len})"
            )
        return self


class StrategyConfig(_Strict):
    type: StrategyType = "single"
    num_workers: PositiveInt = 1
    use_gpu: bool = False
    micro_batch_size: PositiveInt = 1
    grad_accum: PositiveInt | None = Field(
        default=None, description="Derived from the global batch when unset (1 when neither is set)."
    )
    activation_checkpointing: bool = False
    activation_checkpointing_every: PositiveInt = Field(
        default=1,
        description="With activation_checkpointing: checkpoint one transformer block in every N (the 1st, "
                    "(N+1)-th, ...: ceil(blocks / N) of them; torchtitan's selective layer checkpointing). 1: every "
                    "block.",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="fsdp, hsdp: free each block's gathered weights after its forward (gathered again for its "
                    "backward). false: keep them from forward to backward, one all-gather per block per "
                    "micro-batch instead of two, for the memory of the gathered blocks.",
    )
    precision: Literal["auto", "bf16", "fp32", "fp8"] = Field(
        default="auto",
        description="Compute precision (fp32 master weights and gradient reduction either way). auto: bf16 on GPU. "
                    "fp8: bf16, with the decoder blocks' matrix products in FP8 (tensor-wise scaled; fp8.py): a GPU "
                    "with FP8 tensor cores (compute capability 8.9 or newer).",
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep sharded parameters, gradients and optimizer state in host memory (optimizer steps on the CPU).",
    )
    hsdp_shard_size: PositiveInt | None = Field(
        default=None, description="HSDP: GPUs per sharding group (replicated across groups)."
    )

    @model_validator(mode="after")
    def _shape(self) -> StrategyConfig:
        if self.type == "single" and self.num_workers != 1:
            raise ValueError(f"strategy single runs on 1 worker, got num_workers={self.num_workers}")
        if self.type == "hsdp":
            if self.hsdp_shard_size is None:
                raise ValueError("hsdp needs hsdp_shard_size (GPUs per sharding group)")
            if self.num_workers % self.hsdp_shard_size:
                raise ValueError(
                    f"num_workers ({self.num_workers}) must be a multiple of hsdp_shard_size ({self.hsdp_shard_size})"
                )
        elif self.hsdp_shard_size is not None:
            raise ValueError("hsdp_shard_size only applies to strategy hsdp")
        if self.cpu_offload and not self.use_gpu:
            raise ValueError("cpu_offload moves GPU state to the host: it needs use_gpu: true")
        if self.precision == "fp8" and not self.use_gpu:
            raise ValueError("precision: fp8 runs on FP8 tensor cores, which the CPU has not (its FP8 products are an "
                             "emulation, slower than fp32): set use_gpu: true on a GPU of compute capability 8.9 or "
                             "newer, or precision: auto")
        if self.activation_checkpointing_every > 1 and not self.activation_checkpointing:
            raise ValueError(
                f"activation_checkpointing_every: {self.activation_checkpointing_every} picks the blocks to "
                "checkpoint, but activation_checkpointing is false: set activation_checkpointing: true, or "
                "activation_checkpointing_every: 1")
        if not self.reshard_after_forward and self.type not in ("fsdp", "hsdp"):
            raise ValueError(
                f"reshard_after_forward: false keeps sharded weights gathered, but strategy {self.type} does not "
                "shard them: use strategy fsdp or hsdp, or reshard_after_forward: true")
        return self


class KernelsConfig(_Strict):
    """The training step's fast paths (see kernels.py); auto picks per device and model, and says why."""

    fused_loss: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Output head and cross-entropy fused, in chunks of tokens: the logits never exist whole. "
                    "auto: on unless the model scales or caps its logits.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        default="auto", description="torch.compile each decoder block. auto: on CUDA."
    )
    recompute: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="The compiled blocks recompute their elementwise work in backward (norms, the gated MLP's "
                    "product) instead of keeping its outputs: about a third less activation memory for a Llama "
                    "block, for some memory-bound work. Needs compile. auto: on where a GPU measured it (bf16 LoRA "
                    "sft on CUDA: 26% less memory, 0.4% slower on an H200), off elsewhere.",
    )


class CheckpointConfig(_Strict):
    storage: str | None = Field(
        default=None, description="Where checkpoints go (path or URI); default: <output_dir>/checkpoints."
    )
    every_steps: PositiveInt | None = Field(default=None, description="Checkpoint period; None: only at the end.")
    keep_last: PositiveInt = 2
    export_merged: bool = Field(default=False, description="LoRA: also export base weights with the adapter merged.")
    final: bool = Field(
        default=True, description="Save a last checkpoint and export the model at the end (off for benchmarks)."
    )


class EvalConfig(_Strict):
    every_steps: PositiveInt | None = Field(default=None, description="Validation period; None: only at the end.")
    max_batches: PositiveInt | None = None
    exact_match: bool = Field(
        default=False,
        description="Greedy-generate the answer of each validation example and compare it with the reference.",
    )
    exact_match_max_examples: PositiveInt = 200
    max_new_tokens: PositiveInt = 16


class ProfileConfig(_Strict):
    """Communication-share measurement: a short profiler window, repeated (see commshare.py)."""

    enabled: bool = True
    first_step: NonNegativeInt = Field(default=2, description="First profiled step (0-based): past warm-up.")
    steps: PositiveInt = Field(default=2, description="Steps per profiled window.")
    every_steps: NonNegativeInt = Field(default=100, description="Window repeat period in steps; 0: once.")
    max_overhead: float = Field(default=0.005, gt=0, le=1, description=(
        "Share of the training time the windows may cost: after each window the next is put off until its "
        "measured cost is at most this share of the steps between them (a longer period than every_steps "
        "where steps are short)."))
    trace_dir: str | None = Field(default=None, description="Also write each window's full trace there "
                                                            "(Chrome JSON, gzipped; one file per rank and window).")


class MetricsConfig(_Strict):
    path: str | None = Field(default=None, description="JSONL file of per-step metrics; default: <output_dir>/metrics.jsonl.")
    endpoint: str | None = Field(
        default=None, description="Telemetry URL to post records to as well (token: TUNEWRIGHT_TELEMETRY_TOKEN)."
    )
    log_every_steps: PositiveInt = 1
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    gpu_activity: bool = Field(default=True, description="Read SM-active, tensor-active and DRAM-bandwidth "
                                                          "shares from NVML GPM at each logged window.")


class JobConfig(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")] = "tunewright-job"
    output_dir: str = Field(description="Final export, metrics and (by default) checkpoints.")
    model: ModelConfig
    method: MethodConfig = Field(default_factory=MethodConfig)
    dataset: DatasetConfig
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _batch_divides(self) -> JobConfig:
        self.batch_plan()  # raises with the numbers when the global batch does not divide
        if self.eval.exact_match and self.dataset.validation is None:
            raise ValueError("eval.exact_match: needs dataset.validation")
        self._objective_fits_the_data()
        self._quantized_base_fits_the_layout()
        self._light_state_is_for_full_in_bf16()
        return self

    def _light_state_is_for_full_in_bf16(self) -> None:
        if self.hyperparameters.optimizer_state == "fp32":
            return
        if self.method.type != "full":
            raise ValueError("hyperparameters.optimizer_state: bf16 is for full fine-tuning (LoRA's adapters are "
                             "small and train in fp32): set method.type: full, or optimizer_state: fp32")
        if self.strategy.precision == "fp32":
            raise ValueError("strategy.precision: bf16 weights compute in bf16, not fp32: set precision: auto or "
                             "bf16, or hyperparameters.optimizer_state: fp32")
        if self.model.dtype == "float32":
            raise ValueError("model.dtype: optimizer_state bf16 holds the weights in bf16, not float32: set dtype: "
                             "auto, or hyperparameters.optimizer_state: fp32")

    def _quantized_base_fits_the_layout(self) -> None:
        if self.method.lora.quantization == "none":
            return
        if self.strategy.precision == "fp8":
            raise ValueError("strategy.precision: fp8 products need bf16 weights to cast, not a 4-bit base: set "
                             "precision: auto, or method.lora.quantization: none")
        if self.method.type != "lora":
            raise ValueError("method.lora.quantization: nf4 loads a frozen LoRA base in 4 bits, but method.type full "
                             "trains every weight: set method.type: lora, or quantization: none")
        if self.strategy.type not in ("single", "ddp"):
            raise ValueError(f"strategy.type: a 4-bit (nf4) base is not sharded, so strategy {self.strategy.type} "
                             "cannot hold it: use single or ddp (each rank a whole copy), or quantization: none")
        if self.strategy.cpu_offload:
            raise ValueError("strategy.cpu_offload: a 4-bit (nf4) base stays on the GPU: set cpu_offload: false, "
                             "or method.lora.quantization: none")

    def _objective_fits_the_data(self) -> None:
        dpo, pairs = self.method.objective == "dpo", self.dataset.format == "preference"
        if dpo and not pairs:
            raise ValueError(f"dataset.format: method.objective dpo trains on preference pairs, not "
                             f"{self.dataset.format}: set dataset.format: preference")
        if pairs and not dpo:
            raise ValueError(f"method.objective: preference pairs train with objective dpo, not "
                             f"{self.method.objective}: set method.objective: dpo")

    @property
    def checkpoint_storage(self) -> str:
        return self.checkpoint.storage or str(Path(self.output_dir) / "checkpoints")

    @property
    def weights_source(self) -> tuple[str, str | None]:
        """(where, revision) the starting weights are read from: dpo's reference where one is given (a folder or
        hub id of its own, no revision), else model.source."""
        reference = self.method.dpo.resolved_reference if self.method.objective == "dpo" else None
        if reference is not None:
            return reference, None
        return self.model.resolved_source, self.model.revision

    @property
    def metrics_path(self) -> str:
        return self.metrics.path or str(Path(self.output_dir) / "metrics.jsonl")

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each see different data (every strategy here shards data over all workers)."""
        return self.strategy.num_workers

    def batch_plan(self) -> BatchPlan:
        hp, st = self.hyperparameters, self.strategy
        per_step_local = st.micro_batch_size * self.data_parallel_size
        wanted = hp.global_batch_size or (hp.global_batch_tokens // hp.seq_len if hp.global_batch_tokens else None)
        if wanted is None:
            accum = st.grad_accum or 1
        else:
            if wanted % per_step_local:
                raise ValueError(
                    f"hyperparameters.global_batch_*: {wanted} sequences is not a multiple of micro_batch_size "
                    f"({st.micro_batch_size}) x workers ({self.data_parallel_size})"
                )
            accum = wanted // per_step_local
            if st.grad_accum is not None and st.grad_accum != accum:
                raise ValueError(
                    f"strategy.grad_accum: {st.grad_accum} contradicts the global batch "
                    f"({wanted} = {st.micro_batch_size} x {self.data_parallel_size} x {accum})"
                )
        return BatchPlan(micro_batch_size=st.micro_batch_size, grad_accum=accum,
                         data_parallel_size=self.data_parallel_size)

    # JSON in and out -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> JobConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, cls)) from None

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"job config is not valid JSON: line {err.lineno} column {err.colno}: {err.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError("job config must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.from_json(Path(path).read_text())


class BatchPlan(_Strict):
    micro_batch_size: int
    grad_accum: int
    data_parallel_size: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.data_parallel_size


def format_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"])
        message = error_message(item, model).removeprefix("Value error, ")
        lines.append(f"{path}: {message}" if path else message)
    return "invalid job config:\n  " + "\n  ".join(lines)


# A copy of tunewright_core.spec.error_message (the runtime imports only core's records, not the spec; a
# contract test holds the two to the same answers).
def error_message(error: Mapping[str, Any], model: type[BaseModel]) -> str:
    """One error of a ValidationError raised for `model`, said for a person: its own message, but an unknown key
    names the keys it is closest to, or lists the keys allowed there."""
    if error["type"] != "extra_forbidden":
        return error["msg"]
    *where, key = error["loc"]
    found = _model_at(model, where)
    if found is None:
        return error["msg"]
    wire_names = {name: field.alias or name for name, field in found.model_fields.items()}
    spellings = {**{wire: wire for wire in wire_names.values()}, **wire_names}
    matches = difflib.get_close_matches(str(key), spellings, n=3, cutoff=0.6)
    close = dict.fromkeys(spellings[match] for match in matches)
    if close:
        return f"unknown key; did you mean {' or '.join(close)}?"
    keys = list(wire_names.values())
    return f"unknown key; the keys here are: {', '.join(keys[:12])}{', ...' if len(keys) > 12 else ''}"


def _model_at(annotation: Any, loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose keys are at `loc` within `annotation`, through optional values, list items and dict values."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _model_at(args[0], loc)
    if origin in (Union, UnionType):
        return next((found for arg in args if (found := _model_at(arg, loc)) is not None), None)
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    if not loc:
        return annotation if is_model else None
    step, rest = loc[0], loc[1:]
    if is_model:
        field = next((f for name, f in annotation.model_fields.items() if step in (name, f.alias)), None)
        return None if field is None else _model_at(field.annotation, rest)
    if origin in (list, dict):
        return _model_at(args[-1], rest)
    return None


def total_steps(cfg: JobConfig, steps_per_epoch: int) -> int:
    hp = cfg.hyperparameters
    if hp.max_steps is not None:
        return hp.max_steps
    return int(hp.epochs) * steps_per_epoch


def warmup_steps(cfg: JobConfig, steps: int) -> int:
    return math.ceil(cfg.hyperparameters.warmup_ratio * steps)
