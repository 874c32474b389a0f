"""What the API answers, beside its tables' `*Public` shapes (`models.py`): one typed definition per contract,
so the OpenAPI document says what every route returns, for the CLI, the dashboard and any other client.

One casing rule: camelCase on tunewright's own routes (/v1/jobs, /v1/pools, /v1/plans, /v1/tokens; as the spec
and the plan), snake_case on the OpenAI-compatible ones (/v1/files, /v1/fine_tuning). Where both kinds of route
answer the same thing (a job's events and checkpoints, a list), the native shape is the OpenAI one's subclass in
camelCase (`NativeAnswer`, `Page`). A fine-tuning job's `tunewright` object is tunewright's own and stays
camelCase. A few shapes the official OpenAI client also sends are defined here too (its hyperparameters and
method), since the fine-tuning job answers them back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    RootModel,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from tunewright_api.models import (
    FilePublic,
    JobPublic,
    ListEnvelope,
    NativeAnswer,
    Page,
    TokenPublic,
    camel_keys,
)
from tunewright_api.states import JobStatus
from tunewright_core.planner.hardware import GPUS, LINKS
from tunewright_core.spec import (
    CamelModel,
    GPUPoolSpec,
    GPUPoolStatus,
    JobPlan,
    JobProgress,
    JobTelemetry,
    MeasuredEfficiency,
    MeasuredLinks,
    Predicted,
)

# Every field of these is in every answer (nulls included): the document marks each one required.
ALWAYS_ANSWERED = ConfigDict(json_schema_serialization_defaults_required=True)


class Answer(BaseModel):
    """Base of the answers whose every field is always present."""

    model_config = ALWAYS_ANSWERED


class AsWritten(BaseModel):
    """A document served as its source wrote it (a pool's row, a backend's own pool, a cluster's GPUPool):
    checked against the model's fields when it is read, then answered unchanged: the same keys (no default
    filled in), the same nulls (none added) and the same numbers (no 4 answered as 4.0)."""

    _written: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_written(cls, data: Any, handler):
        model = handler(data)
        if isinstance(data, dict):
            model._written = data
        return model

    @model_serializer(mode="wrap")
    def _as_written(self, handler):  # no return annotation: the document keeps the model's own schema
        return handler(self) if self._written is None else self._written


def download(description: str, *media_types: str) -> dict:
    """`responses=` of a route answering a file's bytes (response_class=FileResponse), in these media types."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {200: {"description": description, "content": dict.fromkeys(media_types, binary)}}


# --- health ------------------------------------------------------------------------------------------


class Health(Answer):
    """The process answers (liveness)."""

    status: Literal["ok"] = "ok"


class Readiness(Answer):
    """The API can serve requests: its database answers (readiness)."""

    status: Literal["ready"] = "ready"
    backend: Literal["local", "kubernetes"] = Field(description="Where jobs run: this machine, or a Kubernetes "
                                                                "cluster (FineTuneJobs for the operator).")


# --- what a DELETE answers ---------------------------------------------------------------------------


class Deleted(Answer):
    """What a DELETE removed (OpenAI's shape)."""

    id: str
    object: str = Field(description="What it was: file, token or tunewright.job.")
    deleted: bool = True


# --- a job's records ---------------------------------------------------------------------------------


class EventPublic(Answer):
    """Something that happened to a job, in OpenAI's fine-tuning event shape."""

    id: str = Field(description="ftevent-<n>; `after` takes it for the page of older events.")
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int = Field(description="Unix seconds.")
    level: str = Field(description="info, warning or error.")
    message: str
    type: str = Field(description="message: what happened to the job; metrics: a record the run reported (its "
                                  "fields in `data`).")
    data: dict[str, Any] | None = Field(description="A metrics event's record: step and training loss, a profiler "
                                                     "window's communication shares, an evaluation's scores, as "
                                                     "the runtime named them (snake_case); null for a message.")


class JobEventPublic(NativeAnswer, EventPublic):
    """An event on the native route: the same as the OpenAI-shaped one, camelCase, a metrics event's record
    (`data`) too."""

    data: Annotated[dict[str, Any] | None, AfterValidator(camel_keys)] = Field(description=(
        "A metrics event's record: step and training loss, a profiler window's communication shares, an "
        "evaluation's scores (the runtime's fields, camelCase); null for a message."))


