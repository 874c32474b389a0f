"""The dashboard following a real tiny job (the tiny kit's GPT-2, two training processes on this machine), in
a real browser against the real API: the list live, the job page's charts against what the API measured, another
tenant's view, cancel. One job trains for the whole module; a second, long one is cancelled from its page."""

import time
from types import SimpleNamespace

import pytest
from selenium.webdriver.common.by import By

from tests.api.conftest import TRAIN, VALIDATION, Server, tiny_spec, upload, wait_for
from tests.ui.conftest import LAPTOP, PHONE, TOKEN_KEY, series_points, token_of

pytestmark = pytest.mark.slow  # trains a job (about a minute here)

STEPS, EVAL_EVERY = 30, 10
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_models):
    with Server(tmp_path_factory.mktemp("ui-dashboard") / "data", local_ray=False) as server:
        alice, bob = server.tenant("alice"), server.tenant("bob")
        train, validation = upload(alice, TRAIN).json()["id"], upload(alice, VALIDATION).json()["id"]
        spec = tiny_spec(tiny_models["gpt2"], train, validation, maxSteps=STEPS)
        spec["evaluation"] = {"everySteps": EVAL_EVERY}
        job = alice.post("/v1/jobs", json=spec)
        assert job.status_code == 201, job.text
        yield SimpleNamespace(server=server, url=server.url, alice=alice, bob=bob, job_id=job.json()["id"],
                              long_spec=tiny_spec(tiny_models["gpt2"], train, maxSteps=100_000))
        for listed in alice.get("/v1/jobs").json()["data"]:
            if listed["status"] not in TERMINAL:
                alice.post(f"/v1/jobs/{listed['id']}/cancel")


def row_status(browser, job_id: str) -> str | None:
    return browser.attribute(f'tr[data-job-id="{job_id}"]', "data-status")


def test_the_jobs_list_shows_the_job_and_follows_its_status_live(api, browser):
    browser.viewport(LAPTOP)
    browser.open(api.url, token_of(api.alice))
    first = browser.wait(lambda: row_status(browser, api.job_id), what="the job's row")
    # the link's token went to this tab's storage and out of the address bar
    assert "token" not in browser.driver.current_url and browser.driver.current_url.endswith("#/jobs")
    assert browser.js(f"return sessionStorage.getItem('{TOKEN_KEY}')") == token_of(api.alice)
    browser.js("window.sameDocument = true")  # gone if the page reloads
    seen = [first]
    deadline = time.monotonic() + 300
    while seen[-1] not in TERMINAL:
        assert time.monotonic() < deadline, f"the row's status went {seen} and stopped there"
        status = row_status(browser, api.job_id)
        if status != seen[-1]:
            seen.append(status)
        time.sleep(0.1)
    assert first in ("queued", "running") and seen[-1] == "succeeded", seen
    assert browser.js("return window.sameDocument") is True  # followed by polling, not by reloading
    job = api.alice.get(f"/v1/jobs/{api.job_id}").json()
    cells = browser.js("return [...document.querySelector(arguments[0]).cells].map(c => c.innerText)",
                       f'tr[data-job-id="{api.job_id}"]')
    assert cells[:3] == [api.job_id, job["model"].rsplit("/", 1)[-1], "LoRA r8"]
    assert cells[3] == "succeeded" and cells[4] == f"{job['plan']['strategy']} · 2 CPU workers"
    assert cells[5] == "—"  # the local CPU pool has no price: no cost, said as such
    # the status filter narrows the list (through the API's own `status`)
    browser.driver.get(f"{api.url}/ui/#/jobs?status=running")
    browser.wait(lambda: browser.text("#jobs-empty") == "No running jobs.", what="no running job")
    browser.driver.get(f"{api.url}/ui/#/jobs?status=succeeded")
    browser.wait(lambda: row_status(browser, api.job_id) == "succeeded", what="the job among the succeeded")
    browser.screenshot("jobs-list-finished.png")
    assert browser.console_errors() == []


