"""OpenAI-compatible fine-tuning jobs: the official `openai` client works with base_url=<api>/v1.

LoRA, strategy and budget ride in extra fields (`extra_body` in the client): `lora`, `method_type`
(lora | full), `strategy`, `budget_usd`, `max_steps`, `seq_len`.

OpenAI's `method.type` is the training objective: supervised is the spec's method.objective sft, dpo its dpo
(on a file of preference pairs; `method.dpo.hyperparameters.beta` is method.dpo.beta). LoRA or full
fine-tuning, which the spec calls method.type, is `method_type` here, for either.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunewright_api.auth import CurrentTenant, SessionDep
from tunewright_api.deps import BackendDep, SettingsDep
from tunewright_api.errors import ApiError
from tunewright_api.models import Job
from tunewright_api.routes.links import links_from
from tunewright_api.schemas import (
    CheckpointList,
    Dpo,
    EventList,
    FineTuningJob,
    FineTuningJobError,
    FineTuningJobList,
    Method,
    OpenAIDpoHyperparameters,
    OpenAIHyperparameters,
    Supervised,
    TunewrightExtras,
)
from tunewright_api.services import jobs
from tunewright_core.spec import (
    DEFAULT_EPOCHS,
    DEFAULT_GLOBAL_BATCH,
    PREFERENCE_FORMAT,
    DpoSpec,
    FineTuneJobSpec,
    LoraAlpha,
    LoraDropout,
    LoraQuantization,
    LoraRank,
    LoraTargets,
    MethodType,
    Printable,
    Strategy,
    described_errors,
)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine_tuning (OpenAI-compatible)"])
# learning_rate_multiplier scales these; dpo refines a model already trained, in far smaller steps
BASE_LEARNING_RATE = {"sft": {"lora": 2e-4, "full": 2e-5}, "dpo": {"lora": 1e-5, "full": 1e-6}}
OBJECTIVE_OF = {"supervised": "sft", "dpo": "dpo"}  # OpenAI's method.type: the spec's method.objective


class LoraOptions(BaseModel):
    """The spec's LoRA settings, with its bounds, named as this route names fields (snake_case)."""

    model_config = ConfigDict(extra="forbid")
    r: LoraRank = 16
    alpha: LoraAlpha = 32
    dropout: LoraDropout = 0.05
    target_modules: LoraTargets = Field(default_factory=lambda: ["all-linear"])
    quantization: LoraQuantization = "none"


class FineTuningJobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: OpenAIHyperparameters | None = None  # legacy top-level form
    method: Method | None = None
    suffix: Printable | None = Field(default=None, max_length=64)  # a part of a name: no control characters
    seed: int | None = None
    # OpenAI's own limits: 16 pairs, keys up to 64 characters, values up to 512
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    integrations: list[Any] | None = Field(default=None, max_length=16)
    # tunewright's extra fields
    method_type: MethodType = "lora"
    lora: LoraOptions | None = None
    strategy: Literal["auto", Strategy] = "auto"
    budget_usd: float | None = Field(default=None, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    seq_len: int | None = Field(default=None, gt=0, description="Tokens per packed sequence (default: from the "
                                                                 "data, up to 2048)")

    def effective_hyperparameters(self) -> OpenAIHyperparameters:
        if self.method is not None:
            return self.method.hyperparameters
        return self.hyperparameters or OpenAIHyperparameters()

    @property
    def objective(self) -> str:
        return OBJECTIVE_OF[self.method.type] if self.method is not None else "sft"


def to_spec(body: FineTuningJobCreate, dataset_format: str) -> FineTuneJobSpec:
    hp = body.effective_hyperparameters()
    objective = body.objective
    if objective == "dpo" and dataset_format != PREFERENCE_FORMAT:
        raise ApiError(422, f"method.type dpo trains on preference pairs, but {body.training_file} holds "
                            f"{dataset_format} records: upload JSONL lines of input (its messages), preferred_output "
                            "and non_preferred_output (or prompt, chosen and rejected)", "training_file",
                       "invalid_value")
    if objective != "dpo" and dataset_format == PREFERENCE_FORMAT:
        raise ApiError(422, f"{body.training_file} holds preference pairs, which train with method "
                            '{"type": "dpo"}, not supervised', "method.type", "invalid_value")
    multiplier = 1.0 if hp.learning_rate_multiplier == "auto" else hp.learning_rate_multiplier
    lora = body.lora or LoraOptions()
    method: dict[str, Any] = {"type": body.method_type, "objective": objective,
                              "lora": {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
                                       "targetModules": lora.target_modules, "quantization": lora.quantization}}
    if isinstance(hp, OpenAIDpoHyperparameters) and hp.beta != "auto":
        method["dpo"] = {"beta": hp.beta}
    spec = {
        "model": {"source": body.model},
        "method": method,
        "dataset": {"train": body.training_file, "validation": body.validation_file, "format": dataset_format},
        "hyperparameters": {
            "epochs": DEFAULT_EPOCHS if hp.n_epochs == "auto" else hp.n_epochs,
            "maxSteps": body.max_steps,
            "learningRate": BASE_LEARNING_RATE[objective][body.method_type] * multiplier,
            # "auto": chosen from the data at submit (at most the default)
            **({} if hp.batch_size == "auto" else {"globalBatchSize": hp.batch_size}),
            **({"seqLen": body.seq_len} if body.seq_len is not None else {}),
            **({"seed": body.seed} if body.seed is not None else {}),
        },
        "resources": {"strategy": body.strategy, "budgetUSD": body.budget_usd},
    }
    try:
        return FineTuneJobSpec.model_validate(spec)
    except ValidationError as err:
        where, what = described_errors(err.errors(), FineTuneJobSpec)[0]
        raise ApiError(422, what, where or None, "invalid_value") from None


def fine_tuned_model_name(job: Job) -> str:
    """OpenAI's shape (ft:base:suffix:id), a name and not a path: the files are at GET /v1/jobs/{id}/artifacts
    (`tunewright download` takes this name or the job id)."""
    base = job.model.rstrip("/").rsplit("/", 1)[-1]
    return ":".join(["ft", base, *([job.suffix] if job.suffix else []), job.id])


def openai_job(job: Job) -> FineTuningJob:
    spec = job.spec
    hp = spec.get("hyperparameters", {})
    objective = spec["method"].get("objective", "sft")  # absent from jobs submitted before dpo
    base = BASE_LEARNING_RATE[objective][spec["method"]["type"]]
    hyperparameters = OpenAIHyperparameters(n_epochs=hp.get("epochs", DEFAULT_EPOCHS),
                                            batch_size=hp.get("globalBatchSize") or DEFAULT_GLOBAL_BATCH,
                                            learning_rate_multiplier=hp.get("learningRate", base) / base)
    if objective == "dpo":
        beta = (spec["method"].get("dpo") or {}).get("beta", DpoSpec().beta)
        method = Method(type="dpo", dpo=Dpo(hyperparameters=OpenAIDpoHyperparameters(
            **hyperparameters.model_dump(), beta=beta)))
    else:
        method = Method(type="supervised", supervised=Supervised(hyperparameters=hyperparameters))
    export = (job.result or {}).get("export", {})
    progress = job.progress()
    eta = progress.eta_seconds
    return FineTuningJob(
        id=job.id, model=job.model, status=job.status, created_at=int(job.created_at.timestamp()),
        finished_at=int(job.finished_at.timestamp()) if job.finished_at else None,
        fine_tuned_model=fine_tuned_model_name(job) if any(export.values()) else None,
        organization_id=job.tenant_id, result_files=(job.result or {}).get("result_files", []),
        training_file=spec["dataset"]["train"], validation_file=spec["dataset"].get("validation"),
        hyperparameters=hyperparameters, method=method,
        trained_tokens=job.trained_tokens if job.status == "succeeded" else None,
        error=FineTuningJobError(code=job.error_code, message=job.error_message, param=None) if job.error_code
        else None,
        seed=hp.get("seed"), estimated_finish=int(time.time() + eta) if eta is not None else None,
        metadata=job.job_metadata, user_provided_suffix=job.suffix,
        tunewright=TunewrightExtras(plan=(plan := job.plan), progress=progress, telemetry=job.telemetry(plan)),
    )


@router.post("", responses=links_from(200, "id", "fine_tuning_job_id", *(
    (method, f"/v1/fine_tuning/jobs/{{fine_tuning_job_id}}{tail}")
    for method, tail in (("get", ""), ("post", "/cancel"), ("get", "/events"), ("get", "/checkpoints")))))
def create(body: FineTuningJobCreate, session: SessionDep, backend: BackendDep, settings: SettingsDep,
           tenant: CurrentTenant) -> FineTuningJob:
    train = jobs.dataset_file(session=session, tenant=tenant, value=body.training_file, param="training_file")
    job = jobs.submit(session=session, backend=backend, tenant=tenant, spec=to_spec(body, train.format),
                      train_param="training_file", validation_param="validation_file", suffix=body.suffix,
                      metadata=body.metadata, data_dir=settings.data_dir, model_roots=settings.model_roots,
                      model_param="model",
                      sizes_param="hyperparameters.batch_size")
    return openai_job(job)


@router.get("")
def list_(session: SessionDep, tenant: CurrentTenant, after: str | None = None,
          limit: Annotated[int, Query(ge=1, le=100)] = 20) -> FineTuningJobList:
    page, more = jobs.page_of_jobs(session=session, tenant=tenant, after=after, limit=limit)
    return FineTuningJobList(data=[openai_job(j) for j in page], has_more=more)


@router.get("/{fine_tuning_job_id}")
def retrieve(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> FineTuningJob:
    return openai_job(jobs.owned_job(session=session, tenant=tenant, job_id=fine_tuning_job_id,
                                     param="fine_tuning_job_id"))


@router.post("/{fine_tuning_job_id}/cancel")
def cancel(fine_tuning_job_id: str, session: SessionDep, backend: BackendDep,
           tenant: CurrentTenant) -> FineTuningJob:
    return openai_job(jobs.cancel(session=session, backend=backend, tenant=tenant, job_id=fine_tuning_job_id,
                                  param="fine_tuning_job_id", finished_status=400))


@router.get("/{fine_tuning_job_id}/events")
def events(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant, after: str | None = None,
           limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> EventList:
    return jobs.events_page(session=session, tenant=tenant, job_id=fine_tuning_job_id, param="fine_tuning_job_id",
                            limit=limit, after=after)


@router.get("/{fine_tuning_job_id}/checkpoints")
def list_checkpoints(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 10) -> CheckpointList:
    return jobs.checkpoints(session=session, tenant=tenant, job_id=fine_tuning_job_id, param="fine_tuning_job_id",
                            limit=limit, after=after)
