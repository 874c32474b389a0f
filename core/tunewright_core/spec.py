"""tunewright's typed contracts (`tunewright.dev/v1alpha1`): the FineTuneJob spec and status, the JobPlan,
a job's progress and measured telemetry, the GPUPool. One definition each, for the CRDs (generated from
these types by crds.py), the REST API, the CLI and the operator.

Field names are camelCase on the wire, as in every Kubernetes API; Python uses snake_case. The
enumerations and defaults below are the only place they are spelled.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tunewright_core.planner.hardware import GPUS, LINK_WINDOWS_KEPT, LINKS
from tunewright_core.records import Strategy

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

STRATEGIES: tuple[str, ...] = get_args(Strategy)
MethodType = Literal["lora", "full"]
Objective = Literal["sft", "dpo"]
BaseQuantization = Literal["none", "nf4"]  # how a plan loads a LoRA base
StateDtype = Literal["fp32", "bf16"]  # how a plan holds full fine-tuning's weights and AdamW moments
ProductPrecision = Literal["bf16", "fp8"]  # the decoder blocks' matrix products
DatasetFormat = Literal["chat", "prompt_completion", "text", "preference"]
# the dataset format each objective trains on: dpo on preference pairs, sft on any other
PREFERENCE_FORMAT = "preference"
DEFAULT_EPOCHS = 1
DEFAULT_GLOBAL_BATCH = 16  # sequences per optimizer step when the spec leaves it to tunewright


# The acronyms the wire spells in capitals (pricePerGPUHour, peakMemoryGiB, costUSD, dashboardURL).
ACRONYMS = {"Gpu": "GPU", "Gpus": "GPUs", "Gib": "GiB", "Mib": "MiB", "Usd": "USD", "Url": "URL"}


def wire_name(name: str) -> str:
    """A Python (or runtime record) name as the wire spells it: camelCase, its acronyms after the first word in
    capitals (max_gpus: maxGPUs). The one rule for every camelCase key: the spec, the plan, the native API."""
    head, *words = name.split("_")
    return head + "".join(ACRONYMS.get(word.capitalize(), word.capitalize()) for word in words)


class CamelModel(BaseModel):
    """camelCase on the wire (`wire_name`), snake_case in Python; unknown fields refused."""

    model_config = ConfigDict(alias_generator=wire_name, populate_by_name=True, extra="forbid")


def error_message(error: Mapping[str, Any], model: type[BaseModel], loc: Sequence[str | int] | None = None) -> str:
    """One error of a ValidationError raised for `model`, said for a person: its own message, but an unknown key
    names the keys it is closest to (by their wire names), or lists the keys allowed there. `loc`: where the
    error is within `model`, when the error's own location starts outside it (a request's `body`)."""
    if error["type"] != "extra_forbidden":
        return error["msg"]
    *where, key = error["loc"] if loc is None else loc
    found = _model_at(model, where)
    if found is None:
        return error["msg"]
    # a key may be written as its wire name or (populate_by_name) its Python name: both lead to the wire name
    wire_names = {name: field.alias or name for name, field in found.model_fields.items()}
    spellings = {**{wire: wire for wire in wire_names.values()}, **wire_names}
    matches = difflib.get_close_matches(str(key), spellings, n=3, cutoff=0.6)
    close = dict.fromkeys(spellings[match] for match in matches)  # a name and its alias may both match: said once
    if close:
        return f"unknown key; did you mean {' or '.join(close)}?"
    keys = list(wire_names.values())
    return f"unknown key; the keys here are: {', '.join(keys[:12])}{', ...' if len(keys) > 12 else ''}"


_NAMED_FIELD = re.compile(r"^([A-Za-z][\w]*(?:\.[A-Za-z][\w]*)*): (.+)$", re.DOTALL)
_BOUNDS = {"gt": "more than {}", "ge": "at least {}", "lt": "less than {}", "le": "at most {}"}


def described_errors(errors: Sequence[Mapping[str, Any]], model: type[BaseModel], skip: int = 0
                     ) -> list[tuple[str, str]]:
    """A ValidationError's errors for `model` as a person reads them: (where, what), where the wire path of the
    field (empty: the whole document). One per field: a value fitting none of a union's kinds is one error
    naming them all (pydantic's kinds left out of the path); a rule over several fields that names its field
    first ("dataset.format: ...") placed at that field; pydantic's "Value error, " prefix dropped; a number out
    of bounds given its allowed range and default; an unknown key its did-you-mean. `skip`: leading parts of
    each location outside `model` (a request's "body")."""
    merged: dict[tuple, list[str]] = {}
    hints: dict[tuple, str] = {}
    for error in errors:
        loc = _written(model, error["loc"][skip:])
        message = error_message(error, model, loc).removeprefix("Value error, ")
        if (named := _NAMED_FIELD.match(message)) and _names_a_field(model, loc, named.group(1).split(".")):
            loc, message = (*loc, *named.group(1).split(".")), named.group(2)
        if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            hints[loc] = _allowed(model, loc)
        said = merged.setdefault(loc, [])
        if message not in said:
            said.append(message)
    return [(".".join(map(str, loc)), _either(said) + hints.get(loc, "")) for loc, said in merged.items()]


def _written(annotation: Any, loc: Sequence[str | int]) -> tuple:
    """An error's location without pydantic's names for the members of a union ("constrained-float",
    "literal['auto']"): the path of keys and indexes as written."""
    written: list[str | int] = []
    rest = list(loc)
    while rest:
        origin, args = get_origin(annotation), get_args(annotation)
        if origin is Annotated:
            annotation = args[0]
            continue
        if origin in (Union, UnionType):
            members = [arg for arg in args if arg is not type(None)]
            if len(members) > 1:  # pydantic names the member each error is of: not a key
                rest.pop(0)
                members = [m for m in members if _model_at(m, rest[:1]) is not None or get_origin(m) in (list, dict)]
            annotation = members[0] if members else Any
            continue
        step = rest.pop(0)
        written.append(step)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = _field_named(annotation, step)
            annotation = field.annotation if field is not None else Any
        else:  # a list's index or a dict's key, or deeper than the model says
            annotation = args[-1] if origin in (list, dict) else Any
    return tuple(written)


def _names_a_field(model: type[BaseModel], loc: tuple, path: list[str]) -> bool:
    """Whether `path` (a rule's message's first words) is a field within the model at `loc`: the rule is
    then that field's to say."""
    parent = _model_at(model, (*loc, *path[:-1]))
    return parent is not None and _field_named(parent, path[-1]) is not None


def _either(messages: list[str]) -> str:
    """Messages for one field, one per kind of value it could have been, as one sentence."""
    prefix = "Input should be "
    if len(messages) > 1 and all(m.startswith(prefix) and ", " not in m for m in messages):
        return prefix + " or ".join(m.removeprefix(prefix) for m in messages)
    return "; or ".join(messages)


def _allowed(model: type[BaseModel], loc: tuple) -> str:
    """" (allowed: more than 0, at most 100; default 0.1)" for the numeric field at `loc` in `model`."""
    parent = _model_at(model, loc[:-1]) if loc else None
    field = _field_named(parent, loc[-1]) if parent is not None else None
    if field is None:
        return ""
    said = ", ".join(_BOUNDS[kind].format(_number(value)) for kind, value in _constraints(field.annotation,
                                                                                          field.metadata))
    default = "" if field.is_required() or field.default is None else f"; default {_number(field.default)}"
    return f" (allowed: {said}{default})" if said else ""


def _number(value: Any) -> Any:
    """1,000,000,000 rather than 1000000000.0; 0.0002 as it is."""
    return f"{value:,.0f}" if isinstance(value, float) and value.is_integer() else value


def _constraints(annotation: Any, metadata: Sequence[Any]) -> list[tuple[str, Any]]:
    """The numeric bounds (gt, ge, lt, le) on a field, from its own metadata or a member of its union."""
    found = [(kind, getattr(item, kind)) for item in metadata for kind in _BOUNDS if getattr(item, kind, None) is not None]
    if found:
        return found
    for arg in get_args(annotation):
        inner = get_args(arg)
        if get_origin(arg) is Annotated and (found := _constraints(inner[0], [
                m for item in inner[1:] for m in (getattr(item, "metadata", None) or [item])])):
            return found
    return []


def _field_named(model: type[BaseModel], key: str | int) -> Any:
    """The FieldInfo of `model` that `key` names, by its Python name or its wire name (None: no such field)."""
    return next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)


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
        field = _field_named(annotation, step)
        return None if field is None else _model_at(field.annotation, rest)
    if origin in (list, dict):  # an item's index, a value's key
        return _model_at(args[-1], rest)
    return None


def _printable(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("must not contain control characters (a NUL or a newline is never part of a path or name)")
    return value


# a path, URI or name: no control characters; the CRD says the same with a pattern
Printable = Annotated[str, AfterValidator(_printable), Field(json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f]*$"})]


class ModelSpec(CamelModel):
    """The model to start from."""

    source: Printable = Field(min_length=1, max_length=1024,
                        description='Model to fine-tune: "hf://org/name", "org/name", "pvc://claim/path" or "/abs/path".')
    revision: Printable | None = Field(default=None, max_length=255,
                                 description="Hugging Face revision (branch, tag or commit).")


# LoRA's settings with their bounds, wherever a surface takes them (this spec, the OpenAI route's `lora`)
LoraRank = Annotated[int, Field(gt=0, le=4096)]
LoraAlpha = Annotated[float, Field(gt=0, le=1e6)]
LoraDropout = Annotated[float, Field(ge=0, lt=1)]
LoraTargets = Annotated[list[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]],
                        Field(min_length=1, max_length=64)]
LoraQuantization = Literal["none", "nf4", "auto"]


class LoraSpec(CamelModel):
    """LoRA adapters (method.type lora)."""

    r: LoraRank = Field(default=16, description="Adapter rank (at most the model's hidden size).")
    alpha: LoraAlpha = Field(default=32, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: LoraDropout = Field(default=0.05, description="Dropout on the adapter input.")
    target_modules: LoraTargets = Field(default_factory=lambda: ["all-linear"],
                                        description='Modules to adapt, or ["all-linear"].')
    quantization: LoraQuantization = Field(
        default="none", description="The frozen base's weights. none: bf16. nf4 (QLoRA): the decoder blocks' linear "
                                    "weights in 4-bit NF4 (bitsandbytes, double quantization, bf16 compute), about "
                                    "a quarter of their memory, at the price of dequantizing them in every pass "
                                    "(slower steps) and a small quality cost (the adapters learn on rounded "
                                    "weights); one GPU or DDP. auto: nf4 only where a bf16 base fits no GPU count "
                                    "allowed without CPU offload.")


class DpoSpec(CamelModel):
    """Direct preference optimization (method.objective dpo): the policy learns to prefer each example's chosen
    answer over its rejected one, held near a frozen reference model."""

    beta: Annotated[float, Field(gt=0, le=100)] = Field(
        default=0.1, description="Strength of the pull toward the reference model (the KL penalty's weight): "
                                 "higher keeps the policy closer to it.")
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = Field(
        default=0.0, description="Share of preference labels taken to be flipped (conservative DPO); 0 trusts "
                                 "every label.")
    reference: Printable | None = Field(
        default=None, min_length=1, max_length=1024,
        description="The model training starts from and is held near, e.g. an SFT run's merged export, in the forms "
                    "of model.source (same architecture; model.source's tokenizer). Default: model.source. With "
                    "LoRA the reference is those weights with the adapters off; full fine-tuning holds a frozen "
                    "copy of them.")


class MethodSpec(CamelModel):
    """How the model is trained: the objective (SFT or DPO), and LoRA adapters or all weights (either objective)."""

    type: MethodType = Field(default="lora", description="LoRA adapters or full fine-tuning, whatever the "
                                                         "objective.")
    objective: Objective = Field(
        default="sft", description="The training objective: sft learns the answers (dataset.format chat, "
                                   "prompt_completion or text); dpo learns to prefer each chosen answer over its "
                                   "rejected one (dataset.format preference). Orthogonal to type.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="Adapter settings (ignored for full).")
    dpo: DpoSpec = Field(default_factory=DpoSpec, description="DPO settings (ignored for sft).")

    @model_validator(mode="after")
    def _quantized_base_is_lora(self) -> MethodSpec:
        if self.type == "full" and self.lora.quantization == "nf4":
            raise ValueError("lora.quantization: nf4 loads a frozen LoRA base in 4 bits, but type full trains every "
                             "weight: set type lora, or lora.quantization none")
        return self


class DatasetSpec(CamelModel):
    """The data: JSONL in one of four formats (chat, prompt_completion, text; preference for dpo)."""

    train: Printable = Field(min_length=1, max_length=1024,
                       description="Training JSONL: an uploaded file id (file-...) or a path/URI the workers read.")
    validation: Printable | None = Field(default=None, max_length=1024,
                                   description="Validation JSONL, same forms as train.")
    format: DatasetFormat = Field(
        default="chat", description="Record format: chat, prompt_completion or text (objective sft); preference "
                                    "(a prompt, a chosen and a rejected answer: objective dpo).")


class HyperparametersSpec(CamelModel):
    """Optimization settings; the batch is split into micro-batches by the plan."""

    epochs: Annotated[int, Field(gt=0, le=1000)] = Field(default=DEFAULT_EPOCHS, description="Passes over the data.")
    max_steps: Annotated[int, Field(gt=0, le=10_000_000)] | None = Field(
        default=None, description="Optimizer steps; overrides epochs.")
    learning_rate: Annotated[float, Field(gt=0, le=1)] = Field(default=2e-4, description="Peak learning rate.")
    global_batch_size: Annotated[int, Field(gt=0, le=65536)] | None = Field(
        default=None, description=f"Sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH}); with objective "
                                  "dpo, preference pairs (two sequences each).")
    global_batch_tokens: Annotated[int, Field(gt=0, le=2**30)] | None = Field(
        default=None, description="Tokens per optimizer step, a multiple of seqLen (instead of globalBatchSize).")
    seq_len: Annotated[int, Field(gt=0, le=1_048_576)] = Field(
        default=2048, description="Tokens per packed sequence (at most the model's positions).")
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.03, description="Share of steps warming up.")
    weight_decay: Annotated[float, Field(ge=0, le=1)] = Field(default=0.0, description="AdamW weight decay.")
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(default=42, description="Data order and initialization "
                                                                                    "seed.")
    optimizer_state: Literal["fp32", "bf16", "auto"] = Field(
        default="fp32", description="Full fine-tuning's weights and AdamW moments. fp32: master weights (16 bytes "
                                    "a parameter with its gradient). bf16: the weights and moments in bf16, each "
                                    "update rounded stochastically (8 bytes: an 8B model on one 141 GB GPU without "
                                    "offload), at a small quality cost. auto: bf16 only where fp32 fits no GPU "
                                    "count allowed without CPU offload. LoRA's adapters stay fp32.")

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
    """Where and how large: the pool, a cap on GPUs, a forced strategy, a budget, a Kueue queue."""

    pool: str | None = Field(default=None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                             description="GPUPool to run on (default: the cluster's default pool).")
    max_gpus: Annotated[int, Field(gt=0, le=65536)] | None = Field(default=None, description="Upper bound on GPUs.")
    strategy: Literal["auto", Strategy] = Field(
        default="auto", description="auto lets the planner choose from model size and network topology.")
    budget_usd: Annotated[float, Field(gt=0, le=1e9)] | None = Field(
        default=None, description="Fastest plan whose predicted cost fits this budget.")
    queue: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                              description="Kueue LocalQueue name.")
    deadline_seconds: Annotated[int, Field(gt=0, le=366 * 86400)] | None = Field(
        default=None, description="Wall-clock limit of the run (RayJob activeDeadlineSeconds); without a budget, "
                                  "the cheapest plan predicted to finish within it.")
    precision: ProductPrecision = Field(
        default="bf16", description="The decoder blocks' matrix products: bf16, or fp8 (tensor-wise scaled, on the "
                                    "FP8 tensor cores of Ada, Hopper and newer GPUs: twice bf16's rate there, plus "
                                    "the casts, and a small quality cost); the plan says whether it pays. Not with "
                                    "a 4-bit base.")
    max_retries: Annotated[int, Field(ge=0, le=100)] = Field(
        default=2, description="New Ray clusters after a failure (RayJob backoffLimit); each resumes from the "
                               "newest checkpoint.")


class CheckpointSpec(CamelModel):
    """Where checkpoints and the trained adapter or model go; a retried run resumes from the newest."""

    storage: Printable | None = Field(default=None, max_length=1024,
                                description='Checkpoint storage: "pvc://claim/path" on a cluster, a path locally.')
    every_steps: Annotated[int, Field(gt=0, le=10_000_000)] | None = Field(
        default=None, description="Checkpoint period in optimizer steps.")
    credentials_secret: str | None = Field(
        default=None, max_length=253, description="Secret (same namespace) whose keys become the workers' "
                                                  "environment, for object-store storage (e.g. AWS_ACCESS_KEY_ID).")
    export_merged: bool = Field(
        default=False, description="LoRA: also export the base with the adapter folded in (a 4-bit base "
                                   "dequantized to bf16), for tools that cannot load an adapter; as large as the "
                                   "model, and written from the first worker's host memory, which must hold it.")


class EvaluationSpec(CamelModel):
    """Validation during training (needs dataset.validation)."""

    every_steps: Annotated[int, Field(gt=0, le=10_000_000)] | None = Field(
        default=None, description="Validation period (always at start and end).")
    exact_match: bool = Field(default=False, description="Also score greedy answers against the references.")
    max_new_tokens: Annotated[int, Field(gt=0, le=4096)] = Field(default=16, description="Answer length limit for "
                                                                                         "exact match.")


class FineTuneJobSpec(CamelModel):
    """What to fine-tune; tunewright decides how (the plan, in status)."""

    model: ModelSpec = Field(description="The model to start from.")
    method: MethodSpec = Field(default_factory=MethodSpec, description="The objective (sft or dpo), and LoRA or "
                                                                       "full fine-tuning.")
    dataset: DatasetSpec = Field(description="Training (and validation) data.")
    hyperparameters: HyperparametersSpec = Field(default_factory=HyperparametersSpec, description="Optimization.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Pool, GPUs, strategy, budget.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints and results.")
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec, description="Validation during training.")
    suspend: bool = Field(default=False, description="Hold the job without running it.")

    @model_validator(mode="after")
    def _objective_fits_the_format(self) -> FineTuneJobSpec:
        """dpo trains on preference pairs and nothing else does (crds.CEL_RULES says the same to the API server)."""
        dpo, pairs = self.method.objective == "dpo", self.dataset.format == PREFERENCE_FORMAT
        if dpo and not pairs:
            given = "" if "format" in self.dataset.model_fields_set else ", the default where it is not given"
            raise ValueError(f"dataset.format: method.objective dpo trains on preference pairs: set dataset.format "
                             f"to preference (not {self.dataset.format}{given})")
        if pairs and not dpo:
            raise ValueError(f"method.objective: dataset.format preference holds preference pairs, which only "
                             f"objective dpo trains on: set method.objective to dpo (not {self.method.objective})")
        return self

    @model_validator(mode="after")
    def _fp8_casts_bf16_weights(self) -> FineTuneJobSpec:
        if self.resources.precision == "fp8" and self.method.type == "lora" and self.method.lora.quantization == "nf4":
            raise ValueError("resources.precision: fp8 products cast bf16 weights, not a 4-bit base: set "
                             "method.lora.quantization to none or auto, or precision to bf16")
        return self

    @model_validator(mode="after")
    def _bf16_state_is_for_full(self) -> FineTuneJobSpec:
        if self.hyperparameters.optimizer_state == "bf16" and self.method.type != "full":
            raise ValueError("hyperparameters.optimizerState: bf16 is for full fine-tuning (LoRA's adapters are "
                             "small and train in fp32): set method.type to full, or optimizerState to fp32 or auto")
        return self


# --- the plan ----------------------------------------------------------------------------------------


class PredictionBand(CamelModel):
    """P10-P90 of what a run is likely to measure: the prediction times the spread of measured over predicted
    on runs the model was not fitted on, widened where the plan extrapolates (planner/band.py)."""

    tokens_per_second_low: float = Field(description="P10 of trained tokens per second, all GPUs.")
    tokens_per_second_high: float = Field(description="P90 of trained tokens per second, all GPUs.")
    step_seconds_low: float = Field(description="P10 of one optimizer step.")
    step_seconds_high: float = Field(description="P90 of one optimizer step.")
    duration_seconds_low: float = Field(description="P10 of the whole run.")
    duration_seconds_high: float = Field(description="P90 of the whole run.")
    cost_usd_low: float = Field(description="P10 of the cost.")
    cost_usd_high: float = Field(description="P90 of the cost.")
    basis: str = Field(max_length=1024, description="What the band comes from and where the plan extrapolates.")


class Predicted(CamelModel):
    """The planner's predictions for one layout (per GPU where it says so)."""

    peak_memory_gib: float = Field(description="Allocator peak per GPU.")
    step_seconds: float = Field(description="One optimizer step.")
    matmul_seconds: float = Field(description="Matrix products in a step.")
    memory_bound_seconds: float = Field(description="Memory-bound kernels and launches in a step.")
    optimizer_seconds: float = Field(description="The optimizer step (the host's when offloaded).")
    comm_seconds: float = Field(description="Collectives in a step, overlapped or not.")
    exposed_comm_seconds: float = Field(description="Collectives no compute overlaps.")
    offload_seconds: float = Field(description="Host-device copies of offloaded states.")
    exposed_offload_seconds: float = Field(description="Host-device copies no compute overlaps (all of them: the "
                                                       "runs measured hid none).")
    host_memory_gib_per_node: float = Field(description="Offloaded states per node.")
    comm_share: float = Field(description="Share of the step in collectives.")
    exposed_comm_share: float = Field(description="Share of the step in collectives no compute overlaps.")
    mfu: float = Field(description="Model FLOPs utilization (model FLOPs / time / peak bf16 FLOP/s).")
    tokens_per_second: float = Field(description="Trained tokens per second, all GPUs.")
    duration_seconds: float = Field(description="The whole run.")
    cost_usd: float = Field(description="GPUs x duration x the pool's price per GPU-hour.")
    memory_breakdown_gib: dict[str, float] = Field(description="Peak memory by part.")
    memory_margin: float | None = Field(
        default=None, description="Share added to peakMemoryGiB for run-to-run variation before it is held against "
                                  "the usable memory per GPU (absent from plans made before the margin).")
    band: PredictionBand | None = Field(
        default=None, description="How far the time and cost predictions can be trusted (absent from plans made "
                                  "before the band).")


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
    activation_checkpointing_every: PositiveInt = Field(
        default=1, description="With activationCheckpointing: one transformer block in every N checkpointed (the "
                               "1st, (N+1)-th, ...: ceil(blocks / N) of them); 1: every block.")
    reshard_after_forward: bool = Field(
        default=True, description="fsdp, hsdp: false keeps each block's gathered weights from its forward to its "
                                  "backward (one all-gather per block per micro-batch instead of two; more memory).")
    shard_group: PositiveInt = Field(default=1, description="Workers one copy of the training state is sharded over.")
    cpu_offload: bool = Field(default=False, description="Sharded states in host memory, optimizer on the CPU.")
    quantization: BaseQuantization = Field(
        default="none", description="How the frozen LoRA base is loaded: nf4 (4-bit, QLoRA) or none (bf16), as "
                                    "method.lora.quantization asks or, for auto, as the planner chose.")
    optimizer_state: StateDtype = Field(
        default="fp32", description="How full fine-tuning holds its weights and AdamW moments: fp32 masters or bf16, "
                                    "as hyperparameters.optimizerState asks or, for auto, as the planner chose.")
    precision: ProductPrecision = Field(default="bf16", description="The decoder blocks' matrix products, as "
                                                                    "resources.precision asks.")
    predicted: Predicted | None = Field(default=None, description="Absent where nothing is modelled (CPU).")
    link_bus_bytes_per_s: float | None = Field(
        default=None, description="The bus bandwidth the plan's collectives were predicted at on the link that "
                                  "bounds them (across nodes, else within a node): the declared one or what the "
                                  "pool had learned; what a profiler window's measurement is scaled from.")
    explanation: str
    rejected: list[RejectedOption] = Field(default_factory=list)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch * self.grad_accum * self.workers


# --- progress and measured telemetry (what `tunewright get` and the FineTuneJob status show) -----------


class JobProgress(CamelModel):
    step: int = 0
    total_steps: int | None = None
    percent: float | None = Field(default=None, description="Steps done of the total, percent.")
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
    cost_usd: float | None = Field(default=None, description="GPUs held x time x price so far.")


# --- FineTuneJob status (one writer per field: the operator; see operator docs) -----------------------

Phase = Literal["Pending", "Planned", "Queued", "Running", "Suspended", "Succeeded", "Failed", "Cancelled"]
PHASES: tuple[str, ...] = get_args(Phase)
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Cancelled"})


class Condition(CamelModel):
    """The `metav1.Condition` shape, as every Kubernetes API reports conditions."""

    type: str = Field(max_length=316, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                                               r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                      description="CamelCase kind of condition: Planned, Ready, Succeeded, Failed, Suspended.")
    status: Literal["True", "False", "Unknown"]
    observed_generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="The .metadata.generation the condition was set for.")
    last_transition_time: datetime = Field(description="When the status last changed.")
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="CamelCase, machine-readable reason: Unschedulable, BackoffLimitExceeded, ...")
    message: str = Field(default="", max_length=32768, description="What happened and what to do, for a human.")


