"""What the training loop does around each step only when a run asks for it: the profiler's windows, the
garbage collector's freeze, an injected straggler. The `Trainer` calls each component at fixed points."""

from __future__ import annotations

import gc
import os
import time

from tunewright_jobs.commshare import CommProfiler
from tunewright_jobs.config import JobConfig
from tunewright_jobs.metrics import MetricsSink
from tunewright_jobs.parallel import Dist

SLOW_RANK_ENV = "TUNEWRIGHT_FAULT_SLOW_RANK"  # "RANK:SECONDS": that rank sleeps in every step


class Component:
    """Runs before and after each step, and once when the steps are over (they finished or one raised);
    a component overrides the points it needs."""

    def before_step(self, step: int) -> None:
        """Called after the step's rows are read, before its forward pass."""

    def after_step(self, step: int) -> None:
        """Called after the step's optimizer update, before its record is logged."""

    def close(self) -> None:
        """Called once after the last step, or as a step's exception leaves the loop."""


class Components:
    """Components nested in their order: the first one's `before_step` runs first and its `after_step` last,
    so that its span holds the others' (the profiler's window holds the injected delay and the GC freeze)."""

    def __init__(self, components: list[Component]):
        self.components = components

    def before_step(self, step: int) -> None:
        for component in self.components:
            component.before_step(step)

    def after_step(self, step: int) -> None:
        for component in reversed(self.components):
            component.after_step(step)

    def close(self) -> None:
        for component in reversed(self.components):
            component.close()


class ProfilerWindow(Component):
    """The communication profiler's windows (`metrics.profile`): a `comm` record as each one closes."""

    def __init__(self, profiler: CommProfiler, sink: MetricsSink):
        self.profiler, self.sink = profiler, sink

    def before_step(self, step: int) -> None:
        self.profiler.begin(step)

    def after_step(self, step: int) -> None:
        if (comm := self.profiler.end(step)) is not None:
            self.sink.emit(comm)


class GcFreeze(Component):
    """After the run's first step the model, the compiled blocks and everything imported are built: they are
    moved out of the collector's reach, so that its full collections stop walking millions of long-lived
    objects (single ~0.5 s steps of profiler-free GPT-2 runs may be those; benchmarks/profiler_overhead.py)."""

    def __init__(self, first_step: int):
        self.first_step = first_step

    def after_step(self, step: int) -> None:
        if step == self.first_step:
            gc.collect()
            gc.freeze()

    def close(self) -> None:
        gc.unfreeze()  # a run that raises leaves nothing frozen (in-process callers: tests, Ray workers)


class SlowRank(Component):
    """A synthetic straggler, for checking that the telemetry names it (tests, benchmarks/telemetry_check.py)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def before_step(self, step: int) -> None:
        time.sleep(self.seconds)


def injected_delay(rank: int) -> float:
    """The seconds `SLOW_RANK_ENV` has this rank sleep in every step (0: none)."""
    spec = os.environ.get(SLOW_RANK_ENV, "")
    if not spec:
        return 0.0
    slow_rank, _, seconds = spec.partition(":")
    return float(seconds) if int(slow_rank) == rank else 0.0


def step_components(cfg: JobConfig, dist: Dist, steps: int, start_step: int, sink: MetricsSink) -> Components:
    """The components a run of `steps` steps, starting at `start_step`, asks for."""
    chosen: list[Component] = []
    if cfg.metrics.profile.enabled:  # every rank: each window's shares are averaged across ranks
        chosen.append(ProfilerWindow(CommProfiler(cfg.metrics.profile, dist, steps, start_step), sink))
    if delay := injected_delay(dist.rank):
        chosen.append(SlowRank(delay))
    chosen.append(GcFreeze(first_step=start_step))
    return Components(chosen)
