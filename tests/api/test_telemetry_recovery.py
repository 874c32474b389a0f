"""What a run measured but the API missed (it was down or slow as the run ended) is recovered from the run's
metrics file, once: the records the API got are not counted twice, however often recovery runs."""

import json

from sqlmodel import Session, select

from tunewright_api.auth import hash_token, issue_token
from tunewright_api.db import make_engine, migrate
from tunewright_api.models import Checkpoint, Job, JobEvent, StoredFile
from tunewright_api.services import telemetry as service
from tunewright_api.telemetry import parse_records


def step(n: int) -> dict:
    return {"event": "step", "step": n, "epoch": 0, "loss": 3.0 - n / 10, "learning_rate": 1e-3, "grad_norm": 1.0,
            "tokens": 100, "tokens_per_second": 1e3, "step_seconds": 0.1, "data_seconds": 0.0,
            "forward_backward_seconds": 0.08, "optimizer_seconds": 0.02}


def evaluation(n: int) -> dict:
    return {"event": "eval", "step": n, "val_loss": 2.0, "val_token_accuracy": 0.5}


CHECKPOINT_5 = {"event": "checkpoint", "step": 5, "uri": "/run/checkpoints/step_00000005", "train_loss": 2.5,
                "keep_last": 2}
END = {"event": "end", "step": 10, "steps": 10, "final_loss": 2.0, "export": {"adapter": "/run/output/adapter"}}
# as the run emitted them; the API got them up to the evaluation at step 5, not the checkpoint after it
EMITTED = [{"event": "start", "step": 0, "total_steps": 10}, evaluation(0), *map(step, range(1, 6)), evaluation(5),
           CHECKPOINT_5, *map(step, range(6, 11)), evaluation(10), END]
RECEIVED = EMITTED[:8]


def test_the_records_a_run_wrote_but_the_api_missed_are_applied_once(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    metrics = tmp_path / "metrics.jsonl"
    # the run's file; its last line cut short as the run was killed while writing it
    metrics.write_text("".join(json.dumps(r) + "\n" for r in EMITTED) + '{"event": "st')
    with Session(engine) as session:
        tenant_id = issue_token(session, "alice")[0].id
        job = Job(tenant_id=tenant_id, model="m", spec={}, status="running", telemetry_token_hash=hash_token("t"))
        session.add(job)
        session.commit()
        service.ingest(session=session, job=job, records=parse_records(RECEIVED)[0], data_dir=tmp_path)
        assert (job.step, job.trained_tokens) == (5, 500)

        for recovered in (8, 0):  # the checkpoint at 5, steps 6 to 10, the last evaluation and the end; then none
            count = service.recover(session=session, job=job, path=metrics, data_dir=tmp_path)
            session.commit()
            assert count == recovered
            assert (job.step, job.total_steps, job.trained_tokens, job.loss) == (10, 10, 1000, 2.0)
        evaluations = session.exec(select(JobEvent.message).where(JobEvent.job_id == job.id,
                                                                  JobEvent.message.startswith("evaluation"))).all()
        assert sorted(evaluations) == ["evaluation at step 0", "evaluation at step 10", "evaluation at step 5"]
        assert session.exec(select(Checkpoint.step).where(Checkpoint.job_id == job.id)).all() == [5]
        (results_id,) = job.result["result_files"]
        assert job.result["final_loss"] == 2.0 and session.get(StoredFile, results_id).examples == 11  # 0..10


def test_nothing_is_recovered_from_a_run_that_wrote_no_file(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    with Session(engine) as session:
        tenant_id = issue_token(session, "alice")[0].id
        job = Job(tenant_id=tenant_id, model="m", spec={}, status="running", telemetry_token_hash=hash_token("t"))
        session.add(job)
        session.commit()
        assert service.recover(session=session, job=job, path=tmp_path / "none.jsonl", data_dir=tmp_path) == 0
