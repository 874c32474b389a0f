"""tunewright's typed contracts (`tunewright.dev/v1alpha1`): the FineTuneJob spec, the JobPlan, a job's
progress and measured telemetry. One definition each, for the CRD, the REST API, the CLI and the operator.

Field names are camelCase on the wire, as in every Kubernetes API; Python uses snake_case. The
enumerations and defaults below are the only place they are spelled.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

Strategy = Literal["single", "ddp", "fsdp", "hsdp"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
MethodType = Literal["lora", "full"]
DatasetFormat = Literal["chat", "prompt_completion", "text"]
DEFAULT_EPOCHS = 1
DEFAULT_GLOBAL_BATCH = 16  # sequences per optimizer step when the spec leaves it to tunewright


class CamelModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelSpec(CamelModel):
    source: str = Field(description='Model to fine-tune: "hf://org/name", "org/name", "pvc://claim/path" or "/abs/path".')
    revision: str | None = Field(default=None, description="Hugging Face revision (branch, tag or commit).")


class LoraSpec(CamelModel):
    r: PositiveInt = Field(default=16, description="Adapter rank.")
    alpha: PositiveFloat = Field(default=32, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.05, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1,
                                      description='Modules to adapt, or ["all-linear"].')


class MethodSpec(CamelModel):
    type: MethodType = Field(default="lora", description="LoRA adapters or full fine-tuning.")
    lora: LoraSpec = Field(default_factory=LoraSpec)


class DatasetSpec(CamelModel):
    train: str = Field(description="Training JSONL: an uploaded file id (file-...) or a path/URI the workers read.")
    validation: str | None = Field(default=None, description="Validation JSONL, same forms as train.")
    format: DatasetFormat = Field(default="chat", description="Record format.")


class HyperparametersSpec(CamelModel):
    epochs: PositiveInt = Field(default=DEFAULT_EPOCHS, description="Passes over the data.")
    max_steps: PositiveInt | None = Field(default=None, description="Optimizer steps; overrides epochs.")
    learning_rate: PositiveFloat = Field(default=2e-4, description="Peak learning rate.")
    global_batch_size: PositiveInt | None = Field(
        default=None, description=f"Sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH}).")
    global_batch_tokens: PositiveInt | None = Field(
        default=None, description="Tokens per optimizer step, a multiple of seqLen (instead of globalBatchSize).")
    seq_len: PositiveInt = Field(default=2048, description="Tokens per packed sequence.")
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.03, description="Share of steps warming up.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=0.0, description="AdamW weight decay.")
    seed: int = Field(default=42, description="Data order and initialization seed.")

    @model_validator(mode="after")
    def _one_batch_unit(self) -> HyperparametersSpec:
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set globalBatchSize or globalBatchTokens, not both")
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_len:
            raise ValueError(f"globalBatchTokens ({self.global_batch_tokens}) must be a multiple of seqLen "
                             f"({self.seq_len})")
        return self

    @property
    def sequences_per_step(self) -> int:
        """The global batch in sequences: as given, converted from tokens, or the default."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.global_batch_tokens is not None:
            return self.global_batch_tokens // self.seq_len
        return DEFAULT_GLOBAL_BATCH


class ResourcesSpec(CamelModel):
    pool: str | None = Field(default=None, description="GPUPool to run on (default: the cluster's default pool).")
    max_gpus: PositiveInt | None = Field(default=None, alias="maxGPUs", description="Upper bound on GPUs.")
    strategy: Literal["auto", Strategy] = Field(
        default="auto", description="auto lets the planner choose from model size and network topology.")
    budget_usd: PositiveFloat | None = Field(default=None, alias="budgetUSD",
                                             description="Fastest plan whose predicted cost fits this budget.")
    queue: str | None = Field(default=None, description="Kueue LocalQueue name.")


class CheckpointSpec(CamelModel):
    storage: str | None = Field(default=None, description='Checkpoint storage: "s3://...", "pvc://...", "/path".')
    every_steps: PositiveInt | None = Field(default=None, description="Checkpoint period in optimizer steps.")


class EvaluationSpec(CamelModel):
    every_steps: PositiveInt | None = Field(default=None, description="Validation period (always at start and end).")
    exact_match: bool = Field(default=False, description="Also score greedy answers against the references.")
    max_new_tokens: PositiveInt = Field(default=16, description="Answer length limit for exact match.")


