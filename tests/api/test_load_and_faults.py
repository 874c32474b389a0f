"""A bounded load-and-fault suite on loopback (issue 15, "beyond the list"): concurrent uploads, submissions
and reads with zero 5xx (latency figures printed), the cancel race hammered, a training process killed
(the job fails with its reason and log tail, and takes no late telemetry), and no secret anywhere a job, a
log or an error body could show it."""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import TRAIN, Server, tiny_spec, upload, wait_for
from tunewright_api.main import WithoutQueryStrings

pytestmark = pytest.mark.slow


def timed(fn):
    started = time.monotonic()
    response = fn()
    return response.status_code, time.monotonic() - started


def figures(name: str, results: list[tuple[int, float]]) -> str:
    latencies = sorted(t for _, t in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return (f"{name}: {len(results)} requests, {sum(1 for s, _ in results if s >= 500)} 5xx, "
            f"p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")


def test_concurrent_uploads_submissions_and_reads_give_no_5xx(tmp_path, database_url, tiny_models):
    """30 uploads, 30 submissions and 60 reads at once (the queue held: this measures the API, not training)."""
    with Server(tmp_path / "data", local_ray=False, database_url=database_url, max_running_jobs=0) as api:
        tenants = [api.tenant(f"t{i}") for i in range(3)]
        files = {id(t): upload(t, TRAIN).json()["id"] for t in tenants}

        def upload_one(i):
            return timed(lambda: upload(tenants[i % 3], TRAIN))

        def submit_one(i):
            client = tenants[i % 3]
            return timed(lambda: client.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], files[id(client)])))

        def read_one(i):
            return timed(lambda: tenants[i % 3].get("/v1/jobs"))

        with ThreadPoolExecutor(30) as pool:
            uploads = pool.map(upload_one, range(30))
            submissions = pool.map(submit_one, range(30))
            reads = pool.map(read_one, range(60))
            uploads, submissions, reads = list(uploads), list(submissions), list(reads)
        report = [figures("uploads", uploads), figures("submissions", submissions), figures("reads", reads)]
        print("\n" + "\n".join(report))
        for name, results, ok in (("uploads", uploads, 200), ("submissions", submissions, 201), ("reads", reads, 200)):
            assert [s for s, _ in results] == [ok] * len(results), f"{name}: {[s for s, _ in results]}"
        assert sum(len(t.get("/v1/jobs").json()["data"]) for t in tenants) == 30


def test_the_cancel_race_hammered(tmp_path, tiny_models):
    """Six jobs queued behind one slot, all cancelled at once while the scheduler starts them: every one ends
    cancelled and no training process is left."""
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=1) as api:
        alice = api.tenant("alice")
        train = upload(alice, TRAIN).json()["id"]
        jobs = [alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
                for _ in range(6)]
        wait_for(alice, jobs[0], {"running"})
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda job: alice.post(f"/v1/jobs/{job}/cancel").status_code, jobs))
        assert answers == [200] * 6
        time.sleep(2)  # a few scheduler ticks: nothing may start after its cancel
        assert {alice.get(f"/v1/jobs/{job}").json()["status"] for job in jobs} == {"cancelled"}
        assert training_processes(api.settings.data_dir) == []


def training_processes(data_dir: Path) -> list[int]:
    jobs_root = str((data_dir / "jobs").resolve())
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and jobs_root in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_killed_training_process_fails_its_job_with_the_reason_and_takes_no_late_telemetry(tmp_path, tiny_models):
    with Server(tmp_path / "data", local_ray=False) as api:
        alice = api.tenant("alice")
        job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"],
                                                    maxSteps=100000)).json()
        wait_for(alice, job["id"], {"running"})
        wait_for_progress(alice, job["id"])
        run_dir = api.settings.data_dir / "jobs" / job["id"]
        pids = training_processes(api.settings.data_dir)
        os.killpg(os.getpgid(pids[0]), signal.SIGKILL)
        failed = wait_for(alice, job["id"], {"failed", "succeeded", "cancelled"}, timeout=60)
        assert failed["status"] == "failed"
        assert failed["error"]["message"] == "the run exited with code -9"  # one line; the log tail is an event
        tail = alice.get(f"/v1/jobs/{failed['id']}/events").json()["data"][0]["message"]
        assert tail.startswith("the run exited with code -9. Last log lines:")
        # torchrun's workers run in sessions of their own, out of the killed group's reach: they die with it
        deadline = time.monotonic() + 30
        while (left := training_processes(api.settings.data_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], f"training processes outlived their launcher: {left}"
        token = (run_dir / "telemetry.token").read_text().strip()
        late = httpx.post(f"{api.url}/v1/internal/jobs/{job['id']}/telemetry", headers={
            "Authorization": f"Bearer {token}"}, json={"records": []})
        assert late.status_code == 410


def wait_for_progress(client, job_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] < 1:
        assert time.monotonic() < deadline, "no step reported"
        time.sleep(0.5)


def test_no_secret_shows_in_a_jobs_processes_logs_or_error_bodies(tmp_path, tiny_models, caplog):
    """Canaries as the admin token and in the database URL: absent from every job process's environment and
    command line, the job's log, the API's log, and every error body a tenant can provoke."""
    canary = "tw-canary-" + os.urandom(8).hex()
    database = tmp_path / f"db-{canary}.sqlite"
    caplog.set_level(logging.DEBUG)
    with Server(tmp_path / "data", local_ray=False, admin_token=canary, database_url=f"sqlite:///{database}") as api:
        admin = api.client(canary)
        alice = api.client(admin.post("/v1/tokens", json={"tenant": "alice"}).json()["token"])
        job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"],
                                                    maxSteps=100000)).json()
        wait_for(alice, job["id"], {"running"})
        wait_for_progress(alice, job["id"])
        pids = training_processes(api.settings.data_dir)
        assert pids
        for pid in pids:
            for part in ("environ", "cmdline"):
                try:
                    assert canary.encode() not in Path(f"/proc/{pid}/{part}").read_bytes(), (pid, part)
                except FileNotFoundError:
                    continue
        bodies = [alice.get("/v1/jobs/ftjob-nope").text, alice.post("/v1/jobs", json={"bad": 1}).text,
                  alice.post("/v1/jobs", content=b"{not json").text, alice.get(f"/v1/jobs?token={canary}").text,
                  httpx.get(f"{api.url}/v1/jobs?token={canary}").text,
                  alice.get("/v1/files/file-x/content").text, alice.post("/v1/plans", json={}).text]
        alice.post(f"/v1/jobs/{job['id']}/cancel")
        run_log = (api.settings.data_dir / "jobs" / job["id"] / "run.log").read_text(errors="replace")
    assert all(canary not in body for body in bodies)
    assert canary not in run_log
    server_log = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))
    assert canary not in server_log  # (the test's own client logs the URLs it calls: not the server's)


def test_the_access_log_keeps_no_query_string():
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/jobs?token=tw-secret", "1.1", 401), None)
    assert WithoutQueryStrings().filter(record) and "tw-secret" not in record.getMessage()
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/jobs?… HTTP/1.1" 401'
