"""Tables and API shapes, one family per resource (table / Public)."""

from __future__ import annotations

import logging
import secrets
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

import sqlalchemy as sa
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic import Field as PydanticField
from sqlalchemy import JSON, BigInteger, Column, UniqueConstraint
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, Session, SQLModel

from tunewright_api.telemetry import measured, progress
from tunewright_core.spec import JobPlan, JobProgress, JobTelemetry, Printable, wire_name

log = logging.getLogger(__name__)


def camel_keys(value: Any) -> Any:
    """`value` with every mapping's keys in the native casing, at any depth (a runtime record, a run's result)."""
    if isinstance(value, dict):
        return {wire_name(key) if isinstance(key, str) else key: camel_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [camel_keys(item) for item in value]
    return value


# One casing rule: camelCase on tunewright's own routes (as the spec and the plan), snake_case on the
# OpenAI-compatible ones (/v1/files, /v1/fine_tuning). The native answers are built by their Python names.
NATIVE = ConfigDict(alias_generator=wire_name, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True,
                    json_schema_serialization_defaults_required=True)


class NativeAnswer(BaseModel):
    """Base of the answers of tunewright's own routes: camelCase on the wire, every field in every answer."""

    model_config = NATIVE


def now() -> datetime:
    return datetime.now(UTC)


class ModelJSON(TypeDecorator):
    """A JSON column holding one pydantic model: written in its wire form (camelCase), read back as the model.
    A new value is assigned, never mutated in place (the column sees assignments only)."""

    impl = JSON
    cache_ok = True

    def __init__(self, model: type[BaseModel]):
        super().__init__(none_as_null=True)  # no value is SQL NULL, not JSON null: `IS NULL` finds it
        self.model = model

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        return self.model.model_validate(value).model_dump(by_alias=True, mode="json", exclude_none=True)

    def process_result_value(self, value, dialect):
        """The stored model; a row this version cannot read (written by a newer one, say) reads as None, said in
        the log, so that one row never stops the queries that load every job."""
        if value is None:
            return None
        try:
            return self.model.model_validate(value)
        except ValidationError as err:
            log.warning("a stored %s does not validate here (%s): read as none", self.model.__name__,
                        str(err).splitlines()[0])
            return None


def render_for_alembic(type_, obj, autogen_context):
    """How a generated migration writes a column type: a model-holding JSON column is JSON in the database."""
    if type_ == "type" and isinstance(obj, ModelJSON):
        return "sa.JSON()"
    return False


class ClusterRef(BaseModel):
    """Where a job's FineTuneJob is (the kubernetes backend), and what the API last saw of it. Frozen: a change is
    a new value (`model_copy(update=...)`), which the column sees."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    name: str
    reason: str | None = None  # the condition's reason the API last recorded
    missed: int = 0  # consecutive listings without it


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def results_file_id(job: Job) -> str:
    """The id of a job's results file: its own hex, so a re-sent end record rewrites the same file."""
    return "file-" + job.id.rsplit("-", 1)[-1][-24:].rjust(24, "0")


# --- tenants and tokens ------------------------------------------------------------------------------


class Tenant(SQLModel, table=True):
    id: str = Field(default_factory=lambda: new_id("tenant"), primary_key=True)
    name: str = Field(unique=True, index=True)
    created_at: datetime = Field(default_factory=now)


class ApiToken(SQLModel, table=True):
    id: str = Field(default_factory=lambda: new_id("tok"), primary_key=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    name: str = ""
    token_hash: str = Field(unique=True, index=True)  # sha256 of a 256-bit random secret
    admin: bool = False
    created_at: datetime = Field(default_factory=now)


class TokenCreate(BaseModel):
    tenant: str = PydanticField(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    name: Printable = ""
    admin: bool = False


class TokenPublic(NativeAnswer):
    """An API token of a tenant's (never its secret, but once: in the answer that creates it)."""

    id: str
    object: str = "token"
    tenant: str = PydanticField(description="The tenant's name: what the token may see and do.")
    name: str = ""
    admin: bool = PydanticField(default=False, description="Whether it may manage tokens and pools.")
    created_at: datetime
    token: str | None = PydanticField(default=None, description="The secret: shown once, when created; null after.")


# --- files -------------------------------------------------------------------------------------------


class StoredFile(SQLModel, table=True):
    __tablename__ = "files"
    id: str = Field(default_factory=lambda: new_id("file"), primary_key=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    filename: str
    purpose: str
    bytes: int
    format: str
    examples: int
    path: str
    sha256: str | None = Field(default=None, index=True)  # of the bytes uploaded (None: a file the API made)
    # text in the examples, all and the longest one's (None: not a dataset, or uploaded before they were kept)
    characters: int | None = Field(default=None, sa_type=BigInteger)
    longest_characters: int | None = None
    created_at: datetime = Field(default_factory=now)


class FilePublic(SQLModel):
    """An uploaded dataset (or a job's results file), in OpenAI's file shape with tunewright's fields."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str = Field(description="fine-tune (uploads) or fine-tune-results (a job's metrics CSV).")
    status: str = "processed"
    format: str = Field(description="The records' format as validated: chat, prompt_completion, text, "
                                    "preference (pairs, for dpo); csv for a results file.")
    examples: int = Field(description="Records in the file (rows for a results file).")
    sha256: str | None = Field(default=None, description="Of the bytes uploaded; null for a file the API made.")

    @classmethod
    def of(cls, f: StoredFile) -> FilePublic:
        return cls(id=f.id, bytes=f.bytes, created_at=int(f.created_at.timestamp()), filename=f.filename,
                   purpose=f.purpose, format=f.format, examples=f.examples, sha256=f.sha256)


# --- jobs --------------------------------------------------------------------------------------------


class Job(SQLModel, table=True):
    id: str = Field(default_factory=lambda: new_id("ftjob"), primary_key=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    status: str = Field(default="queued", index=True)
    model: str
    # as written: a FineTuneJob made with kubectl may hold a spec the operator refuses, which the job still shows
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    plan: JobPlan | None = Field(default=None, sa_column=Column(ModelJSON(JobPlan)))
    config: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    error_code: str | None = None
    error_message: str | None = None
    created_at: datetime = Field(default_factory=now)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    trained_tokens: int = 0
    comm: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))  # the last measured window
    checkpoint_seconds: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})  # all written
    suffix: str | None = None
    job_metadata: dict[str, str] | None = Field(default=None, sa_column=Column("metadata", JSON))
    telemetry_token_hash: str = ""
    run_dir: str = ""
    pid: int | None = None
    cluster: ClusterRef | None = Field(default=None, sa_column=Column(ModelJSON(ClusterRef)))  # kubernetes backend

    def progress(self) -> JobProgress:
        return progress(self.status, self.step, self.total_steps, self.loss, self.tokens_per_second,
                        self.trained_tokens, self.started_at, now())

    def telemetry(self, plan: JobPlan | None) -> JobTelemetry:
        """Measured beside `plan` (the job's, parsed once by the caller)."""
        return measured(plan, self.comm, self.tokens_per_second, self.started_at, self.finished_at, now())


class JobPublic(NativeAnswer):
    """A job as the native API shows it: its spec, its plan, its progress and what was measured so far."""

    id: str
    object: str = "tunewright.job"
    status: str
    model: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any] = PydanticField(description="The FineTuneJobSpec the job runs (camelCase, unset fields left "
                                                     "out).")
    plan: JobPlan | None
    progress: JobProgress
    telemetry: JobTelemetry
    result: Annotated[dict[str, Any] | None, AfterValidator(camel_keys)] = PydanticField(description=(
        "What the run reported at its end, its `end` record's fields in camelCase (steps, finalLoss, evalBefore, "
        "evalAfter; export: where the adapter or model went); null until it ends."))
    error: dict[str, str] | None = PydanticField(description="{code, message} once it failed; null otherwise.")

    @classmethod
    def of(cls, job: Job) -> JobPublic:
        error = {"code": job.error_code, "message": job.error_message or ""} if job.error_code else None
        plan = job.plan
        return cls(id=job.id, status=job.status, model=job.model, created_at=job.created_at,
                   started_at=job.started_at, finished_at=job.finished_at, spec=job.spec, plan=plan,
                   progress=job.progress(), telemetry=job.telemetry(plan), result=job.result, error=error)


class JobEvent(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="job.id", index=True)
    created_at: datetime = Field(default_factory=now)
    level: str = "info"
    type: str = "message"  # message | metrics
    message: str
    data: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


def add_event(session: Session, job: Job, message: str, level: str = "info", type_: str = "message",
              data: dict | None = None) -> None:
    """Record what happened to a job (committed with the caller's transaction)."""
    session.add(JobEvent(job_id=job.id, message=message, level=level, type=type_, data=data))


class MetricPoint(SQLModel, table=True):
    # one point per step: the latest record wins
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_metricpoint_job_id_step"),)
    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="job.id", index=True)
    step: int = Field(index=True)
    time: float
    data: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))


class Checkpoint(SQLModel, table=True):
    """A committed checkpoint, as the runtime registered it (its store knows where it lives)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)
    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="job.id", index=True)
    step: int
    uri: str
    train_loss: float | None = None
    created_at: datetime = Field(default_factory=now)


Item = TypeVar("Item")


class ListEnvelope(BaseModel, Generic[Item]):
    """A list, in OpenAI's shape (the OpenAI-compatible routes); each list the API answers is one of these or a
    `Page` by name (`FileList`, ...)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)  # every key in every answer
    object: str = "list"
    data: list[Item]
    has_more: bool = PydanticField(default=False, description="Whether more follow this page (a paged list: `after` "
                                                              "takes the last id of this one).")


