"""Metrics: one small sink interface, a JSONL file sink, and a step-phase timer.

Records are flat JSON objects with an `event` field ("start", "step", "eval", "end"). Only rank 0 emits.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Protocol

import torch


class MetricsSink(Protocol):
    def emit(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON line per record, flushed at once so a crash loses nothing already emitted.

    On resume the records past the restored step are dropped first: they belong to steps that will be
    trained again, and a step must appear once in the log.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._fh = self.path.open("a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def emit(self, record: dict) -> None:
        self._fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class NullSink:
    """What ranks other than 0 get."""

    def emit(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class PhaseTimer:
    """Times the device phases of each step without stalling the GPU: CUDA events are read only at log time.

    (Waiting for data is host work and is timed with the host clock by the caller.)
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._steps: list[list[tuple[str | None, object]]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_step(self) -> None:
        self._steps.append([(None, self._now())])

    def mark(self, phase: str) -> None:
        """End the phase named `phase` (it began at the previous mark)."""
        self._steps[-1].append((phase, self._now()))

    def collect(self) -> dict[str, float]:
        """Seconds per phase, summed over the steps since the last collect."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for marks in self._steps:
            for (_, start), (phase, end) in itertools.pairwise(marks):
                seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
                totals[phase] = totals.get(phase, 0.0) + seconds
        self._steps = []
        return totals
