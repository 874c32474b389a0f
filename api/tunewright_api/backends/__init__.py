"""Where jobs run. A backend owns everything that depends on it: the pools it offers, how a job is planned
there, what a run needs before it is queued, starting, cancelling and watching runs, and their logs.
Routes and services know only this interface: `local` (this machine) and `kubernetes` (FineTuneJob
resources the operator runs) implement it.

Checkpoints, metrics and the final result reach the API as telemetry records from the runtime, whatever
the backend; the local backend also reads back, from the run's `metrics.jsonl`, records that never reached
the API (it was down as the run ended).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy.engine import Engine
from sqlmodel import Session

from tunewright_api.models import Job, StoredFile
from tunewright_api.settings import Settings
from tunewright_core.planner.hardware import Pool
from tunewright_core.planner.models import ModelProfile
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan

log = logging.getLogger(__name__)


class Ticker:
    """A backend's background work: `work` every `seconds` on a daemon thread until stopped (first at once,
    or after one period); one failing round is logged, and the next one runs all the same."""

    def __init__(self, name: str, work: Callable[[], None], seconds: float, *, at_once: bool):
        self.name, self.work, self.seconds, self.at_once = name, work, seconds, at_once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        if self.at_once:
            self._round()
        while not self._stop.wait(self.seconds):
            self._round()

    def _round(self) -> None:
        try:
            self.work()
        except Exception:  # keep going whatever one round met (a job's trouble, an unreachable API server)
            log.exception("%s: a round failed", self.name)


class AlreadyFinished(Exception):
    """The job ended before the request could act on it (e.g. a cancel racing the run's own end)."""


@dataclass(frozen=True)
class Planned:
    """A job's plan of record and what it was made from, handed from `plan` to `submit` so that nothing is
    resolved twice."""

    plan: JobPlan
    profile: ModelProfile | None = None  # the model's shape, where it was profiled here
    pool: GPUPoolSpec | None = None  # the GPUPool planned on (the kubernetes backend)


class Backend(Protocol):
    # its runs read this machine's files, Hugging Face cache and network (a hub model missing here is refused)
    runs_here: bool

    def start(self) -> None:
        """Begin scheduling; reconcile jobs left running by an earlier API process."""

    def stop(self) -> None:
        """Stop scheduling (runs go on; a restarted API re-attaches)."""

    def pools(self) -> list[dict]:
        """The pools this backend offers by itself (shown by GET /v1/pools before the described ones)."""

    def pool(self, name: str) -> Pool | None:
        """One of this backend's pools as the planner models it, for dry-run plans (None: not a GPU pool
        this backend can describe)."""

    def plan(self, spec: FineTuneJobSpec, train: StoredFile) -> Planned:
        """How this job would run here; ApiError (422, naming the field) when it cannot."""

    def learn_links(self, session: Session, job: Job, transfer_seconds: float, at: float) -> str | None:
        """Fold a profiler window's measured transfer time into the pool the job was planned on, where that
        pool learns its links; what was learnt, for the job's events (None: nothing)."""

    def learn_efficiency(self, session: Session, job: Job, step_seconds: float, exposed_comm_seconds: float,
                         at: float) -> str | None:
        """Fold a profiler window's measured compute into the pool the job was planned on, where that pool
        learns; what was learnt, for the job's events (None: nothing)."""

    def submit(self, session: Session, job: Job, spec: FineTuneJobSpec, planned: Planned, train: StoredFile,
               validation: StoredFile | None, telemetry_token: str) -> None:
        """Everything the run needs (its runtime config, secrets, storage), in the job's transaction; the
        job is queued when the caller commits."""

    def cancel(self, session: Session, job: Job) -> None:
        """Stop a queued or running job and mark it cancelled (commits); AlreadyFinished if it has ended."""

    def logs(self, job: Job, lines: int) -> list[str]:
        """The last `lines` lines the run printed (empty before it starts)."""

    def forget(self, job: Job) -> None:
        """Remove what this backend keeps of a finished job, before its row is deleted (raising keeps the job)."""


def make_backend(settings: Settings, engine: Engine) -> Backend:
    if settings.backend == "kubernetes":
        from tunewright_api.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(settings, engine)
    from tunewright_api.backends.local import LocalBackend

    return LocalBackend(settings, engine)
