"""OpenAI-compatible fine-tuning jobs: the official `openai` client works with base_url=<api>/v1.

LoRA, strategy and budget ride in extra fields (`extra_body` in the client): `lora`, `method_type`
(lora | full), `strategy`, `budget_usd`, `max_steps`, `seq_len`.
"""

from __future__ import annotations

from datetime import UTC
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunewright_api.auth import CurrentTenant, SessionDep
from tunewright_api.errors import ApiError
from tunewright_api.models import Job, ListEnvelope, now
from tunewright_api.routes.jobs import (
    cancel_owned,
    checkpoints,
    events_page,
    owned_job,
    page_of_jobs,
    resolve_dataset,
    submit,
)
from tunewright_operator.jobconfig import DEFAULT_GLOBAL_BATCH
from tunewright_operator.spec import FineTuneJobSpec

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine_tuning (OpenAI-compatible)"])
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}  # learning_rate_multiplier scales these
DEFAULT_EPOCHS = 3
STATUS = {"queued": "queued", "running": "running", "succeeded": "succeeded", "failed": "failed",
          "cancelled": "cancelled"}


class Hyperparameters(BaseModel):
    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"


class Supervised(BaseModel):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


class Method(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: Supervised = Field(default_factory=Supervised)


class LoraOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    r: int = 16
    alpha: float = 32
    dropout: float = 0.05
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])


class FineTuningJobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None  # legacy top-level form
    method: Method | None = None
    suffix: str | None = Field(default=None, max_length=64)
    seed: int | None = None
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = None
    # tunewright's extra fields
    method_type: Literal["lora", "full"] = "lora"
    lora: LoraOptions | None = None
    strategy: Literal["auto", "single", "ddp", "fsdp", "hsdp"] = "auto"
    budget_usd: float | None = Field(default=None, gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    seq_len: int = Field(default=2048, gt=0)

    def effective_hyperparameters(self) -> Hyperparameters:
        if self.method is not None:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()


def to_spec(body: FineTuningJobCreate, dataset_format: str) -> FineTuneJobSpec:
    hp = body.effective_hyperparameters()
    multiplier = 1.0 if hp.learning_rate_multiplier == "auto" else hp.learning_rate_multiplier
    lora = body.lora or LoraOptions()
    spec = {
        "model": {"source": body.model},
        "method": {"type": body.method_type, "lora": {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
                                                      "targetModules": lora.target_modules}},
        "dataset": {"train": body.training_file, "validation": body.validation_file, "format": dataset_format},
        "hyperparameters": {
            "epochs": DEFAULT_EPOCHS if hp.n_epochs == "auto" else hp.n_epochs,
            "maxSteps": body.max_steps,
            "learningRate": BASE_LEARNING_RATE[body.method_type] * multiplier,
            "globalBatchSize": DEFAULT_GLOBAL_BATCH if hp.batch_size == "auto" else hp.batch_size,
            "seqLen": body.seq_len,
            **({"seed": body.seed} if body.seed is not None else {}),
        },
        "resources": {"strategy": body.strategy, "budgetUSD": body.budget_usd},
    }
    try:
        return FineTuneJobSpec.model_validate(spec)
    except ValidationError as err:
        first = err.errors()[0]
        raise ApiError(422, first["msg"], ".".join(str(p) for p in first["loc"]), "invalid_value") from None


def openai_job(job: Job) -> dict:
    spec = job.spec
    hp = spec.get("hyperparameters", {})
    base = BASE_LEARNING_RATE[spec["method"]["type"]]
    hyperparameters = {"n_epochs": hp.get("epochs"), "batch_size": hp.get("globalBatchSize"),
                       "learning_rate_multiplier": hp.get("learningRate", base) / base}
    export = (job.result or {}).get("export", {})
    estimated_finish = None
    if job.status == "running" and job.total_steps and job.step and job.started_at:
        started = job.started_at.replace(tzinfo=job.started_at.tzinfo or UTC)  # SQLite drops the zone
        per_step = (now() - started).total_seconds() / job.step
        estimated_finish = int(started.timestamp() + per_step * job.total_steps)
    return {
        "object": "fine_tuning.job", "id": job.id, "model": job.model, "status": STATUS[job.status],
        "created_at": int(job.created_at.timestamp()),
        "finished_at": int(job.finished_at.timestamp()) if job.finished_at else None,
        "fine_tuned_model": export.get("merged") or export.get("adapter") or export.get("model"),
        "organization_id": job.tenant_id, "result_files": [],
        "training_file": spec["dataset"]["train"], "validation_file": spec["dataset"].get("validation"),
        "hyperparameters": hyperparameters,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
        "trained_tokens": job.trained_tokens if job.status == "succeeded" else None,
        "error": {"code": job.error_code, "message": job.error_message, "param": None} if job.error_code else None,
        "seed": hp.get("seed"), "estimated_finish": estimated_finish, "integrations": None,
        "metadata": job.job_metadata, "user_provided_suffix": job.suffix,
        "tunewright": {"plan": job.plan, "progress": {"step": job.step, "total_steps": job.total_steps,
                                                      "loss": job.loss, "tokens_per_second": job.tokens_per_second},
                       "telemetry": job.telemetry()},
    }


@router.post("")
def create(body: FineTuningJobCreate, request: Request, session: SessionDep, tenant: CurrentTenant) -> dict:
    train = resolve_dataset(session, tenant, body.training_file, "training_file")
    resolve_dataset(session, tenant, body.validation_file, "validation_file")
    job = submit(to_spec(body, train.format), request, session, tenant, suffix=body.suffix,
                 job_metadata=body.metadata)
    return openai_job(job)


@router.get("")
def list_(session: SessionDep, tenant: CurrentTenant, after: str | None = None,
          limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListEnvelope:
    jobs, more = page_of_jobs(session, tenant, after, limit)
    return ListEnvelope(data=[openai_job(j) for j in jobs], has_more=more)


@router.get("/{fine_tuning_job_id}")
def retrieve(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> dict:
    return openai_job(owned_job(session, tenant, fine_tuning_job_id))


@router.post("/{fine_tuning_job_id}/cancel")
def cancel(fine_tuning_job_id: str, request: Request, session: SessionDep, tenant: CurrentTenant) -> dict:
    return openai_job(cancel_owned(request, session, tenant, fine_tuning_job_id, "fine_tuning_job_id"))


@router.get("/{fine_tuning_job_id}/events")
def events(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant,
           limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> ListEnvelope:
    owned_job(session, tenant, fine_tuning_job_id)
    return events_page(session, fine_tuning_job_id, limit)


@router.get("/{fine_tuning_job_id}/checkpoints")
def list_checkpoints(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant,
                     limit: Annotated[int, Query(ge=1, le=100)] = 10) -> ListEnvelope:
    data = checkpoints(owned_job(session, tenant, fine_tuning_job_id))
    return ListEnvelope(data=data[:limit], has_more=len(data) > limit)
