"""Checkpoints: what goes in one, and the two stores that keep them (Ray Train's, or a directory).

One checkpoint = the trained parameters and the optimizer (sharded through torch.distributed.checkpoint,
trainable parameters only: for LoRA that is the adapter), the scheduler, every rank's RNG state, and
the trainer state (optimizer steps done; the data position follows from it). A checkpoint becomes
visible only once every file is written: Ray Train registers it after the upload, the directory store
renames a finished `.partial` folder, so a crash mid-write never leaves one a resume would pick up.
Both stores keep step N in `<storage>/<job name>/step_XXXXXXXX`; `CheckpointStore.location` says where, so
that nothing else needs to know the layout.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tunewright_jobs.parallel import Dist

STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAINER_STATE = "trainer_state.json"
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading trainable parameters only leaves the frozen ones "missing" for load_state_dict; a trainable one
# absent from the checkpoint still fails, inside dcp.load.
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def trainable_state(state: dict, what: str) -> dict:
    """`state` (this rank's trainable parameters), refused when it holds none: saving or restoring nothing
    would pass silently, and a resumed run would start from its first weights."""
    if not state:
        raise RuntimeError(f"{what}: the model has no trainable parameter (requires_grad is off on every weight), "
                           f"so there is nothing to {what.split()[0]}")
    return state


def write_checkpoint(path: Path, model, optimizer, scheduler, trainer_state: dict, dist: Dist) -> None:
    """Every rank calls this (the sharded save is collective); `path` may be per-rank (Ray) or shared."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    trainable_state(model_sd, f"save checkpoint {path.name}")
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path / "state"))
    torch.save(rng_state(), path / f"rng_rank{dist.rank:05d}.pt")
    if dist.is_main:
        torch.save(scheduler.state_dict(), path / "scheduler.pt")
        (path / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))


def read_checkpoint(path: Path, model, optimizer, scheduler, dist: Dist) -> dict:
    """Restore in place; returns the trainer state. Every rank calls this."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    state = {"model": trainable_state(model_sd, f"restore checkpoint {path.name}"), "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_LOAD_TRAINABLE)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng_file = path / f"rng_rank{dist.rank:05d}.pt"
    if not rng_file.exists():
        raise RuntimeError(f"checkpoint {path} was written by fewer ranks than {dist.world_size}: no {rng_file.name}")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / TRAINER_STATE).read_text())


class CheckpointStore(Protocol):
    def save(self, step: int, metrics: dict, write: Callable[[Path], None]) -> None:
        """Collective: every rank writes its part; returns once the checkpoint is complete in the store."""

    def latest(self) -> contextlib.AbstractContextManager[Path | None]: ...

    def location(self, step: int) -> str:
        """Where the committed checkpoint of `step` lives: a path, or a URI for remote storage."""


class DirectoryCheckpointStore:
    """Checkpoints in `<storage>/<job name>/step_XXXXXXXX` on a filesystem every rank sees (no Ray)."""

    def __init__(self, storage: str, name: str, keep_last: int, dist: Dist):
        if "://" in storage:
            raise ValueError(f"checkpoint.storage: {storage!r}: without Ray, storage must be a filesystem path")
        self.root = Path(storage).expanduser().resolve() / name
        self.keep_last, self.dist = keep_last, dist
        if dist.is_main:
            for stale in self.root.glob(".step_*.partial"):  # left by a crash mid-write
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    def _steps(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if STEP_DIR.match(p.name))

    def save(self, step: int, metrics: dict, write: Callable[[Path], None]) -> None:
        partial = self.root / f".step_{step:08d}.partial"
        if self.dist.is_main:
            partial.mkdir(parents=True)
        self.dist.barrier()
        write(partial)
        self.dist.barrier()
        if self.dist.is_main:
            final = self.root / step_dir_name(step)
            if final.exists():  # same step saved again (e.g. final save after a periodic one)
                shutil.rmtree(final)
            partial.rename(final)
            for old in self._steps()[: -self.keep_last]:
                shutil.rmtree(old)
        self.dist.barrier()

    @contextlib.contextmanager
    def latest(self) -> Iterator[Path | None]:
        steps = self._steps()
        yield steps[-1] if steps else None

    def location(self, step: int) -> str:
        return str(self.root / step_dir_name(step))


class RayCheckpointStore:
    """Checkpoints reported to Ray Train, which uploads each rank's files into one folder of the run's storage
    and restores the newest one when the run (same name and storage) starts again.

    `storage` and `name` are the run's `RunConfig(storage_path, name)`: Ray Train (v2) persists a checkpoint
    reported as `checkpoint_dir_name` in `<storage_path>/<name>/<checkpoint_dir_name>`.
    """

    def __init__(self, storage: str, name: str, dist: Dist):
        self.storage, self.name, self.dist = storage, name, dist

    def save(self, step: int, metrics: dict, write: Callable[[Path], None]) -> None:
        import ray.train

        with tempfile.TemporaryDirectory(prefix="tunewright-ckpt-") as tmp:
            write(Path(tmp))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=step_dir_name(step))
        # Each rank's report returns once its own files are uploaded: complete when every rank's are.
        self.dist.barrier()

    @contextlib.contextmanager
    def latest(self) -> Iterator[Path | None]:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield Path(path)

    def location(self, step: int) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}/{step_dir_name(step)}"