class CheckpointMetrics(Answer):
    """The training loss at a checkpoint's step."""

    step: int
    train_loss: float | None


class CheckpointPublic(Answer):
    """A committed checkpoint as the runtime registered it, in OpenAI's fine-tuning checkpoint shape."""

    id: str = Field(description="ftckpt-<job hex>-<step>; `after` takes it for the page of older checkpoints.")
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int = Field(description="Unix seconds.")
    step_number: int
    fine_tuned_model_checkpoint: str = Field(description="Where it is stored: a path, or pvc://claim/path on a "
                                                         "cluster.")
    fine_tuning_job_id: str
    metrics: CheckpointMetrics


class JobCheckpointMetrics(NativeAnswer, CheckpointMetrics):
    """The training loss at a checkpoint's step (native route: trainLoss)."""


class JobCheckpointPublic(NativeAnswer, CheckpointPublic):
    """A checkpoint on the native route: the same as the OpenAI-shaped one, camelCase."""

    metrics: JobCheckpointMetrics


class MetricPointPublic(NativeAnswer):
    """One logged step: `step`, `time`, and the measurements of the runtime's step record (StepRecord in
    tunewright_core.records) in camelCase: loss, learningRate, gradNorm, tokens, tokensPerSecond, stepSeconds,
    dataSeconds, forwardBackwardSeconds, optimizerSeconds, peakMemoryGiB, the GPU activity shares
    (smActiveShare, ...) or gpuActivityUnavailable. A measurement the record did not carry is absent, not null."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, int | float | str | None] = Field(init=False)

    step: int
    time: float = Field(description="Unix seconds when the runtime emitted the record.")

    @model_validator(mode="before")
    @classmethod
    def _camel_case(cls, data: Any) -> Any:
        return camel_keys(data)


class ArtifactPublic(NativeAnswer):
    """One file of what a job exported; GET /v1/jobs/{job_id}/artifacts/{path} serves it."""

    object: Literal["artifact"] = "artifact"
    path: str = Field(description="Its path in the export, e.g. adapter/adapter_config.json.")
    bytes: int


# --- lists -------------------------------------------------------------------------------------------


class TokenList(Page[TokenPublic]):
    """API tokens, newest first (never their secrets)."""


class FileList(ListEnvelope[FilePublic]):
    """Files, newest first."""


class JobList(Page[JobPublic]):
    """Jobs, newest first."""


class EventList(ListEnvelope[EventPublic]):
    """A job's events, newest first."""


class JobEventList(Page[JobEventPublic]):
    """A job's events, newest first (native route)."""


class MetricPointList(Page[MetricPointPublic]):
    """A job's logged steps in step order, evenly downsampled to at most `maxPoints` (the last step kept)."""


class CheckpointList(ListEnvelope[CheckpointPublic]):
    """A job's committed checkpoints, newest first."""


class JobCheckpointList(Page[JobCheckpointPublic]):
    """A job's committed checkpoints, newest first (native route)."""


class LogLines(Page[str]):
    """The last lines the run printed, oldest first (none before it starts)."""


class ArtifactList(Page[ArtifactPublic]):
    """The files a job exported (the adapter, the merged or the full model), by path."""


# --- a job's telemetry over time ---------------------------------------------------------------------

SmActive = Annotated[float | None, Field(description="Share of SM time busy, mean over GPUs (NVML GPM).")]
TensorActive = Annotated[float | None, Field(description="Share of SM time issuing tensor-core work (NVML GPM).")]
DramBandwidth = Annotated[float | None, Field(description="Share of peak DRAM bandwidth used (NVML GPM).")]
KernelActive = Annotated[float | None, Field(description="Share of time any kernel ran, however small (NVML "
                                                         "utilization.gpu).")]


class TelemetryLatest(JobTelemetry):
    """A job's measured values now, beside its plan's (what GET /metrics exports for each running job)."""

    model_config = ALWAYS_ANSWERED

    step: int = Field(description="Optimizer steps done.")
    tokens_per_second: float | None = Field(description="Trained tokens per second, all workers (latest step).")
    tokens_per_second_median: float | None = Field(description="Trained tokens per second, all workers: the median "
                                                             "over the logged steps (the run's pace: the first step "
                                                             "compiles, the last may be short).")
    goodput: float | None = Field(description="Step time over the time the GPUs were held.")
    data_wait_share: float | None = Field(description="Share of the step spent waiting for data.")
    gpu_busy_share: float | None = Field(description="Share of the profiled steps any GPU kernel ran (last "
                                                     "profiler window).")
    sm_active: SmActive
    tensor_active: TensorActive
    dram_bandwidth: DramBandwidth
    kernel_active: KernelActive
    sm_active_unavailable: str | None = Field(description="Why smActive is null (the runtime's reason); null when "
                                                          "it was measured.")
    cost_per_million_tokens_usd: float | None = Field(description="Cost so far per million trained tokens.")
    projected_cost_usd: float | None = Field(description="Cost so far, plus the time left "
                                                                                  "at the plan's price.")


