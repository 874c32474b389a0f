"""Workers' telemetry: records from the runtime, authenticated by the job's own token, into the job."""

from __future__ import annotations

import csv
import hmac
import io
import json
import os
from pathlib import Path
from typing import Protocol

from sqlmodel import Session, delete, func, select, update

from tunewright_api.auth import hash_token
from tunewright_api.errors import ApiError
from tunewright_api.models import (
    Checkpoint,
    Job,
    JobEvent,
    MetricPoint,
    StoredFile,
    add_event,
    results_file_id,
)
from tunewright_api.services.plans import learn_efficiency, learn_links
from tunewright_api.states import TERMINAL
from tunewright_api.telemetry import (
    CheckpointRecord,
    CommRecord,
    EndRecord,
    EvalRecord,
    StartRecord,
    StepRecord,
    TelemetryRecord,
    parse_records,
    step_metrics,
)
from tunewright_core.storage import volume_uri

# What one job may keep, however long it runs (a million-step run must not grow the database without end).
MAX_METRIC_POINTS = 10_000  # past it the older half is thinned: every other point there is dropped
MAX_METRICS_EVENTS = 5_000  # per-step, evaluation and checkpoint events: past it the oldest go; lifecycle
#                             events (queued, started, failed...) are few and always kept


def authenticated_job(*, session: Session, job_id: str, token: str, finished_ok: bool = False) -> Job:
    """The job whose own token this is; 410 once it has ended unless `finished_ok` (reads only)."""
    job = session.get(Job, job_id)
    if job is None or not job.telemetry_token_hash or not hmac.compare_digest(hash_token(token),
                                                                               job.telemetry_token_hash):
        raise ApiError(401, "invalid telemetry token for this job")
    if job.status in TERMINAL and not finished_ok:  # a cancelled run's last words must not change the job
        raise ApiError(410, f"job {job_id} already {job.status}: no more records", None, "job_finished")
    return job


def dataset_of(*, session: Session, job: Job, file_id: str) -> StoredFile:
    """One of the job's own datasets (its spec names it, its tenant uploaded it)."""
    named = {(job.spec.get("dataset") or {}).get(key) for key in ("train", "validation")}
    stored = session.get(StoredFile, file_id) if file_id in named else None
    if stored is None or stored.tenant_id != job.tenant_id:
        raise ApiError(404, f"job {job.id} names no file {file_id}", "file_id", "not_found")
    return stored


def hold_unfinished(session: Session, job: Job) -> None:
    """Lock the job's row for this transaction, only while the job is unfinished (410 otherwise), and read it
    again under the lock. The no-op update takes the row lock (PostgreSQL) or the write lock (SQLite): a
    run that ends meanwhile (killed, cancelled) is recorded before this batch or refuses it, never has
    records written after its end."""
    held = session.exec(update(Job).where(Job.id == job.id, Job.status.not_in(TERMINAL)).values(status=Job.status))
    if held.rowcount == 0:
        session.rollback()
        session.refresh(job)
        raise ApiError(410, f"job {job.id} already {job.status}: no more records", None, "job_finished")
    session.refresh(job)


class PoolLearner(Protocol):
    """Where a job's profiler windows teach its pool (the backend: a described pool, or a GPUPool)."""

    def learn_links(self, session: Session, job: Job, transfer_seconds: float, at: float) -> str | None: ...

    def learn_efficiency(self, session: Session, job: Job, step_seconds: float, exposed_comm_seconds: float,
                         at: float) -> str | None: ...


class DescribedPools:
    """The pools described to the API (`/v1/pools`)."""

    learn_links = staticmethod(learn_links)
    learn_efficiency = staticmethod(learn_efficiency)


DESCRIBED_POOLS = DescribedPools()


