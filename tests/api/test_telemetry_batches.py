"""A worker's batch of which no record is valid is refused whole (422, each refusal named), so that a broken
worker is noticed; a batch with some valid record is applied as far as it is valid (200, refusals listed)."""

from sqlmodel import Session

from tests.api.conftest import Server
from tunewright_api.auth import hash_token, issue_token
from tunewright_api.db import make_engine
from tunewright_api.models import Job

STEP = {"event": "step", "step": 1, "epoch": 0, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 1.0,
        "tokens": 400, "tokens_per_second": 4e3, "step_seconds": 0.1, "data_seconds": 0.0,
        "forward_backward_seconds": 0.08, "optimizer_seconds": 0.02}
BROKEN = [{k: v for k, v in STEP.items() if k != "step"}, {**STEP, "loss": "high"}, {**STEP, "step": 1e30}]


def test_a_batch_of_which_no_record_is_valid_is_refused_naming_each_refusal(tmp_path):
    # no job is ever launched here: the one below stays queued, taking its worker's records
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as server:
        engine = make_engine(server.settings.resolved_database_url)
        with Session(engine) as session:
            tenant, _, alice = issue_token(session, "alice")
            tenant_id = tenant.id
            session.add(Job(id="ftjob-one", tenant_id=tenant_id, model="m", spec={},
                            telemetry_token_hash=hash_token("t")))
            session.commit()
        engine.dispose()
        with server.client("t") as worker:
            url = "/v1/internal/jobs/ftjob-one/telemetry"
            refused = worker.post(url, json={"records": BROKEN})
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["param"] == "records" and error["code"] == "no_valid_record"
            assert "record 0: step.step: Field required" in error["message"]  # (the record kind, then its field)
            assert "record 1: step.loss" in error["message"] and "record 2: step.step" in error["message"]
            assert "fix the worker" in error["message"]
            # some valid: applied as far as valid, the refusals listed, as before
            mixed = worker.post(url, json={"records": [*BROKEN, STEP]})
            assert mixed.status_code == 200, mixed.text
            assert mixed.json()["accepted"] == 1 and [r["index"] for r in mixed.json()["rejected"]] == [0, 1, 2]
            assert worker.post(url, json={"records": []}).json() == {"accepted": 0, "rejected": []}
        with server.client(alice) as owner:
            assert owner.get("/v1/jobs/ftjob-one").json()["progress"]["trainedTokens"] == 400  # the refused: none