class FineTuneJobStatus(CamelModel):
    phase: Phase | None = Field(default=None, description="Where the job is in its life.")
    observed_generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="The .metadata.generation this status describes.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    plan: JobPlan | None = Field(default=None, description="How the job runs, predicted before it runs.")
    ray_job_name: str | None = Field(default=None, description="The RayJob running this job.")
    dashboard_url: str | None = Field(default=None, description="The Ray dashboard.")
    start_time: datetime | None = Field(default=None, description="When its pods first ran.")
    completion_time: datetime | None = Field(default=None, description="When it ended.")
    progress: JobProgress | None = None
    telemetry: JobTelemetry | None = Field(default=None, description="Measured, beside plan.predicted.")


# --- GPUPool ------------------------------------------------------------------------------------------


class Toleration(CamelModel):
    """The core `Toleration` shape, applied to the pool's worker pods."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class GPUPoolSpec(CamelModel):
    gpu: Literal[tuple(GPUS)] = Field(description="GPU type (the planner's catalog: memory, bf16 FLOP/s, HBM and "  # type: ignore[valid-type]
                                                  "host bandwidth).")
    gpus_per_node: Annotated[int, Field(gt=0, le=64)] = Field(description="GPUs per node used for training.")
    max_nodes: Annotated[int, Field(gt=0, le=4096)] = Field(description="Nodes a job may use at most.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Labels the pool's nodes carry.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints of the pool's nodes to tolerate.")
    intra_node: Literal[tuple(LINKS)] = Field(description="How a node's GPUs are joined (NVLink or PCIe).")  # type: ignore[valid-type]
    inter_node: Literal[tuple(LINKS)] | None = Field(  # type: ignore[valid-type]
        default=None, description="How nodes are joined (InfiniBand or Ethernet); none for one-node jobs only.")
    price_per_gpu_hour: Annotated[float, Field(ge=0)] = Field(description="What one GPU costs per hour (USD).")
    host_memory_gib: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="Host memory per node (for CPU offload plans).")
    worker_image: str = Field(min_length=1, max_length=1024, description="Image of the Ray head and workers.")
    default: bool = Field(default=False, description="Jobs that name no pool run here.")
    learn_links: bool = Field(default=False, description=(
        "Fold the bandwidth each profiler window of a multi-GPU job on this pool measured into "
        "status.measuredLinks (tunewright's API writes it), and plan on it instead of the declared links."))


class MeasuredLink(CamelModel):
    """What the profiler windows of a pool's jobs measured of one of its links: a running mean."""

    bus_bytes_per_second: Annotated[float, Field(ge=0)] = Field(
        description="Bus bandwidth the collectives got (the declared one scaled by predicted / measured time).")
    windows: Annotated[int, Field(ge=1, le=LINK_WINDOWS_KEPT)] = Field(
        description=f"Profiler windows in the mean (the last {LINK_WINDOWS_KEPT} at most).")
    last_job: str = Field(max_length=253, description="The job whose window was folded in last.")
    measured_at: Annotated[float, Field(ge=0)] = Field(description="When (Unix seconds).")