def ingest(*, session: Session, job: Job, records: list[TelemetryRecord], data_dir: Path,
           learn: PoolLearner = DESCRIBED_POOLS) -> None:
    """Apply a batch in one transaction: progress, metric points, events, checkpoints; at the end, the
    results file (OpenAI's `result_files`). `learn` folds a profiler window into the job's pool
    (the backend)."""
    hold_unfinished(session, job)
    apply_all(session, job, records, data_dir, learn)
    session.commit()


def recover(*, session: Session, job: Job, path: Path, data_dir: Path, learn: PoolLearner = DESCRIBED_POOLS) -> int:
    """Apply the records of the run's metrics file (`path`, what the run wrote as it emitted them) that never
    reached the API, e.g. the last ones and the end of a run that ended while the API was down: how many.
    Applies each once however often it runs (`missed`); the caller commits, before ending the job."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    raw = []
    for line in lines:
        try:
            raw.append(json.loads(line))
        except ValueError:
            continue  # a line the run's end cut short
    hold_unfinished(session, job)  # a batch posted meanwhile is applied before this reads what arrived, or after
    records = missed(session, job, parse_records(raw)[0])
    apply_all(session, job, records, data_dir, learn)
    return len(records)


def missed(session: Session, job: Job, records: list[TelemetryRecord]) -> list[TelemetryRecord]:
    """Those of a run's records (in the order it emitted them) that the API never got. The API gets a prefix
    of them: batches are posted in order and each is applied whole. So every record past the last step it got
    was missed, and of those at that step, each that left no trace."""
    last = job.step

    def got(record: TelemetryRecord) -> bool:
        match record:
            case StartRecord():
                return job.total_steps is not None
            case EvalRecord():
                return session.exec(select(JobEvent.id).where(
                    JobEvent.job_id == job.id, JobEvent.message == f"evaluation at step {record.step}")).first() is not None
            case CheckpointRecord():
                return session.exec(select(Checkpoint.id).where(
                    Checkpoint.job_id == job.id, Checkpoint.step == record.step)).first() is not None
            case CommRecord():
                return (job.comm or {}).get("step") == record.step
            case EndRecord():
                return bool((job.result or {}).get("result_files"))
        return True  # the step record of the last step got

    return [record for record in records if record.step > last or (record.step == last and not got(record))]


def apply_all(session: Session, job: Job, records: list[TelemetryRecord], data_dir: Path,
              learn: PoolLearner) -> None:
    for record in records:
        apply(session, job, record, learn)
    session.add(job)
    session.flush()
    keep_within_caps(session, job)
    if any(isinstance(record, EndRecord) for record in records):
        results = write_results_file(session=session, job=job, data_dir=data_dir)
        job.result = {**job.result, "result_files": [results.id]}


def keep_within_caps(session: Session, job: Job) -> None:
    """Thin the job's metric points and drop its oldest metrics events once they pass their caps.

    The newest half of the points stays at full resolution: a resumed run re-sends only recent steps, whose
    points must still be there for their tokens to count once. The older history loses every other point per
    pass, so the curve keeps its shape from the first step to the last."""
    count_points = select(func.count()).select_from(MetricPoint).where(MetricPoint.job_id == job.id)
    while (points := session.exec(count_points).one()) > MAX_METRIC_POINTS:
        older = session.exec(select(MetricPoint.id).where(MetricPoint.job_id == job.id)
                             .order_by(MetricPoint.step).limit(points // 2)).all()
        dropped = older[1::2]
        for start in range(0, len(dropped), 500):  # SQLite builds may allow only 999 parameters
            session.exec(delete(MetricPoint).where(MetricPoint.id.in_(dropped[start:start + 500])))
    metrics_events = select(JobEvent.id).where(JobEvent.job_id == job.id, JobEvent.type == "metrics")
    events = session.exec(select(func.count()).select_from(metrics_events.subquery())).one()
    if events > MAX_METRICS_EVENTS:  # a tenth more than needed goes: trimming then happens once in hundreds
        last = session.exec(metrics_events.order_by(JobEvent.id)
                            .offset(events - MAX_METRICS_EVENTS + MAX_METRICS_EVENTS // 10 - 1).limit(1)).one()
        session.exec(delete(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "metrics",
                                            JobEvent.id <= last))


def apply(session: Session, job: Job, record: TelemetryRecord, learn: PoolLearner = DESCRIBED_POOLS) -> None:
    match record:
        case StartRecord():
            job.total_steps = record.total_steps
        case StepRecord():
            # a resumed run trains the steps after its checkpoint again, and a post whose answer was lost is
            # sent again: the latest record of a step wins, and its tokens count once
            point = session.exec(select(MetricPoint).where(MetricPoint.job_id == job.id,
                                                           MetricPoint.step == record.step)).first()
            if point is not None:
                job.trained_tokens -= int(point.data.get("tokens", 0))
            point = point or MetricPoint(job_id=job.id, step=record.step, time=record.time, data={})
            point.time, point.data = record.time, step_metrics(record)
            session.add(point)
            job.step, job.loss, job.tokens_per_second = record.step, record.loss, record.tokens_per_second
            job.trained_tokens += record.tokens
            add_event(session, job, f"step {record.step}: training loss={record.loss:.4f}" if record.loss is not None
                      else f"step {record.step}: the training loss is not finite (diverged)", type_="metrics",
                      data={"step": record.step, "train_loss": record.loss, "total_steps": job.total_steps})
        case CommRecord():
            job.comm = record.model_dump(exclude={"event", "time"})
            add_event(session, job, f"step {record.step}: communication {record.comm_share:.1%} of the step "
                                    f"({record.comm_share_exposed:.1%} exposed)", type_="metrics", data=job.comm)
            transfer = (record.transfer_seconds_per_step if record.transfer_seconds_per_step is not None
                        else record.comm_seconds_per_step)
            if (learnt := learn.learn_links(session, job, transfer, record.time)) is not None:
                add_event(session, job, learnt)
            # the window's own step: less what opening and closing the profiler cost it
            step_seconds = record.profiled_step_seconds - (record.window_cost_seconds or 0.0) / record.profiled_steps
            if (learnt := learn.learn_efficiency(session, job, step_seconds, record.exposed_comm_seconds_per_step,
                                           record.time)) is not None:
                add_event(session, job, learnt)
        case EvalRecord():
            add_event(session, job, f"evaluation at step {record.step}", type_="metrics",
                      data=record.model_dump(exclude={"event", "time"}, exclude_none=True))
        case CheckpointRecord():
            if job.cluster:
                record = record.model_copy(update={"uri": volume_uri(record.uri)})
            register_checkpoint(session, job, record)
            job.checkpoint_seconds += record.seconds or 0.0
        case EndRecord():
            job.result = record.model_dump(mode="json", exclude={"event", "time"})
            if job.cluster:  # where a user finds the trained model: on the claim, not inside a pod
                job.result["export"] = {k: v and volume_uri(v) for k, v in job.result["export"].items()}
            add_event(session, job, f"training finished at step {record.step}", type_="metrics",
                      data={"step": record.step, "final_loss": record.final_loss})


def register_checkpoint(session: Session, job: Job, record: CheckpointRecord) -> None:
    """Upsert this step's checkpoint; forget those the store no longer keeps (all but the newest keep_last)."""
    existing = session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id,
                                                     Checkpoint.step == record.step)).first()
    checkpoint = existing or Checkpoint(job_id=job.id, step=record.step, uri=record.uri)
    checkpoint.uri, checkpoint.train_loss = record.uri, record.train_loss
    session.add(checkpoint)
    session.flush()
    kept = select(Checkpoint.step).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc())
    newest = session.exec(kept.limit(record.keep_last)).all()
    session.exec(delete(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step.not_in(newest)))
    add_event(session, job, f"checkpoint at step {record.step}: {record.uri}", type_="metrics",
              data={"step": record.step, "train_loss": record.train_loss})


