"""Progress and measured telemetry beside the plan's predictions: the derivations are the plan's own."""

from datetime import UTC, datetime, timedelta

import pytest

from tunewright_api.telemetry import measured, progress
from tunewright_core.spec import JobPlan

START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PREDICTED = {"peakMemoryGiB": 40, "stepSeconds": 1.0, "matmulSeconds": 0.6, "memoryBoundSeconds": 0.3,
             "optimizerSeconds": 0.1, "commSeconds": 0.1, "exposedCommSeconds": 0.0, "offloadSeconds": 0,
             "exposedOffloadSeconds": 0, "hostMemoryGiBPerNode": 0, "commShare": 0.1, "exposedCommShare": 0,
             "mfu": 0.40, "tokensPerSecond": 100_000.0, "durationSeconds": 3600.0, "costUSD": 32.0,
             "memoryBreakdownGiB": {}}
PLAN = JobPlan.model_validate({"pool": "h200", "strategy": "ddp", "workers": 8, "gpus": 8, "microBatch": 4,
                               "gradAccum": 1, "explanation": "test", "predicted": PREDICTED})
COMM = {"step": 200, "comm_share": 0.12, "comm_share_exposed": 0.03, "comm_share_max_rank": 0.15}


@pytest.mark.parametrize(("plan", "comm", "tokens_per_second", "finished", "expected"), [
    # on plan: the measured MFU is the predicted one, the cost so far is the hour's share of the prediction
    (PLAN, COMM, 100_000.0, None, {"mfu": 0.40, "costUSD": 16.0, "commShare": 0.12, "commShareExposed": 0.03}),
    # 20% slower than predicted: 20% less MFU; a finished job's cost stops at its end
    (PLAN, COMM, 80_000.0, START + timedelta(minutes=15), {"mfu": 0.32, "costUSD": 8.0}),
    # nothing measured yet
    (PLAN, None, None, None, {"mfu": None, "costUSD": 16.0, "commShare": None}),
    # a CPU job has no predictions: no MFU or cost, communication still measured
    (None, COMM, 5_000.0, None, {"mfu": None, "costUSD": None, "commShare": 0.12, "commMeasuredAtStep": 200}),
])
def test_measured_beside_predicted(plan, comm, tokens_per_second, finished, expected):
    got = measured(plan, comm, tokens_per_second, START, finished, now=START + timedelta(minutes=30))
    wire = got.model_dump(by_alias=True)
    for key, value in expected.items():
        assert wire[key] == (pytest.approx(value) if value is not None else None), key


@pytest.mark.parametrize(("status", "step", "total", "started", "speed", "eta"), [
    # 9,000 tokens in 10 steps at 900 tokens/s: 1 s a step, 30 s for the 30 left (the 30 minutes since the
    # start were mostly start-up: they must not make the estimate 90 minutes)
    ("running", 10, 40, START, 900.0, 30.0),
    ("running", 10, 40, START, None, 30 * 60 * 3.0),  # no pace reported: 30 min for 10 steps, 90 for 30
    ("running", 0, 40, START, 900.0, None),  # no step done: no pace yet
    ("succeeded", 40, 40, START, 900.0, None),  # only running jobs have an ETA
    ("running", 10, None, START, 900.0, None),  # total unknown until the run starts counting
    ("running", 10, 40, START.replace(tzinfo=None), None, 30 * 60 * 3.0),  # SQLite gives naive UTC times back
])
def test_progress_and_eta(status, step, total, started, speed, eta):
    got = progress(status, step, total, 1.5, speed, 9000, started, now=START + timedelta(minutes=30))
    percent = {(10, 40): 25.0, (40, 40): 100.0, (0, 40): 0.0}.get((step, total))
    assert got.model_dump(by_alias=True) == {"step": step, "totalSteps": total, "percent": percent, "loss": 1.5,
                                             "tokensPerSecond": speed, "trainedTokens": 9000, "etaSeconds": eta}


def test_a_batch_read_before_the_run_ended_is_refused_after_it(database_url, tmp_path):
    """The race of a killed run: its last batch authenticated while the job ran, the job failed before the
    batch was written. The batch is refused (410) and writes nothing; the job stays failed."""
    from sqlmodel import Session, select

    from tunewright_api.auth import hash_token, issue_token
    from tunewright_api.db import make_engine, migrate
    from tunewright_api.errors import ApiError
    from tunewright_api.models import Job, JobEvent
    from tunewright_api.services import telemetry as service
    from tunewright_api.telemetry import StepRecord

    engine = make_engine(database_url or f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    with Session(engine) as setup:
        tenant_id = issue_token(setup, "alice")[0].id
        job = Job(tenant_id=tenant_id, model="m", spec={}, status="running", telemetry_token_hash=hash_token("t"))
        setup.add(job)
        setup.commit()
        job_id = job.id
    with Session(engine) as request, Session(engine) as backend:
        job = service.authenticated_job(session=request, job_id=job_id, token="t")  # still running here
        ended = backend.get(Job, job_id)
        ended.status = "failed"
        backend.add(ended)
        backend.commit()
        step = StepRecord(event="step", step=20, epoch=0, loss=2.0, learning_rate=1e-3, grad_norm=1.0, tokens=10,
                          tokens_per_second=1.0, step_seconds=0.1, data_seconds=0.0, forward_backward_seconds=0.1,
                          optimizer_seconds=0.0)
        with pytest.raises(ApiError) as refused:
            service.ingest(session=request, job=job, records=[step], data_dir=tmp_path)
        assert refused.value.status == 410 and "already failed" in refused.value.message
    with Session(engine) as check:
        assert check.get(Job, job_id).status == "failed" and check.get(Job, job_id).step == 0
        assert check.exec(select(JobEvent).where(JobEvent.job_id == job_id)).all() == []
    engine.dispose()
