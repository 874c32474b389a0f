"""Where jobs run. `local` (this machine, processes on a local Ray) exists; `kubernetes` (FineTuneJob
resources for the operator) comes with the operator and implements the same interface."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from sqlmodel import Session

from tunewright_api.models import Job


class Backend(Protocol):
    def start(self) -> None:
        """Begin scheduling; reconcile jobs left running by an earlier API process."""

    def stop(self) -> None:
        """Stop scheduling (runs go on; a restarted API re-attaches)."""

    def run_dir(self, job: Job) -> Path:
        """Where a job's config, logs, checkpoints and output live."""

    def prepare(self, job: Job, telemetry_token: str) -> None:
        """At submission: everything the run needs, before it is queued."""

    def cancel(self, session: Session, job: Job) -> None:
        """Stop a queued or running job and mark it cancelled."""
