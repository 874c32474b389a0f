"""The job page of a dpo job: its step records carry reward_margin and preference_accuracy (the runtime's
StepRecord), and the page charts them ("Preference"); an sft job's page has no such chart. In a real browser
against the real API; no job runs: each is a row, its records posted by its "worker" through the telemetry
route (as test_job_page.py seeds them)."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlmodel import Session

from tests.api.conftest import Server
from tests.ui.conftest import series_points
from tunewright_api.auth import hash_token, issue_token
from tunewright_api.db import make_engine
from tunewright_api.models import Job, now

MARGINS = {1: 0.0, 2: 0.4, 3: 1.1, 4: 2.3}
ACCURACY = {1: 0.5, 2: 0.625, 3: 0.875, 4: 1.0}


def step(n: int, **extra) -> dict:
    return {"event": "step", "step": n, "time": 1.7e9 + n, "epoch": 0, "loss": 0.69 / n, "learning_rate": 1e-3,
            "grad_norm": 1.0, "tokens": 2_000, "tokens_per_second": 1_000.0, "step_seconds": 2.0,
            "data_seconds": 0.0, "forward_backward_seconds": 2.0, "optimizer_seconds": 0.0, **extra}


DPO_RECORDS = [{"event": "start", "step": 0, "total_steps": 4},
               *(step(n, reward_margin=MARGINS[n], preference_accuracy=ACCURACY[n],
                      chosen_reward=MARGINS[n] / 2, rejected_reward=-MARGINS[n] / 2) for n in MARGINS),
               {"event": "end", "step": 4, "steps": 4, "final_loss": 0.17,
                "eval_before": {"val_loss": 0.6931, "val_token_accuracy": 0.1, "preference_accuracy": 0.0,
                                "reward_margin": 0.0},
                "eval_after": {"val_loss": 0.25, "val_token_accuracy": 0.2, "preference_accuracy": 0.875,
                               "reward_margin": 1.5}}]
SFT_RECORDS = [{"event": "start", "step": 0, "total_steps": 4}, *(step(n) for n in MARGINS),
               {"event": "end", "step": 4, "steps": 4, "final_loss": 0.17, "eval_before": None, "eval_after": None}]
DPO_SPEC = {"model": {"source": "org/tiny-model"}, "method": {"type": "lora", "objective": "dpo",
                                                              "lora": {"r": 8}, "dpo": {"beta": 0.2}},
            "dataset": {"train": "file-x", "format": "preference"}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("ui-preference") / "data", local_ray=False, max_running_jobs=0) as server:
        engine = make_engine(server.settings.resolved_database_url)
        with Session(engine) as session:
            tenant, _, token = issue_token(session, "alice")
            tenant_id = tenant.id

        def seed(job_id: str, spec: dict, records: list[dict]) -> str:
            with Session(engine) as session:
                session.add(Job(id=job_id, tenant_id=tenant_id, model="org/tiny-model", spec=spec,
                                telemetry_token_hash=hash_token(f"worker-{job_id}")))
                session.commit()
            with server.client(f"worker-{job_id}") as worker:
                answer = worker.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": records})
                assert answer.status_code == 200 and answer.json()["rejected"] == [], answer.text
            with Session(engine) as session:
                job = session.get(Job, job_id)
                job.status, job.started_at, job.finished_at = "succeeded", now() - timedelta(minutes=2), now()
                session.add(job)
                session.commit()
            return job_id

        jobs = SimpleNamespace(dpo=seed("ftjob-dpo", DPO_SPEC, DPO_RECORDS), sft=seed("ftjob-sft", {}, SFT_RECORDS))
        with server.client(token) as alice:
            yield SimpleNamespace(url=server.url, token=token, alice=alice, jobs=jobs)
        engine.dispose()


def job_page(api, browser, job_id: str) -> None:
    browser.open(api.url, api.token, f"/jobs/{job_id}")
    browser.wait(lambda: browser.text("#job-title") == job_id and browser.attribute("#job-page", "data-status")
                 == "succeeded" and browser.text("#figure-tps"), what=f"{job_id}'s page drawn")


def test_the_api_keeps_a_steps_preference_metrics(api):
    series = api.alice.get(f"/v1/jobs/{api.jobs.dpo}/telemetry").json()["series"]
    assert [(p["rewardMargin"], p["preferenceAccuracy"]) for p in series] == [
        (MARGINS[n], ACCURACY[n]) for n in MARGINS]
    metrics = api.alice.get(f"/v1/jobs/{api.jobs.dpo}/metrics").json()["data"]
    assert metrics[-1]["rewardMargin"] == MARGINS[4] and metrics[-1]["preferenceAccuracy"] == ACCURACY[4]
    plain = api.alice.get(f"/v1/jobs/{api.jobs.sft}/telemetry").json()["series"]
    assert {(p["rewardMargin"], p["preferenceAccuracy"]) for p in plain} == {(None, None)}


def test_a_dpo_jobs_page_charts_its_reward_margin_and_preference_accuracy(api, browser):
    job_page(api, browser, api.jobs.dpo)
    browser.wait(lambda: browser.js("return document.getElementById('preference').hidden") is False,
                 what="the preference chart shown")
    assert browser.text("#chart-preference figcaption") == "Preference: reward margin and accuracy"
    assert series_points(browser, "chart-preference") == {"reward margin": 4, "preference accuracy": 4}
    summary = browser.text("#chart-preference-summary")
    assert "Reward margin (chosen less rejected) 0.00 → 2.300" in summary
    assert "preference accuracy (pairs whose chosen answer has the higher reward) 50.0% → 100.0%" in summary
    assert "over 4 logged steps" in summary
    assert "LoRA r8 · DPO β 0.2" in browser.text(".facts")
    rows = browser.js("return [...document.querySelectorAll('#evaluation-table tbody tr')]"
                      ".map(r => [...r.cells].map(c => c.innerText))")
    assert rows[:3] == [["Validation loss", "0.693", "0.250", "−0.443"],
                        ["Preference accuracy", "0.0%", "87.5%", "+87.5 points"],
                        ["Reward margin", "0.00", "1.500", "+1.500"]], rows
    browser.screenshot("job-page-preference.png", full_page=True)
    assert browser.console_errors() == []


def test_an_sft_jobs_page_has_no_preference_chart(api, browser):
    job_page(api, browser, api.jobs.sft)
    assert browser.js("return document.getElementById('preference').hidden") is True
    assert series_points(browser, "chart-preference") == {}
    assert browser.console_errors() == []