class FineTuneJobSpec(CamelModel):
    model: ModelSpec
    method: MethodSpec = Field(default_factory=MethodSpec)
    dataset: DatasetSpec
    hyperparameters: HyperparametersSpec = Field(default_factory=HyperparametersSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    suspend: bool = Field(default=False, description="Hold the job without running it.")


# --- the plan ----------------------------------------------------------------------------------------


class Predicted(CamelModel):
    """The planner's predictions for one layout (per GPU where it says so)."""

    peak_memory_gib: float = Field(alias="peakMemoryGiB", description="Allocator peak per GPU.")
    step_seconds: float = Field(description="One optimizer step.")
    matmul_seconds: float = Field(description="Matrix products in a step.")
    memory_bound_seconds: float = Field(description="Memory-bound kernels and launches in a step.")
    optimizer_seconds: float = Field(description="The optimizer step (the host's when offloaded).")
    comm_seconds: float = Field(description="Collectives in a step, overlapped or not.")
    exposed_comm_seconds: float = Field(description="Collectives no compute overlaps.")
    offload_seconds: float = Field(description="Host-device copies of offloaded states.")
    exposed_offload_seconds: float = Field(description="Host-device copies no compute overlaps.")
    host_memory_gib_per_node: float = Field(alias="hostMemoryGiBPerNode", description="Offloaded states per node.")
    comm_share: float = Field(description="Share of the step in collectives.")
    exposed_comm_share: float = Field(description="Share of the step in collectives no compute overlaps.")
    mfu: float = Field(description="Model FLOPs utilization (model FLOPs / time / peak bf16 FLOP/s).")
    tokens_per_second: float = Field(description="Trained tokens per second, all GPUs.")
    duration_seconds: float = Field(description="The whole run.")
    cost_usd: float = Field(alias="costUSD", description="GPUs x duration x the pool's price per GPU-hour.")
    memory_breakdown_gib: dict[str, float] = Field(alias="memoryBreakdownGiB", description="Peak memory by part.")


class RejectedOption(CamelModel):
    strategy: str
    gpus: int | None = None
    reason: str


class JobPlan(CamelModel):
    """How a job runs: the layout chosen, its predictions and why; the alternatives rejected and why."""

    pool: str = Field(description="The pool planned on.")
    device: Literal["gpu", "cpu"] = Field(default="gpu", description="cpu: the local backend without GPUs.")
    strategy: Strategy
    workers: PositiveInt = Field(description="Training processes (one per GPU on a GPU pool).")
    gpus: Annotated[int, Field(ge=0)] = Field(description="GPUs held (0 on the CPU).")
    nodes: PositiveInt = 1
    micro_batch: PositiveInt = Field(description="Sequences per forward pass per worker.")
    grad_accum: PositiveInt = Field(description="Micro-batches per optimizer step per worker.")
    activation_checkpointing: bool = False
    shard_group: PositiveInt = Field(default=1, description="Workers one copy of the training state is sharded over.")
    cpu_offload: bool = Field(default=False, description="Sharded states in host memory, optimizer on the CPU.")
    predicted: Predicted | None = Field(default=None, description="None where nothing is modelled (CPU).")
    explanation: str
    rejected: list[RejectedOption] = Field(default_factory=list)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch * self.grad_accum * self.workers


# --- progress and measured telemetry (what `tunewright get` and the FineTuneJob status show) -----------


class JobProgress(CamelModel):
    step: int = 0
    total_steps: int | None = None
    loss: float | None = Field(default=None, description="Training loss of the last logged step.")
    tokens_per_second: float | None = None
    trained_tokens: int = 0
    eta_seconds: float | None = Field(default=None, description="Time left at the pace so far (running jobs).")


class JobTelemetry(CamelModel):
    """Measured, beside the plan's predictions: communication share from the runtime's profiler windows;
    MFU and cost derived with the plan's own FLOPs and price, so the two compare."""

    comm_share: float | None = Field(default=None, description="Share of the step in collectives.")
    comm_share_exposed: float | None = Field(default=None, description="The part no compute overlaps.")
    comm_share_max_rank: float | None = Field(default=None, description="The worst rank's share.")
    comm_measured_at_step: int | None = None
    mfu: float | None = None
    cost_usd: float | None = Field(default=None, alias="costUSD", description="GPUs held x time x price so far.")