PageT = TypeVar("PageT", bound="Page")


class Page(ListEnvelope[Item], Generic[Item]):
    """A list on tunewright's own routes: the same envelope, camelCase (`hasMore`)."""

    model_config = NATIVE

    @classmethod
    def of(cls: type[PageT], openai_page: ListEnvelope) -> PageT:
        """An OpenAI-shaped page of the same items, in the native casing (its items validated by their names)."""
        return cls.model_validate(openai_page.model_dump())


# --- pools -------------------------------------------------------------------------------------------


class GpuPool(SQLModel, table=True):
    """A described GPU pool (what a GPUPool resource holds), for plans; admins register them."""

    __tablename__ = "pools"
    name: str = Field(primary_key=True)
    gpu: str
    gpus_per_node: int
    max_nodes: int
    intra_node: str
    inter_node: str | None = None
    price_per_gpu_hour: float
    host_memory_gib: float | None = None  # per node; None: the planner's default ratio to GPU memory
    # opt-in: the links' bandwidth its jobs measured replaces the declared one in the next plans
    learn_links: bool = Field(default=False, sa_column_kwargs={"server_default": sa.false()})
    measured_links: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))  # intraNode / interNode
    # with learn_links too: the GPUs' compute efficiency its jobs measured (spec.MeasuredEfficiency's form)
    measured_efficiency: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    created_at: datetime = Field(default_factory=now)