class TelemetryPoint(CamelModel):
    """One logged step's measures (the dashboard's charts)."""

    step: int
    time: float = Field(description="Unix seconds when the runtime emitted the record.")
    loss: float | None
    tokens_per_second: float | None
    mfu: float | None = Field(description="Measured, with the plan's FLOPs and peak; null without a prediction.")
    step_seconds: float | None
    data_seconds: float | None
    peak_memory_gib: float | None
    sm_active: SmActive
    tensor_active: TensorActive
    dram_bandwidth: DramBandwidth
    kernel_active: KernelActive
    reward_margin: float | None = Field(description="dpo: the mean reward of the chosen answers less that of the "
                                                    "rejected (beta x log-ratio to the reference); null for sft.")
    preference_accuracy: float | None = Field(description="dpo: the share of pairs whose chosen answer has the "
                                                          "higher reward; null for sft.")


class RankOwnSeconds(CamelModel):
    """Each rank's own work per step in a profiler window (outside the collectives): the fastest, the median and
    the slowest rank's."""

    min: float | None
    median: float | None
    max: float | None


class CommWindow(CamelModel):
    """A profiler window: the share of the step in collectives, and where their time went."""

    step: int
    comm_share: float = Field(description="Share of the step in collectives.")
    comm_share_exposed: float = Field(description="The part no compute overlaps.")
    gpu_busy_share: float | None = Field(description="Share of the profiled steps any GPU kernel ran.")
    wait_seconds_per_step: float | None = Field(description="Collectives' time waiting for the slowest rank.")
    transfer_seconds_per_step: float | None = Field(description="Collectives' time moving data.")
    slowest_rank: int | None
    rank_own_seconds: RankOwnSeconds


class EvaluationPoint(CamelModel):
    """An evaluation on the validation set."""

    step: int
    val_loss: float | None
    val_token_accuracy: float | None
    exact_match: float | None = Field(description="Share of greedy answers matching the reference (with "
                                                  "evaluation.exactMatch).")
    preference_accuracy: float | None = Field(default=None, description="dpo: share of held-out pairs whose "
                                                                      "chosen answer the policy ranks above the rejected.")
    reward_margin: float | None = Field(default=None, description="dpo: mean chosen reward minus rejected reward "
                                                                "(beta x log-ratio to the reference).")


class JobTelemetryReport(NativeAnswer):
    """A job's measured telemetry beside its plan's predictions: now (`latest`) and over time (`series` per
    logged step, `comm` per profiler window, `evaluations`)."""

    object: Literal["tunewright.job.telemetry"] = "tunewright.job.telemetry"
    job_id: str
    status: JobStatus
    predicted: Predicted | None = Field(description="The plan's predictions; null where nothing is modelled (CPU).")
    latest: TelemetryLatest
    series: list[TelemetryPoint] = Field(description="Per logged step, at most 500 (evenly downsampled).")
    comm: list[CommWindow] = Field(description="Per profiler window, oldest first.")
    evaluations: list[EvaluationPoint] = Field(description="Oldest first.")


# --- OpenAI-compatible fine-tuning jobs --------------------------------------------------------------


class OpenAIHyperparameters(BaseModel):
    """OpenAI's hyperparameters: asked for ("auto": tunewright chooses; null is read as "auto", as the official
    client's model_dump() gives the ones it was not given), and answered as chosen."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is refused, not ignored

    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = Field(default="auto", description="Examples per optimizer step (dpo: "
                                                                         "preference pairs).")
    learning_rate_multiplier: float | Literal["auto"] = Field(
        default="auto", description="Times the method's base learning rate (supervised: 2e-4 for lora, 2e-5 for "
                                    "full; dpo: 1e-5 for lora, 1e-6 for full).")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_auto(cls, value: object) -> object:
        """null as "auto": the official client's model_dump() of hyperparameters it was not given."""
        return "auto" if value is None else value