def test_the_job_page_draws_the_curves_the_api_measured(api, browser):
    done = wait_for(api.alice, api.job_id, TERMINAL, timeout=300)
    assert done["status"] == "succeeded", done["error"]
    telemetry = api.alice.get(f"/v1/jobs/{api.job_id}/telemetry").json()
    series, evaluations, windows = telemetry["series"], telemetry["evaluations"], telemetry["comm"]
    assert len(series) == STEPS and len(evaluations) >= STEPS // EVAL_EVERY and windows  # a real run's records
    browser.viewport(LAPTOP)
    browser.open(api.url, token_of(api.alice), f"/jobs/{api.job_id}")
    browser.wait(lambda: browser.attribute("#job-page", "data-status") == "succeeded"
                 and browser.attribute("#chart-comm", "data-points") != "0", what="the job page drawn")

    steps = {p["step"] for p in series} | {e["step"] for e in evaluations}
    assert browser.attribute("#chart-loss", "data-points") == str(len(steps))
    assert series_points(browser, "chart-loss") == {"training loss": len([p for p in series if p["loss"] is not None]),
                                                    "validation loss": len(evaluations)}
    assert series_points(browser, "chart-throughput") == {"tokens/s": len(series), "MFU": 0}  # no MFU on the CPU
    assert series_points(browser, "chart-comm") == {"communication": len(windows),
                                                    "exposed communication": len(windows), "GPU busy": 0}
    # a CPU run: every step is on the GPU chart's axis, none with an SM-active value, and the page says why
    assert browser.attribute("#chart-gpu", "data-points") == str(len(series))
    assert series_points(browser, "chart-gpu") == {"SM-active": 0, "tensor-active": 0, "DRAM bandwidth": 0,
                                                   "kernel-active": 0}
    assert "SM-active not measured: a CPU run: no GPU to read" in browser.text("#chart-gpu-summary")
    for chart in ("chart-loss", "chart-throughput", "chart-comm"):  # uPlot drew lines on its canvas
        drawn = browser.js("""const canvas = document.querySelector(arguments[0] + ' canvas');
            const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
            let painted = 0; for (let i = 3; i < pixels.length; i += 4) painted += pixels[i] > 0;
            return [canvas.width, painted];""", f"#{chart}")
        assert drawn[0] > 300 and drawn[1] > 500, (chart, drawn)
        assert browser.attribute(f"#{chart}", "aria-label") and browser.text(f"#{chart}-summary")
    assert f"over {STEPS} logged steps" in browser.text("#chart-loss-summary")
    # the headline tokens/s is the API's median of the steps (30: the middle two averaged), the chart's the same
    headline = browser.text("#figure-tps").split("\n")[0]
    assert abs(float(headline.replace(",", "")) - telemetry["latest"]["tokensPerSecondMedian"]) <= 0.5  # rounded
    assert f"median {headline}, last" in browser.text("#chart-throughput-summary")

    # the plan beside what was measured, the diagnosis, checkpoints, events, the trained adapter
    plan = done["plan"]
    assert browser.text("#plan-strategy") == f"{plan['strategy']} · 2 CPU workers"
    assert browser.text("#plan-explanation") == plan["explanation"]
    # a CPU plan predicts nothing and has no band: the panel says nothing of it, not "null"
    assert "null" not in browser.text("#plan").split() and not browser.text("#plan-band")
    measured = browser.js("return [...document.querySelectorAll('#predicted-measured tbody tr')]"
                          ".map(r => [r.cells[0].innerText, r.cells[2].innerText])")
    assert ["Tokens/s", f"{telemetry['latest']['tokensPerSecond']:,.0f}"] in measured
    assert ["Communication share", f"{telemetry['latest']['commShare']:.1%}"] in measured
    diagnosis = api.alice.get(f"/v1/jobs/{api.job_id}/diagnosis").json()
    assert browser.text("#diagnosis-status").startswith(diagnosis["status"])
    checkpoints = api.alice.get(f"/v1/jobs/{api.job_id}/checkpoints").json()["data"]
    shown = browser.js("return [...document.querySelectorAll('#checkpoints-table tbody tr')].map(r => r.cells[0].innerText)")
    assert shown == [str(c["stepNumber"]) for c in checkpoints] and shown
    events = browser.text("#events-table")
    assert "succeeded" in events and "queued; plan:" in events and f"step {STEPS}: training loss" not in events
    browser.driver.find_element(By.ID, "show-step-events").click()
    assert f"step {STEPS}: training loss" in browser.text("#events-table")
    assert browser.text("#download-command") == f"tunewright download {api.job_id} --dir my-adapter"
    assert done["result"]["export"]["adapter"] in browser.text("#trained-model")
    button = browser.wait(lambda: browser.driver.find_elements(
        By.CSS_SELECTOR, '#artifacts button[data-path="adapter/adapter_config.json"]'), what="the adapter's files")
    button[0].click()  # fetched with the token, saved by the browser
    saved = browser.downloads / "adapter_config.json"
    browser.wait(saved.exists, what="the download")
    assert saved.read_bytes() == api.alice.get(f"/v1/jobs/{api.job_id}/artifacts/adapter/adapter_config.json").content
    browser.driver.find_element(By.CSS_SELECTOR, "#logs summary").click()
    browser.wait(lambda: len(browser.text("#log-lines")) > 100, what="the run log")

    browser.js("window.scrollTo(0, 0)")
    browser.screenshot("dashboard-job.png", docs="dashboard-job.png")
    browser.screenshot("job-page-full.png", full_page=True)
    browser.color_scheme("dark")  # the page and its charts follow the system's scheme
    browser.wait(lambda: browser.js("return getComputedStyle(document.body).backgroundColor") == "rgb(13, 17, 23)",
                 what="the dark background")
    browser.screenshot("job-page-dark.png")
    assert series_points(browser, "chart-loss")["training loss"] == len(series)  # redrawn, the same data
    browser.color_scheme("light")
    browser.viewport(PHONE, mobile=True)
    browser.wait(lambda: browser.js("return innerWidth") == PHONE[0], what="the phone's width")
    assert browser.js("return document.documentElement.scrollWidth") <= PHONE[0]  # nothing runs off the screen
    browser.screenshot("job-page-phone.png")
    browser.screenshot("job-page-phone-full.png", full_page=True)
    browser.driver.get(f"{api.url}/ui/#/jobs")
    browser.wait(lambda: row_status(browser, api.job_id), what="the list")
    assert browser.js("return document.documentElement.scrollWidth") <= PHONE[0]
    browser.screenshot("jobs-list-phone.png")
    browser.viewport(LAPTOP)
    assert browser.console_errors() == []


