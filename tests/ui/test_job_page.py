"""The job page's evaluation table, its loss chart's log scale, its median tokens/s and what it says before a
first step, in a real browser against the real API. No job runs: each is a row, its records posted by its
"worker" through the telemetry route, then given the status its run would have ended with."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from sqlmodel import Session

from tests.api.conftest import Server
from tests.ui.conftest import series_points
from tunewright_api.auth import hash_token, issue_token
from tunewright_api.db import make_engine
from tunewright_api.models import Job, now

# the first step compiles, the last is short: their median is 1,000 tokens/s, the last step's 300
SPEEDS = {1: 50.0, 2: 1_000.0, 3: 1_100.0, 4: 1_200.0, 5: 300.0}
BEFORE = {"val_loss": 3.2, "val_token_accuracy": 0.25, "exact_match": 0.1, "exact_match_examples": 40}
MIDDLE = {"val_loss": 2.4, "val_token_accuracy": 0.4}  # an evaluation every 2 steps scores no exact match
AFTER = {"val_loss": 1.6, "val_token_accuracy": 0.625, "exact_match": 0.55, "exact_match_examples": 40}
EMPTY = "No step logged yet."
SCALE_KEY = "tunewright.lossScale"


def steps() -> list[dict]:
    return [{"event": "step", "step": n, "time": 1.7e9 + n, "epoch": 0, "loss": 3.0 / n, "learning_rate": 1e-3,
             "grad_norm": 1.0, "tokens": 1_000, "tokens_per_second": speed, "step_seconds": 1_000 / speed,
             "data_seconds": 0.0, "forward_backward_seconds": 1_000 / speed, "optimizer_seconds": 0.0}
            for n, speed in SPEEDS.items()]


EVALUATED = [{"event": "start", "step": 0, "total_steps": 5}, {"event": "eval", "step": 0, **BEFORE}, *steps()[:2],
             {"event": "eval", "step": 2, **MIDDLE}, *steps()[2:], {"event": "eval", "step": 5, **AFTER},
             {"event": "end", "step": 5, "steps": 5, "final_loss": 0.6, "eval_before": BEFORE, "eval_after": AFTER}]
EVALUATING = EVALUATED[:5]  # started, evaluated, 2 steps, evaluated again: no end yet
PLAIN = [{"event": "start", "step": 0, "total_steps": 5}, *steps(),
         {"event": "end", "step": 5, "steps": 5, "final_loss": 0.6, "eval_before": None, "eval_after": None}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    # no job is ever launched: each stays as seeded
    with Server(tmp_path_factory.mktemp("ui-job-page") / "data", local_ray=False, max_running_jobs=0) as server:
        engine = make_engine(server.settings.resolved_database_url)
        with Session(engine) as session:
            tenant, _, token = issue_token(session, "alice")
            tenant_id = tenant.id

        def seed(job_id: str, records: list[dict], **ended) -> str:
            with Session(engine) as session:
                session.add(Job(id=job_id, tenant_id=tenant_id, model="org/tiny-model", spec={},
                                telemetry_token_hash=hash_token(f"worker-{job_id}")))
                session.commit()
            if records:
                with server.client(f"worker-{job_id}") as worker:
                    answer = worker.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": records})
                    assert answer.status_code == 200 and answer.json()["rejected"] == [], answer.text
            with Session(engine) as session:
                job = session.get(Job, job_id)
                for key, value in ended.items():
                    setattr(job, key, value)
                session.add(job)
                session.commit()
            return job_id

        finished = {"status": "succeeded", "started_at": now() - timedelta(minutes=3), "finished_at": now()}
        jobs = SimpleNamespace(
            evaluated=seed("ftjob-evaluated", EVALUATED, **finished),
            plain=seed("ftjob-plain", PLAIN, **finished),
            evaluating=seed("ftjob-evaluating", EVALUATING),
            failed=seed("ftjob-failed", [], status="failed", error_code="worker_lost",
                        error_message="the worker exited before its first step", finished_at=now()),
            queued=seed("ftjob-queued", []))
        with server.client(token) as alice:
            yield SimpleNamespace(url=server.url, token=token, alice=alice, jobs=jobs)
        engine.dispose()


def job_page(api, browser, job_id: str, status: str) -> None:
    browser.open(api.url, api.token, f"/jobs/{job_id}")
    browser.wait(lambda: browser.text("#job-title") == job_id and browser.attribute("#job-page", "data-status") == status
                 and browser.text("#figure-tps"), what=f"{job_id}'s page drawn")


def test_a_job_that_evaluated_shows_its_scores_before_and_after(api, browser):
    job_page(api, browser, api.jobs.evaluated, "succeeded")
    assert browser.text("#evaluation-title") == "Evaluation: before → after"
    head = browser.js("return [...document.querySelectorAll('#evaluation-table thead th')].map(c => c.innerText)")
    assert head == ["Metric", "Before training", "After training (step 5)", "Change"]
    rows = browser.js("return [...document.querySelectorAll('#evaluation-table tbody tr')]"
                      ".map(r => [...r.cells].map(c => c.innerText))")
    assert rows == [["Validation loss", "3.200", "1.600", "−1.600"],
                    ["Token accuracy", "25.0%", "62.5%", "+37.5 points"],
                    ["Exact match (40 examples)", "10.0%", "55.0%", "+45.0 points"]]
    # every evaluation, the one between too, is a validation point on the loss chart
    evaluations = api.alice.get(f"/v1/jobs/{api.jobs.evaluated}/telemetry").json()["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 2, 5]
    assert series_points(browser, "chart-loss") == {"training loss": len(SPEEDS), "validation loss": 3}
    browser.screenshot("job-page-evaluation.png", full_page=True)
    assert browser.console_errors() == []

    job_page(api, browser, api.jobs.plain, "succeeded")  # no validation set: nothing of it on the page
    assert browser.js("return document.getElementById('evaluation').hidden") is True
    assert browser.js("return document.getElementById('evaluation-table')") is None
    assert series_points(browser, "chart-loss") == {"training loss": len(SPEEDS), "validation loss": 0}
    assert browser.console_errors() == []


def test_a_job_not_ended_shows_its_latest_evaluation_beside_the_first(api, browser):
    job_page(api, browser, api.jobs.evaluating, "queued")
    head = browser.js("return [...document.querySelectorAll('#evaluation-table thead th')].map(c => c.innerText)")
    assert head == ["Metric", "Before training", "Latest (step 2)", "Change"]
    rows = browser.js("return [...document.querySelectorAll('#evaluation-table tbody tr')]"
                      ".map(r => [...r.cells].map(c => c.innerText))")
    assert rows == [["Validation loss", "3.200", "2.400", "−0.800"],
                    ["Token accuracy", "25.0%", "40.0%", "+15.0 points"],
                    ["Exact match", "10.0%", "—", "—"]]  # scored before training and at the end only; how many: at the end
    assert browser.console_errors() == []


def test_the_headline_tokens_per_second_is_the_median_of_the_logged_steps(api, browser):
    latest = api.alice.get(f"/v1/jobs/{api.jobs.plain}/telemetry").json()["latest"]
    assert latest["tokensPerSecondMedian"] == 1_000 and latest["tokensPerSecond"] == 300  # the last step's
    job_page(api, browser, api.jobs.plain, "succeeded")
    label = browser.js("return document.getElementById('figure-tps').previousElementSibling.innerText")
    assert "median" in label
    assert browser.text("#figure-tps").split("\n")[0] == "1,000"
    assert "median 1,000, last 300 over 5 logged steps" in browser.text("#chart-throughput-summary")  # the same median
    assert browser.console_errors() == []


def test_the_loss_chart_switches_to_a_log_scale_from_the_keyboard_and_keeps_it(api, browser):
    job_page(api, browser, api.jobs.evaluated, "succeeded")
    browser.js(f"localStorage.removeItem('{SCALE_KEY}')")
    browser.driver.refresh()
    browser.wait(lambda: browser.attribute("#chart-loss", "data-scale") == "linear", what="the linear loss chart")
    toggle = browser.driver.find_element(By.ID, "chart-loss-log")
    assert browser.js("return arguments[0].labels[0].innerText.trim()", toggle) == "log scale"
    assert not toggle.is_selected()
    drawn = series_points(browser, "chart-loss")

    toggle.send_keys(Keys.SPACE)  # focused and pressed: no mouse needed
    browser.wait(lambda: browser.attribute("#chart-loss", "data-scale") == "log", what="the log scale")
    assert browser.js(f"return localStorage.getItem('{SCALE_KEY}')") == "log"
    assert series_points(browser, "chart-loss") == drawn  # the same points, on another axis
    browser.screenshot("job-page-loss-log-scale.png")

    browser.driver.refresh()  # remembered
    browser.wait(lambda: browser.attribute("#chart-loss", "data-scale") == "log", what="the log scale kept")
    toggle = browser.driver.find_element(By.ID, "chart-loss-log")
    assert toggle.is_selected()
    toggle.send_keys(Keys.SPACE)
    browser.wait(lambda: browser.attribute("#chart-loss", "data-scale") == "linear", what="the linear scale again")
    assert browser.js(f"return localStorage.getItem('{SCALE_KEY}')") == "linear"
    assert browser.console_errors() == []


@pytest.mark.parametrize(("job", "status", "why"), [
    ("failed", "failed", "The job failed before its first logged step."),
    ("queued", "queued", "The charts start with the first one."),
])
def test_a_job_without_a_step_says_so_once(api, browser, job, status, why):
    job_page(api, browser, getattr(api.jobs, job), status)
    assert browser.text("#charts-empty") == f"{EMPTY} {why}"
    assert browser.js("return document.body.innerText.split(arguments[0]).length - 1", EMPTY) == 1
    assert browser.js("return document.getElementById('charts').hidden") is True
    assert browser.js("return document.querySelectorAll('#main canvas').length") == 0
    # nothing absent is written as "null" (the diagnosis and checkpoints have nothing to list yet)
    assert "null" not in browser.js("return document.getElementById('main').innerText").split()
    browser.screenshot(f"job-page-no-step-{status}.png")
    assert browser.console_errors() == []


def test_a_job_with_steps_shows_its_charts_and_no_empty_message(api, browser):
    job_page(api, browser, api.jobs.plain, "succeeded")
    assert browser.js("return document.getElementById('charts-empty').hidden") is True
    assert EMPTY not in browser.js("return document.body.innerText")
    # a chart with nothing yet (no profiler window) says so once, in its description
    text = browser.js("return document.getElementById('chart-comm').innerText")
    assert text.count("No profiler window measured yet") == 1
    assert browser.console_errors() == []
