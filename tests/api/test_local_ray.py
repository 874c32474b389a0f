"""The local backend's Ray: one of the server's own for its life (issue 37: a job no longer waits for a Ray of
its own to start). Started here and recorded in the data folder, adopted by a restarted API only while the
record's process is still ours, started again when it died, stopped with the API when no job runs."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.api.conftest import TRAIN, Server, tiny_spec, upload, wait_for
from tunewright_api.backends.local import ray_environment
from tunewright_api.backends.local_ray import STATE_FILE, ServerRay, alive, answers

pytestmark = pytest.mark.slow  # starts Ray heads


def test_a_head_is_started_recorded_adopted_and_stopped(tmp_path):
    first = ServerRay(tmp_path, 1, 0, ray_environment(dict(os.environ)))
    try:
        address = first.head().address
        head = json.loads((tmp_path / STATE_FILE).read_text())
        assert answers(address) and head["address"] == address and alive(head["pid"])
        assert first.head().address == address  # kept
        restarted = ServerRay(tmp_path, 1, 0, ray_environment(dict(os.environ)))  # a new API on the same folder
        assert restarted.head().address == address
        restarted.stop()
        deadline = time.monotonic() + 15
        while alive(head["pid"]) and time.monotonic() < deadline:
            first._proc and first._proc.poll()  # our child: reaped
            time.sleep(0.1)
        assert not alive(head["pid"]) and not (tmp_path / STATE_FILE).exists()
        assert not os.path.exists(head["temp_dir"]) and not answers(address)
    finally:
        first.stop()


def test_two_apis_on_one_folder_share_one_head(tmp_path):
    """`serve` and `tunewright train` beside it on one data folder ask for the head at once: one is started and
    both use it (before the folder's lock, each started its own and the first was never stopped)."""
    apis = [ServerRay(tmp_path, 1, 0, ray_environment(dict(os.environ))) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        heads = list(pool.map(lambda api: api.head(), apis))
    started = [api for api in apis if api._proc is not None]
    try:
        assert heads[0] == heads[1] and answers(heads[0].address)  # two heads would be two processes
        assert len(started) == 1
    finally:
        for api in started + apis:  # the one whose child it is first: it reaps it
            api.stop()
    assert not answers(heads[0].address) and not os.path.exists(heads[0].temp_dir)


def test_a_record_whose_process_is_not_ours_is_never_signalled(tmp_path):
    """A pid is reused after its process ends: the record's process is ours only if it names our session."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    ray = ServerRay(tmp_path, 1, 0, ray_environment(dict(os.environ)))
    try:
        (tmp_path / STATE_FILE).write_text(json.dumps({"pid": bystander.pid, "address": "127.0.0.1:1",
                                                       "temp_dir": str(tmp_path / "gone"), "token": "t"}))
        address = ray.head().address
        assert answers(address) and bystander.poll() is None
        assert json.loads((tmp_path / STATE_FILE).read_text())["pid"] != bystander.pid
    finally:
        ray.stop()
        bystander.kill()
        bystander.wait()


def test_jobs_join_the_servers_ray_and_it_stops_with_the_api(tmp_path, tiny_models):
    with Server(tmp_path / "data", local_ray=True, local_workers=1) as server:
        alice = server.tenant("alice")
        train = upload(alice, TRAIN).json()["id"]
        spec = tiny_spec(tiny_models["gpt2"], train, maxSteps=2)
        spec["checkpoint"] = {"everySteps": 2}
        jobs = [alice.post("/v1/jobs", json=spec).json() for _ in range(2)]
        done = [wait_for(alice, job["id"], {"succeeded", "failed"}) for job in jobs]
        logs = [(server.settings.data_dir / "jobs" / job["id"] / "run.log").read_text() for job in jobs]
        assert [job["status"] for job in done] == ["succeeded", "succeeded"], logs[0][-3000:]
        head = json.loads((server.settings.data_dir / STATE_FILE).read_text())
        assert all("starting a Ray cluster for this run alone" not in log for log in logs)
        assert all(head["address"] in log or "Connected to Ray cluster" in log for log in logs), logs[0][-2000:]
    assert not alive(head["pid"]) and not (server.settings.data_dir / STATE_FILE).exists()


def test_the_record_is_owner_only_and_a_foreign_folder_is_never_removed(tmp_path):
    """ray.json holds the head's token: written whole, mode 0600, even over a wider file. A record naming a
    folder this API does not make (hand-edited: "/") is not ours: nothing is signalled, nothing removed."""
    from tunewright_api.backends.local_ray import Head, is_ours

    state = tmp_path / STATE_FILE
    state.write_text("{}")
    state.chmod(0o644)
    ray = ServerRay(tmp_path, 1, 0, {})
    ray._record(Head(os.getpid(), "127.0.0.1:1", "/tmp/tw-ray-x", "secret"))
    assert state.stat().st_mode & 0o777 == 0o600 and json.loads(state.read_text())["token"] == "secret"
    assert not is_ours(Head(os.getpid(), "127.0.0.1:1", "/", "t"))
    assert not is_ours(Head(os.getpid(), "127.0.0.1:1", "/tmp/tw-ray-x", "t"))  # this process names no such folder
    state.write_text(json.dumps({"pid": os.getpid(), "address": "127.0.0.1:1", "temp_dir": str(tmp_path),
                                 "token": "t"}))
    ray.stop()  # a record not ours: dropped, this process unharmed, the folder kept
    assert not state.exists() and tmp_path.exists()
