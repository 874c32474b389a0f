"""The local backend's launch path with the API killed before and after each of its writes (each database
commit, and the spawn of the run): after a restart the job has exactly one run, and cancel stops every
process of it. The runtime is played by a small script: it records each start, and starts a worker of its own."""

import contextlib
import sys
import time
from pathlib import Path

import pytest
from sqlmodel import Session, select

from tunewright_api.auth import hash_token, issue_token
from tunewright_api.backends import local
from tunewright_api.db import make_engine, migrate
from tunewright_api.models import Job, JobEvent
from tunewright_api.settings import Settings

FAKE_RUNTIME = """
import json, os, pathlib, subprocess, sys, time
run_dir = pathlib.Path(sys.argv[1])
with open(run_dir / "runs", "a") as out:
    out.write(f"{os.getpid()}\\n")
worker = subprocess.Popen(["sleep", "300"])  # in the run's process group, as a training worker is
(run_dir / f"worker.{os.getpid()}").write_text(str(worker.pid))
while not (run_dir / "finish").exists():
    time.sleep(0.05)
worker.kill()
(run_dir / "output").mkdir(exist_ok=True)
step = {"event": "step", "epoch": 0, "loss": 1.0, "learning_rate": 1e-3, "grad_norm": 1.0, "tokens": 100,
        "tokens_per_second": 1e3, "step_seconds": 0.1, "data_seconds": 0.0, "forward_backward_seconds": 0.08,
        "optimizer_seconds": 0.02}
records = [{"event": "start", "step": 0, "total_steps": 2}, {**step, "step": 1}, {**step, "step": 2},
           {"event": "end", "step": 2, "final_loss": 1.0}]
(run_dir / "output" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in records))
(run_dir / "output" / "result.json").write_text('{"final_loss": 1.0}')
"""


class ApiDied(BaseException):
    """The API process ends here: nothing after it runs, no handler sees it (hence not an Exception)."""


class Writes:
    """Counts the backend's writes; the API dies just before or just after the `crash_at`-th one."""

    def __init__(self, crash_at: int | None = None, after: bool = False):
        self.count, self.crash_at, self.after = 0, crash_at, after

    def write(self, do):
        self.count += 1
        if self.count == self.crash_at and not self.after:
            raise ApiDied
        done = do()
        if self.count == self.crash_at and self.after:
            raise ApiDied
        return done


def crashing(writes: Writes) -> type[Session]:
    class CrashingSession(Session):
        def commit(self):
            writes.write(super().commit)

    return CrashingSession


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended (its parent just has not read its status yet)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A database holding one queued job, its run folder, and a backend's settings; the spawned launchers."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    settings = Settings(data_dir=tmp_path / "data", admin_token="admin", local_ray=False)
    run_dir = tmp_path / "data" / "jobs" / "ftjob-one"
    run_dir.mkdir(parents=True)
    (run_dir / "job.json").write_text("{}")
    (run_dir / "telemetry.token").write_text("t")
    with Session(engine) as session:
        tenant_id = issue_token(session, "alice")[0].id
        session.add(Job(id="ftjob-one", tenant_id=tenant_id, model="m", spec={}, status="queued",
                        telemetry_token_hash=hash_token("t"), config={"strategy": {"num_workers": 1}, "output_dir": str(run_dir / "output")},
                        run_dir=str(run_dir)))
        session.commit()
    monkeypatch.setattr(local, "runtime_command",
                        lambda config_path, workers, local_ray: [sys.executable, "-c", FAKE_RUNTIME,
                                                                 str(config_path.parent)])
    spawned = []
    real_start_run = local.start_run

    def recorded(*args):
        spawned.append(proc := real_start_run(*args))
        return proc

    monkeypatch.setattr(local, "start_run", recorded)
    yield engine, settings, run_dir, spawned
    (run_dir / "finish").touch()
    for proc in spawned:
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
    engine.dispose()


def runs_of(run_dir: Path) -> list[int]:
    runs = run_dir / "runs"
    return [int(line) for line in runs.read_text().split()] if runs.exists() else []


def job_now(engine) -> Job:
    with Session(engine) as session:
        return session.get(Job, "ftjob-one")


def settled(engine, run_dir: Path, spawned: list, backend: local.LocalBackend, timeout: float = 15) -> Job:
    """Ticks until every launch has run or given up and the job follows a run."""
    deadline = time.monotonic() + timeout
    while True:
        backend.tick()
        job = job_now(engine)
        if (job.pid is not None and runs_of(run_dir)
                and all(p.poll() is not None or p.pid == job.pid for p in spawned)):
            return job
        assert time.monotonic() < deadline, (job.status, job.pid, runs_of(run_dir))
        time.sleep(0.1)


def writes_of_a_launch(world) -> int:
    engine, settings, run_dir, spawned = world
    writes = Writes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local, "Session", crashing(writes))
        patch.setattr(local, "start_run", lambda *args, real=local.start_run: writes.write(lambda: real(*args)))
        local.LocalBackend(settings, engine).tick()
    return writes.count


def test_a_launch_writes_its_intent_then_spawns_then_records_the_process(world):
    assert writes_of_a_launch(world) == 3  # the sweep below covers each of these
    engine, settings, run_dir, spawned = world
    (pid,) = [p.pid for p in spawned]
    assert job_now(engine).pid == pid and job_now(engine).status == "running"


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_an_api_killed_at_any_write_of_a_launch_leaves_exactly_one_run(world, crash_at, after):
    engine, settings, run_dir, spawned = world
    writes = Writes(crash_at, after)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local, "Session", crashing(writes))
        patch.setattr(local, "start_run", lambda *args, real=local.start_run: writes.write(lambda: real(*args)))
        with pytest.raises(ApiDied):
            local.LocalBackend(settings, engine).tick()
    restarted = local.LocalBackend(settings, engine)
    restarted.reconcile()
    job = settled(engine, run_dir, spawned, restarted)
    (run,) = runs_of(run_dir)  # one start, however many launches were tried
    assert job.status == "running" and job.pid == run
    worker = int((run_dir / f"worker.{run}").read_text())
    assert running(run) and running(worker)

    with Session(engine) as session:
        restarted.cancel(session, session.get(Job, "ftjob-one"))
    deadline = time.monotonic() + 5
    while (running(run) or running(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(run) and not running(worker)  # the whole process group, not only its leader
    assert job_now(engine).status == "cancelled"
    assert runs_of(run_dir) == [run]


def test_a_run_that_ended_while_the_api_was_down_is_settled_from_its_files_not_run_again(world):
    """Nor does it lose what it measured: the records it wrote, which never reached the API, are read back."""
    engine, settings, run_dir, spawned = world
    local.LocalBackend(settings, engine).tick()  # launched; then the API dies
    (run,) = [p.pid for p in spawned]
    while not runs_of(run_dir):
        time.sleep(0.05)
    (run_dir / "finish").touch()
    spawned[0].wait(timeout=10)
    restarted = local.LocalBackend(settings, engine)
    restarted.reconcile()
    restarted.tick()
    job = job_now(engine)
    assert job.status == "succeeded" and runs_of(run_dir) == [run]
    assert (job.step, job.total_steps, job.trained_tokens) == (2, 2, 200) and job.result["result_files"]
    with Session(engine) as session:
        events = [e.message for e in session.exec(select(JobEvent).where(JobEvent.job_id == "ftjob-one"))]
    assert "succeeded" in events
