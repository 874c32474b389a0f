"""A run uses the Ray cluster it was given (RAY_ADDRESS) or one it starts itself, never one it finds.

Ray's own discovery (`address="auto"`) greps the host's processes for a GCS and joins it: on a shared
machine that is another checkout's cluster, whose workers run other code and lack the job's environment.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.jobs.conftest import python_path
from tunewright_jobs import run


class Recorder:
    def __init__(self, fail_with: Exception | None = None):
        self.calls, self.fail_with = [], fail_with

    def init(self, **kwargs):
        self.calls.append(kwargs)
        if self.fail_with:
            raise self.fail_with


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    recorder = Recorder()
    monkeypatch.setattr(ray, "init", recorder.init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    return recorder


def test_without_ray_address_a_run_starts_its_own_cluster(fake_ray, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run.connect_ray()
    (call,) = fake_ray.calls
    assert call["address"] == "local"  # "auto" or None would join a cluster found on the host
    assert Path(call["_temp_dir"]).name.startswith("tunewright-ray-")  # not the host-wide /tmp/ray


def test_the_ray_a_run_starts_has_a_token_of_its_own_unless_one_is_set(monkeypatch):
    first, second = run.own_ray_auth({}), run.own_ray_auth({})
    assert first["RAY_AUTH_MODE"] == "token" and first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"]
    assert run.own_ray_auth({"RAY_AUTH_TOKEN": "theirs"})["RAY_AUTH_TOKEN"] == "theirs"
    assert run.own_ray_auth({"RAY_AUTH_MODE": "disabled"})["RAY_AUTH_MODE"] == "disabled"  # said by its owner
    # set only where Ray is yet to be imported, for a run with Ray and no cluster given
    for no_ray, address, imported, secured in ((False, "", False, True), (True, "", False, False),
                                               (False, "10.0.0.1:6379", False, False), (False, "", True, False)):
        environ = {"RAY_ADDRESS": address}
        monkeypatch.setattr(os, "environ", environ)
        monkeypatch.setattr(sys, "modules", {**sys.modules, "ray": object()} if imported else
                            {k: v for k, v in sys.modules.items() if k != "ray"})
        run.secure_own_ray(no_ray)
        assert ("RAY_AUTH_TOKEN" in environ) == secured, (no_ray, address, imported)


@pytest.mark.slow  # starts a Ray
def test_only_the_run_can_join_the_ray_it_started():
    """Its GCS listens on every interface: a process without the run's token is refused, one with it joins."""
    probe = ("import os, subprocess, sys\n"
             "from tunewright_jobs.run import connect_ray, secure_own_ray\n"
             "secure_own_ray(no_ray=False)  # as the run's entry point does, before Ray is imported\n"
             "import ray\n"
             "connect_ray()\n"
             "address = ray.get_runtime_context().gcs_address\n"
             "join = f'import ray; ray.init(address={address!r}); print(\"joined\")'\n"
             "bare = {k: v for k, v in os.environ.items() if not k.startswith('RAY_AUTH_')}\n"
             "for name, env in (('without', bare), ('with', dict(os.environ))):\n"
             "    done = subprocess.run([sys.executable, '-c', join], env=env, capture_output=True, text=True,\n"
             "                          timeout=120)\n"
             "    print(name, 'joined' in done.stdout)\n"
             "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=400,
                         env={**env, "PYTHONPATH": python_path()})
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("with")] == ["without False", "with True"]


def test_a_given_cluster_is_used_and_not_replaced_when_unreachable(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    run.connect_ray()
    assert [c["address"] for c in fake_ray.calls] == ["10.0.0.1:6379"]
    fake_ray.calls.clear()
    fake_ray.fail_with = ConnectionError("unreachable")
    with pytest.raises(ConnectionError):
        run.connect_ray()
    assert [c["address"] for c in fake_ray.calls] == ["10.0.0.1:6379"]  # no fallback to another cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_run_does_not_join_a_cluster_running_on_the_host(tmp_path):
    """A real foreign cluster (`ray start --head`, as another checkout would run) is left alone."""
    port = free_port()
    foreign_dir = tempfile.mkdtemp(prefix="tw-foreign-ray-")
    ray_cli = Path(sys.executable).with_name("ray")
    foreign = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}", f"--temp-dir={foreign_dir}",
         "--include-dashboard=false", "--num-cpus=1", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 60
        while not any("--gcs-address=" in cmd and cmd.split("--gcs-address=")[1].split()[0].endswith(f":{port}")
                      for cmd in map(_cmdline, _pids())):  # Ray's own discovery looks for exactly this
            assert foreign.poll() is None, "the foreign Ray cluster did not start"
            assert time.monotonic() < deadline, "the foreign Ray cluster did not start in 60 s"
            time.sleep(0.5)
        probe = ("import ray; from tunewright_jobs.run import connect_ray; connect_ray(); "
                 "print('GCS', ray.get_runtime_context().gcs_address); ray.shutdown()")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180,
                             env={**env, "PYTHONPATH": python_path()})
        assert out.returncode == 0, out.stderr[-3000:]
        gcs = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("GCS "))
        assert not gcs.endswith(f":{port}"), f"the run joined the foreign cluster at {gcs}"
    finally:
        os.killpg(foreign.pid, signal.SIGTERM)
        foreign.wait(timeout=60)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