class MeasuredLinks(CamelModel):
    intra_node: MeasuredLink | None = Field(default=None, description="Between a node's GPUs.")
    inter_node: MeasuredLink | None = Field(default=None, description="Between nodes.")


class LearnedFactor(CamelModel):
    """What the profiler windows of one kind of a pool's jobs measured of its GPUs' compute: a running mean."""

    factor: Annotated[float, Field(gt=0)] = Field(
        description="The catalog's matmul and memory-bound efficiencies times this make the predicted compute "
                    "what the windows measured (catalog-efficiency compute / measured compute).")
    windows: Annotated[int, Field(ge=1, le=LINK_WINDOWS_KEPT)] = Field(
        description=f"Profiler windows in the mean (the last {LINK_WINDOWS_KEPT} at most).")
    last_job: str = Field(max_length=253, description="The job whose window was folded in last.")
    measured_at: Annotated[float, Field(ge=0)] = Field(description="When (Unix seconds).")


class MeasuredEfficiency(CamelModel):
    """What the profiler windows of a pool's jobs measured of its GPUs' compute, apart for jobs on one GPU and
    jobs across several: the catalog's efficiencies differ between the two where published runs across GPUs ran
    lower than ours on one (the H100's)."""

    gpu: Literal[tuple(GPUS)] = Field(description="The GPU type measured (a record of another type is not used).")  # type: ignore[valid-type]
    one_gpu: LearnedFactor | None = Field(default=None, description=(
        "Windows of jobs on one GPU, over the catalog's one-GPU efficiencies; where none is, plans on one GPU "
        "take the catalog's, or the several-GPU factor where the catalog's two are one."))
    several_gpus: LearnedFactor | None = Field(default=None, description=(
        "Windows of jobs across GPUs, over the catalog's several-GPU efficiencies; where none is, plans across "
        "GPUs take the one-GPU factor."))


class GPUPoolStatus(CamelModel):
    """What the operator discovered from the Nodes matching the pool's selector."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    nodes: int = Field(default=0, description="Matching nodes.")
    allocatable_gpus: int = Field(default=0, description="nvidia.com/gpu allocatable on them, in all.")
    gpu_products: list[str] = Field(default_factory=list,
                                    description="nvidia.com/gpu.product labels seen (GPU feature discovery).")
    gpu_memory_mib: int | None = Field(default=None, description="nvidia.com/gpu.memory label seen (the smallest).")
    disagreements: list[str] = Field(default_factory=list, description="Where the nodes contradict the spec.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    measured_links: MeasuredLinks | None = Field(default=None, description=(
        "Links as the pool's jobs measured them (with spec.learnLinks); clear it to forget them."))
    measured_efficiency: MeasuredEfficiency | None = Field(default=None, description=(
        "Compute efficiency as the pool's jobs measured it (with spec.learnLinks); clear it to forget it."))