class OpenAIDpoHyperparameters(OpenAIHyperparameters):
    """OpenAI's DPO hyperparameters: the supervised ones, and beta."""

    beta: Annotated[float, Field(gt=0, le=100)] | Literal["auto"] = Field(
        default="auto", description="How strongly the policy is held near the reference model (the spec's "
                                    "method.dpo.beta; auto: 0.1).")


class Supervised(BaseModel):
    """OpenAI's supervised method: its hyperparameters."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is refused, not ignored

    hyperparameters: OpenAIHyperparameters = Field(default_factory=OpenAIHyperparameters)


class Dpo(BaseModel):
    """OpenAI's DPO method (Direct Preference Optimization): its hyperparameters."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is refused, not ignored

    hyperparameters: OpenAIDpoHyperparameters = Field(default_factory=OpenAIDpoHyperparameters)


class Method(BaseModel):
    """OpenAI's fine-tuning method: its type, and that type's settings (the only one of `supervised` and `dpo`
    present). supervised is the spec's method.objective sft, dpo its dpo (on preference pairs); LoRA or full
    fine-tuning, either way, is tunewright's `method_type`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: Supervised | None = Field(default=None, description="With type supervised.")
    dpo: Dpo | None = Field(default=None, description="With type dpo.")
    reinforcement: None = Field(default=None, description="Always null: OpenAI's reinforcement method is not "
                                                          "offered (the official client's dump of a job's method "
                                                          "carries it as null).")

    @model_validator(mode="before")
    @classmethod
    def _no_reinforcement(cls, data: object) -> object:
        """Said before the field's own "should be None", which would not tell the user why."""
        if isinstance(data, dict) and data.get("reinforcement") is not None:
            raise ValueError("reinforcement fine-tuning is not offered: give type supervised or dpo, and "
                             "reinforcement null or absent")
        return data

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> Method:
        other = "dpo" if self.type == "supervised" else "supervised"
        if getattr(self, other) is not None:
            raise ValueError(f"{other} is given but type is {self.type}: give the settings of the type "
                             f"({self.type}), or type {other}")
        return self

    @model_serializer(mode="wrap")
    def _only_its_type(self, handler):  # no return annotation: the document keeps the model's own schema
        """As OpenAI answers it: the type and its own settings, no null for the other."""
        return {key: value for key, value in handler(self).items() if value is not None}

    @property
    def hyperparameters(self) -> OpenAIHyperparameters:
        """The settings of its type, as given or all "auto"."""
        if self.type == "dpo":
            return (self.dpo or Dpo()).hyperparameters
        return (self.supervised or Supervised()).hyperparameters


class TunewrightExtras(BaseModel):
    """tunewright's own view of the job, beside OpenAI's fields (the native route's shapes)."""

    plan: JobPlan | None
    progress: JobProgress
    telemetry: JobTelemetry


class FineTuningJobError(Answer):
    """Why a fine-tuning job failed, in OpenAI's shape."""

    code: str
    message: str | None
    param: str | None = Field(description="Always null here.")


class FineTuningJob(Answer):
    """A job in OpenAI's fine-tuning job shape (what the official client reads), with tunewright's own view of it
    under `tunewright`."""

    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    id: str
    model: str = Field(description="The base model, as the job reads it (a hub name, or a resolved path).")
    status: JobStatus
    created_at: int = Field(description="Unix seconds.")
    finished_at: int | None = Field(description="Unix seconds; null until it ends.")
    fine_tuned_model: str | None = Field(description="ft:<base>:<suffix>:<job id> once the job exported a model (GET "
                                                     "/v1/jobs/{job_id}/artifacts lists its files); null before.")
    organization_id: str = Field(description="The tenant's id.")
    result_files: list[str] = Field(description="The job's results file (its metrics as CSV, a file of the "
                                                "tenant's) once it ended.")
    training_file: str
    validation_file: str | None
    hyperparameters: OpenAIHyperparameters
    method: Method
    trained_tokens: int | None = Field(description="Once it succeeded; null before.")
    error: FineTuningJobError | None
    seed: int | None
    estimated_finish: int | None = Field(description="Unix seconds, at the pace so far (running jobs).")
    integrations: None = Field(default=None, description="Always null: tunewright runs no integrations.")
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    tunewright: TunewrightExtras


