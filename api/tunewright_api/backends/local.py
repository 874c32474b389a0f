"""The local backend: each job is a separate process running the training runtime on a local Ray.

A queue admits at most `max_running_jobs` at once (each takes the machine's CPUs or GPUs). Cancel ends
the process group. When the API restarts, `reconcile` re-attaches to runs still alive and marks lost
ones failed, so no job stays "running" forever.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from tunewright_api.models import Job, JobEvent, now
from tunewright_api.settings import Settings
from tunewright_api.states import transition

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 20
# What a job's processes inherit from the API's environment: what Python, PyTorch, CUDA, NCCL and Hugging
# Face read, nothing else. The API's own secrets (admin token, database URL) and a Ray address it happens
# to have stay out: a job runs on the Ray cluster the backend gives it, or on one it starts.
INHERITED_VARIABLES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR", "PYTHONPATH",
                                 "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"})
INHERITED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "TRANSFORMERS_", "TORCH_", "OMP_", "MKL_")


def _alive(pid: int, run_dir: str) -> bool:
    """True when `pid` is still this job's runtime (pids are reused: check its command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return run_dir in cmdline


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def job_environment(api_environment: dict[str, str], telemetry_token: str, ray_address: str | None) -> dict[str, str]:
    """The environment of a job's processes (pure: the API's environment in, the job's out)."""
    env = {k: v for k, v in api_environment.items()
           if k in INHERITED_VARIABLES or k.startswith(INHERITED_PREFIXES)}
    env["TUNEWRIGHT_TELEMETRY_TOKEN"] = telemetry_token
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def add_event(session: Session, job: Job, message: str, level: str = "info", type_: str = "message",
              data: dict | None = None) -> None:
    session.add(JobEvent(job_id=job.id, message=message, level=level, type=type_, data=data))


class LocalBackend:
    def __init__(self, settings: Settings, engine: Engine, poll_seconds: float = 0.5):
        self.settings, self.engine, self.poll_seconds = settings, engine, poll_seconds
        self.jobs_root = (settings.data_dir / "jobs").resolve()
        self._children: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.reconcile()
        self._thread = threading.Thread(target=self._loop, name="tunewright-local-backend", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling; running jobs go on (a restarted API re-attaches to them)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.tick()
            except Exception:  # keep scheduling whatever one job did
                log.exception("local backend tick failed")

    # --- the work ------------------------------------------------------------------------------------
    def run_dir(self, job: Job) -> Path:
        return self.jobs_root / job.id

    def tick(self) -> None:
        with self._lock, Session(self.engine) as session:
            running = session.exec(select(Job).where(Job.status == "running")).all()
            for job in running:
                self._check(session, job)
            active = session.exec(select(Job).where(Job.status == "running")).all()
            free = self.settings.max_running_jobs - len(active)
            if free > 0:
                queued = session.exec(select(Job).where(Job.status == "queued").order_by(Job.created_at)).all()
                for job in queued[:free]:
                    self._launch(session, job)
            session.commit()

    def prepare(self, job: Job, telemetry_token: str) -> None:
        """At submission: the run folder, its config, and the per-job telemetry secret (owner-only file)."""
        run_dir = self.run_dir(job)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "job.json").write_text(json.dumps(job.config, indent=2))
        token_file = run_dir / "telemetry.token"
        token_file.touch(mode=0o600)
        token_file.write_text(telemetry_token)
        job.run_dir = str(run_dir)

    def _launch(self, session: Session, job: Job) -> None:
        run_dir = Path(job.run_dir)
        config_path = run_dir / "job.json"
        env = job_environment(dict(os.environ), (run_dir / "telemetry.token").read_text().strip(),
                              self.settings.ray_address)
        with (run_dir / "run.log").open("ab") as log_file:
            command = [sys.executable, "-m", "tunewright_jobs.run", "--config", str(config_path)]
            if not self.settings.local_ray:  # one plain process per worker, under torchrun
                workers = job.config["strategy"]["num_workers"]
                command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
                           *command[1:], "--no-ray"]
            proc = subprocess.Popen(command,
                                    stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    cwd=run_dir)
        self._children[job.id] = proc
        job.status = transition(job.status, "running")
        job.pid, job.started_at = proc.pid, now()
        add_event(session, job, f"started: process {proc.pid}, log {run_dir / 'run.log'}")
        session.add(job)

    def _check(self, session: Session, job: Job) -> None:
        proc = self._children.get(job.id)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return
            del self._children[job.id]
        elif job.pid and _alive(job.pid, job.run_dir):
            return  # re-attached after a restart: still going
        else:
            code = None  # not our child and gone: only its files can tell
        self._finish(session, job, code)

    def _finish(self, session: Session, job: Job, code: int | None) -> None:
        run_dir = Path(job.run_dir)
        result_file = run_dir / "output" / "result.json"
        if result_file.exists() and code in (0, None):
            job.result = json.loads(result_file.read_text())
            job.status = transition(job.status, "succeeded")
            add_event(session, job, "succeeded")
        else:
            reason = (f"the run exited with code {code}" if code is not None
                      else "the run's process is gone (the API restarted while it ran) and it left no result")
            job.status = transition(job.status, "failed")
            job.error_code, job.error_message = "run_failed", f"{reason}. Last log lines:\n{_tail(run_dir / 'run.log')}"
            add_event(session, job, job.error_message, level="error")
        job.finished_at, job.pid = now(), None
        session.add(job)

    def cancel(self, session: Session, job: Job) -> None:
        with self._lock:
            if job.status == "running" and job.pid:
                try:
                    os.killpg(job.pid, signal.SIGTERM)
                    deadline = time.monotonic() + 10
                    while _alive(job.pid, job.run_dir) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if _alive(job.pid, job.run_dir):
                        os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc = self._children.pop(job.id, None)
                if proc is not None:
                    proc.wait(timeout=10)
            job.status = transition(job.status, "cancelled")
            job.finished_at, job.pid = now(), None
            add_event(session, job, "cancelled by the user")
            session.add(job)
            session.commit()

    def reconcile(self) -> None:
        """After a restart: running jobs whose process lives on are watched again; the rest are settled."""
        with self._lock, Session(self.engine) as session:
            for job in session.exec(select(Job).where(Job.status == "running")).all():
                if job.pid and _alive(job.pid, job.run_dir):
                    add_event(session, job, f"re-attached to process {job.pid} after an API restart")
                else:
                    self._finish(session, job, None)
            session.commit()