# Ours first (the order files written before kept); then OpenAI's name for the token accuracy
# (`valid_mean_token_accuracy`, the same figure), and exact match of generated answers, which OpenAI's file lacks.
RESULT_COLUMNS = ("step", "train_loss", "valid_loss", "valid_token_accuracy", "learning_rate", "tokens_per_second",
                  "valid_mean_token_accuracy", "valid_exact_match")
EVALUATION_COLUMNS = (("val_loss", ("valid_loss",)),
                      ("val_token_accuracy", ("valid_token_accuracy", "valid_mean_token_accuracy")),
                      ("exact_match", ("valid_exact_match",)),
                      ("reward_margin", ("valid_reward_margin",)),
                      ("preference_accuracy", ("valid_preference_accuracy",)))
# a dpo job's file adds its training and validation rewards: (column, what a step's metrics call it)
DPO_COLUMNS = (("train_reward_margin", "reward_margin"), ("train_preference_accuracy", "preference_accuracy"),
               ("valid_reward_margin", None), ("valid_preference_accuracy", None))


def write_results_file(*, session: Session, job: Job, data_dir: Path) -> StoredFile:
    """The job's metrics as a CSV file of its tenant's (OpenAI's results file): one row per kept step, with the
    validation figures at each step that was evaluated (step 0 is the evaluation before training, the last step
    the one after it). Written whole, then moved into place; one per job."""
    dpo = (job.spec.get("method") or {}).get("objective") == "dpo"
    rows = {p.step: {"step": p.step, "train_loss": p.data.get("loss"), "learning_rate": p.data.get("learning_rate"),
                     "tokens_per_second": p.data.get("tokens_per_second"),
                     **({column: p.data.get(key) for column, key in DPO_COLUMNS if key} if dpo else {})}
            for p in session.exec(select(MetricPoint).where(MetricPoint.job_id == job.id)).all()}
    for step, scores in evaluations_of(session, job).items():
        row = rows.setdefault(step, {"step": step})
        for measured, named in EVALUATION_COLUMNS:
            if scores.get(measured) is not None:
                row.update(dict.fromkeys(named, scores[measured]))
    text = io.StringIO()
    columns = RESULT_COLUMNS + tuple(column for column, _ in DPO_COLUMNS) if dpo else RESULT_COLUMNS
    writer = csv.DictWriter(text, fieldnames=columns, restval="", extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows[step] for step in sorted(rows))
    content = text.getvalue().encode()
    folder = (data_dir / "files" / job.tenant_id).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    file_id = results_file_id(job)
    final, partial = folder / f"{file_id}.csv", folder / f"{file_id}.csv.partial"
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        out.write(content)
    partial.replace(final)
    stored = session.get(StoredFile, file_id) or StoredFile(id=file_id, tenant_id=job.tenant_id, path=str(final),
                                                            filename=f"{job.id}-results.csv", bytes=0, format="csv",
                                                            examples=0, purpose="fine-tune-results")
    stored.bytes, stored.examples = len(content), len(rows)
    session.add(stored)
    return stored


def evaluations_of(session: Session, job: Job) -> dict[int, dict]:
    """What each evaluation of the job measured, by step: its `evaluation at step N` events (the newest of a
    step wins: a resumed run evaluates again), over the run's result (before training at step 0, after it at
    the last), which holds them where the events were trimmed or an evaluation came without a loss."""
    result, by_step = job.result or {}, {}
    if result.get("eval_before") and not result.get("resumed_from_step"):
        by_step[0] = dict(result["eval_before"])
    if result.get("eval_after") and isinstance(result.get("steps"), int):
        by_step[result["steps"]] = dict(result["eval_after"])
    events = session.exec(select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "metrics",
                                                 JobEvent.message.startswith("evaluation at step"))
                          .order_by(JobEvent.id)).all()
    for event in events:
        data = event.data or {}
        if isinstance(data.get("step"), int):
            by_step.setdefault(data["step"], {}).update({k: v for k, v in data.items() if v is not None})
    return by_step
