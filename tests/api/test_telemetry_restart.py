"""A run's last records survive an API restart near its end: the API is stopped mid-run and comes back only
after the run has emitted its end (later than the runtime used to keep trying); the job's final step, its
tokens and its results file all arrive."""

import json
import time

import pytest

from tests.api.conftest import TRAIN, Server, tiny_spec, upload, wait_for

API_BACK_AFTER_THE_END_SECONDS = 11  # past the 10 s the runtime's sink used to try at its close


def records_of(metrics) -> list[dict]:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


@pytest.mark.slow  # trains a job, and the API stays down for a while
def test_an_api_restarted_near_the_end_of_a_run_gets_its_last_step_tokens_and_result(tmp_path, tiny_models):
    data = tmp_path / "data"
    with Server(data, local_ray=False) as first:
        alice = first.tenant("alice")
        token = alice.headers["Authorization"].removeprefix("Bearer ")
        train = upload(alice, TRAIN).json()["id"]
        job_id = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=150)).json()["id"]
        metrics = data / "jobs" / job_id / "output" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not any(r["event"] == "step" for r in records_of(metrics)):  # training: now the API goes down
            assert time.monotonic() < deadline, "the run never trained a step"
            time.sleep(0.2)
    deadline = time.monotonic() + 240
    while not any(r["event"] == "end" for r in records_of(metrics)):
        assert time.monotonic() < deadline, "the run never ended"
        time.sleep(0.2)
    time.sleep(API_BACK_AFTER_THE_END_SECONDS)
    with Server(data, port=first.port, local_ray=False) as second, second.client(token) as alice:
        job = wait_for(alice, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        steps = [r for r in records_of(metrics) if r["event"] == "step"]
        assert job["status"] == "succeeded", job
        assert job["progress"]["step"] == job["progress"]["totalSteps"] == 150
        assert job["progress"]["trainedTokens"] == sum(r["tokens"] for r in steps)
        (results,) = job["result"]["resultFiles"]
        rows = alice.get(f"/v1/files/{results}/content").text.splitlines()
        assert rows[-1].startswith("150,")  # the results file reaches the last step