class FineTuningJobList(ListEnvelope[FineTuningJob]):
    """Fine-tuning jobs, newest first."""


# --- GPU pools and plans -----------------------------------------------------------------------------


class PoolDescription(CamelModel):
    """A GPU pool as the planner sees it."""

    gpu: Literal[tuple(GPUS)]  # type: ignore[valid-type]
    gpus_per_node: int = Field(gt=0, le=64)
    max_nodes: int = Field(gt=0, le=4096)
    intra_node: Literal[tuple(LINKS)]  # type: ignore[valid-type]
    inter_node: Literal[tuple(LINKS)] | None = None  # type: ignore[valid-type]
    price_per_gpu_hour: float = Field(ge=0)
    host_memory_gib: float | None = Field(default=None, gt=0,
                                          description="Host memory per node (CPU offload); default 2x its GPU memory")


class PoolCreate(PoolDescription):
    """A GPU pool to describe (administrators), by name."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    learn_links: bool = Field(default=False, description=(
        "Opt-in: each profiler window of a multi-GPU job planned on this pool measures the bandwidth its "
        "collectives got from the link they crossed, and the next plans use the mean of the last windows "
        "instead of the declared figure (measuredLinks; DELETE /v1/pools/{name}/measured-links forgets them). "
        "Every window also measures the GPUs' compute against the catalog's efficiency, apart for jobs on one "
        "GPU and across GPUs, and the next plans of each kind use its mean factor (measuredEfficiency)."))


class DescribedPool(AsWritten, PoolCreate):
    """A GPU pool an administrator described (POST /v1/pools), with what its jobs measured of it."""

    model_config = ALWAYS_ANSWERED

    object: Literal["pool"] = "pool"
    measured_links: MeasuredLinks | None = Field(description="The links' bandwidth as the pool's jobs measured it "
                                                             "(with learnLinks); null until measured, or forgotten.")
    measured_efficiency: MeasuredEfficiency | None = Field(description="The GPUs' compute efficiency as the pool's "
                                                                       "jobs measured it (with learnLinks).")


class LocalPool(AsWritten, CamelModel):
    """This machine, as the local backend offers it."""

    model_config = ALWAYS_ANSWERED

    object: Literal["pool"] = "pool"
    name: str
    gpus_found: list[str] = Field(description="The NVIDIA GPUs nvidia-smi lists here, by name.")
    gpus_used: int = Field(description="GPUs a job uses (TUNEWRIGHT_LOCAL_GPUS); 0: jobs train on the CPU.")
    cpus: int | None
    workers: int = Field(description="Training processes per job.")
    price_per_gpu_hour: float
    description: str


class ClusterPool(AsWritten, GPUPoolSpec):
    """A GPUPool resource of the cluster (kubernetes backend): its spec's fields and its status, as the cluster
    holds them (a field the resource leaves out is left out)."""

    object: Literal["pool"] = "pool"
    name: str
    status: GPUPoolStatus = Field(description="What the operator discovered of the pool's nodes, and what its "
                                              "jobs measured.")


def pool_kind(pool: Any) -> str | None:
    """Which of the three a pool is: by the keys only it has (a cluster's GPUPool its status, this machine the
    GPUs found on it), or by its model once it is one."""
    if isinstance(pool, BaseModel):
        return type(pool).__name__
    if not isinstance(pool, dict):
        return None
    return "ClusterPool" if "status" in pool else "LocalPool" if "gpusFound" in pool else "DescribedPool"


class PoolPublic(RootModel[Annotated[Annotated[DescribedPool, Tag("DescribedPool")] | Annotated[LocalPool, Tag(
        "LocalPool")] | Annotated[ClusterPool, Tag("ClusterPool")], Discriminator(pool_kind)]]):
    """A GPU pool: one an administrator described, this machine (local backend), or a cluster's GPUPool
    (kubernetes backend)."""


class PoolList(Page[PoolPublic]):
    """The backend's own pools, then the described ones by name."""


class PlannedModel(Answer):
    """The model a plan is for, as the planner profiled it."""

    name: str
    parameters: int
    layers: int
    hidden: int


class PlanResponse(Answer):
    """A dry run: the plan, its predictions, and the alternatives rejected with their reasons."""

    object: str = "plan"
    pool: str = Field(description="The pool planned on ('described' for a poolSpec).")
    model: PlannedModel
    plan: JobPlan
