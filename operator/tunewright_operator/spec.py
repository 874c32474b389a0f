"""The FineTuneJob spec (`tunewright.dev/v1alpha1`): one typed definition for the CRD, the REST API and the CLI.

Field names are camelCase on the wire, as in every Kubernetes API; Python uses snake_case.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelSpec(_Spec):
    source: str = Field(description='Model to fine-tune: "hf://org/name", "org/name", "pvc://claim/path" or "/abs/path".')
    revision: str | None = Field(default=None, description="Hugging Face revision (branch, tag or commit).")


class LoraSpec(_Spec):
    r: PositiveInt = Field(default=16, description="Adapter rank.")
    alpha: PositiveFloat = Field(default=32, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.05, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1,
                                      description='Modules to adapt, or ["all-linear"].')


class MethodSpec(_Spec):
    type: Literal["lora", "full"] = Field(default="lora", description="LoRA adapters or full fine-tuning.")
    lora: LoraSpec = Field(default_factory=LoraSpec)


class DatasetSpec(_Spec):
    train: str = Field(description="Training JSONL: an uploaded file id (file-...) or a path/URI the workers read.")
    validation: str | None = Field(default=None, description="Validation JSONL, same forms as train.")
    format: Literal["chat", "prompt_completion", "text"] = Field(default="chat", description="Record format.")


class HyperparametersSpec(_Spec):
    epochs: PositiveInt | None = Field(default=None, description="Passes over the data (default 1).")
    max_steps: PositiveInt | None = Field(default=None, description="Optimizer steps; overrides epochs.")
    learning_rate: PositiveFloat = Field(default=2e-4, description="Peak learning rate.")
    global_batch_size: PositiveInt | None = Field(default=None, description="Sequences per optimizer step.")
    global_batch_tokens: PositiveInt | None = Field(default=None, description="Tokens per optimizer step.")
    seq_len: PositiveInt = Field(default=2048, description="Tokens per packed sequence.")
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.03, description="Share of steps warming up.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=0.0, description="AdamW weight decay.")
    seed: int = Field(default=42, description="Data order and initialization seed.")

    @model_validator(mode="after")
    def _one_batch_unit(self) -> HyperparametersSpec:
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set globalBatchSize or globalBatchTokens, not both")
        return self


class ResourcesSpec(_Spec):
    pool: str | None = Field(default=None, description="GPUPool to run on (default: the cluster's default pool).")
    max_gpus: PositiveInt | None = Field(default=None, alias="maxGPUs", description="Upper bound on GPUs.")
    strategy: Literal["auto", "single", "ddp", "fsdp", "hsdp"] = Field(
        default="auto", description="auto lets the planner choose from model size and network topology.")
    budget_usd: PositiveFloat | None = Field(default=None, alias="budgetUSD",
                                             description="Fastest plan whose predicted cost fits this budget.")
    queue: str | None = Field(default=None, description="Kueue LocalQueue name.")


class CheckpointSpec(_Spec):
    storage: str | None = Field(default=None, description='Checkpoint storage: "s3://...", "pvc://...", "/path".')
    every_steps: PositiveInt | None = Field(default=None, description="Checkpoint period in optimizer steps.")


class EvaluationSpec(_Spec):
    every_steps: PositiveInt | None = Field(default=None, description="Validation period (always at start and end).")
    exact_match: bool = Field(default=False, description="Also score greedy answers against the references.")
    max_new_tokens: PositiveInt = Field(default=16, description="Answer length limit for exact match.")


class FineTuneJobSpec(_Spec):
    model: ModelSpec
    method: MethodSpec = Field(default_factory=MethodSpec)
    dataset: DatasetSpec
    hyperparameters: HyperparametersSpec = Field(default_factory=HyperparametersSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    suspend: bool = Field(default=False, description="Hold the job without running it.")