def test_another_tenant_sees_neither_the_job_nor_its_page(api, browser):
    browser.open(api.url, token_of(api.bob))
    browser.wait(lambda: browser.text("#jobs-empty").startswith("No jobs yet"), what="bob's empty list")
    assert row_status(browser, api.job_id) is None
    browser.driver.get(f"{api.url}/ui/#/jobs/{api.job_id}")
    browser.wait(lambda: browser.attribute("#job-page", "data-state") == "not-found", what="the not-found state")
    assert browser.text("#not-found").startswith("Job not found (404)")
    assert "canvas" not in browser.js("return document.getElementById('main').innerHTML")  # nothing of alice's drawn
    assert api.bob.get(f"/v1/jobs/{api.job_id}").status_code == 404
    assert api.alice.get(f"/v1/jobs/{api.job_id}").status_code == 200


def test_cancel_from_the_job_page_stops_a_running_job(api, browser):
    wait_for(api.alice, api.job_id, TERMINAL, timeout=300)  # one job runs at a time: the first is done
    job_id = api.alice.post("/v1/jobs", json=api.long_spec).json()["id"]
    wait_for(api.alice, job_id, {"running"})
    deadline = time.monotonic() + 120
    while api.alice.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] < 3:
        assert time.monotonic() < deadline, "the long job logged no step"
        time.sleep(0.3)
    browser.viewport(LAPTOP)
    browser.open(api.url, token_of(api.alice))
    browser.wait(lambda: row_status(browser, job_id) == "running" and browser.text(f'tr[data-job-id="{job_id}"]'),
                 what="the running job listed")
    browser.wait(lambda: "ETA" in browser.text(f'tr[data-job-id="{job_id}"]'), what="its progress and ETA")
    browser.screenshot("dashboard-jobs.png", docs="dashboard-jobs.png")

    browser.driver.get(f"{api.url}/ui/#/jobs/{job_id}")
    cancel = browser.wait(lambda: [b for b in browser.driver.find_elements(By.ID, "cancel-job") if b.is_displayed()],
                          what="the cancel button")[0]
    cancel.click()
    browser.driver.switch_to.alert.dismiss()  # asked first: no means no
    assert api.alice.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
    cancel.click()
    browser.driver.switch_to.alert.accept()
    browser.wait(lambda: browser.attribute("#job-page", "data-status") == "cancelled", what="the page saying cancelled")
    assert browser.text("#job-status") == "cancelled"
    assert not browser.driver.find_element(By.ID, "cancel-job").is_displayed()
    assert api.alice.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    assert "cancelled" in browser.text("#events-table")
    assert browser.console_errors() == []
