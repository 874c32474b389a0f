"""Measured communication share: how much of a step each rank spends in collectives, and how much of that
is not hidden behind compute.

Definition (docs/architecture.md, "Telemetry definitions"): per rank, the merged time of collective kernels / step time (total),
and the part of it not overlapped by compute / step time (exposed). Measured with the PyTorch profiler
over a short window of steps, every `metrics.profile.every_steps`:
- on CUDA, collectives are NCCL kernels and compute is every other kernel (copies and memsets are DMA,
  neither);
- on CPU (gloo), collectives are gloo's operations, which run on gloo's own threads, and compute is the
  aten operations of the other threads.
The interval arithmetic below is pure; `CommProfiler` is the thin shell around the profiler.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from tunewright_core.records import CommRecord
from tunewright_jobs.config import ProfileConfig

log = logging.getLogger(__name__)

Interval = tuple[int, int]  # (start_ns, end_ns)


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals, as sorted disjoint intervals."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in merge(intervals))


def uncovered(intervals: list[Interval], cover: list[Interval]) -> int:
    """Time inside `intervals` that no interval of `cover` overlaps: |intervals ∪ cover| - |cover|."""
    return covered(intervals + cover) - covered(cover)


@dataclass(frozen=True)
class CommShare:
    comm_seconds: float  # merged collective time in the window
    exposed_seconds: float  # of which not overlapped by compute
    window_seconds: float

    @property
    def total(self) -> float:
        return min(1.0, self.comm_seconds / self.window_seconds) if self.window_seconds > 0 else 0.0

    @property
    def exposed(self) -> float:
        return min(1.0, self.exposed_seconds / self.window_seconds) if self.window_seconds > 0 else 0.0


def comm_share(comm: list[Interval], compute: list[Interval], window_seconds: float) -> CommShare:
    return CommShare(covered(comm) / 1e9, uncovered(comm, compute) / 1e9, window_seconds)


@dataclass(frozen=True)
class TraceEvent:
    name: str
    kind: str  # "kernel" (on the accelerator), "cpu_op" or other profiler activity types
    thread: int
    start_ns: int
    end_ns: int


def split_events(events: list[TraceEvent]) -> tuple[list[Interval], list[Interval]]:
    """(collective intervals, compute intervals) of one rank's trace."""
    kernels = [e for e in events if e.kind == "kernel"]
    if kernels:
        comm = [(e.start_ns, e.end_ns) for e in kernels if "nccl" in e.name.lower()]
        compute = [(e.start_ns, e.end_ns) for e in kernels if "nccl" not in e.name.lower()]
        return comm, compute
    comm_events = [e for e in events if e.name.startswith("gloo:")]
    comm_threads = {e.thread for e in comm_events}
    compute = [(e.start_ns, e.end_ns) for e in events
               if e.name.startswith("aten::") and e.thread not in comm_threads]
    return [(e.start_ns, e.end_ns) for e in comm_events], compute


# What a GPU kernel is, by its name (first match wins): where a window's time went. The planner's matmul
# time covers the matrix products and attention; the rest of the compute is its memory-bound time.
KERNEL_KINDS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|nvjet|wgmma|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    # compiled kernels before copies: their names list the fused operators (`_to_copy`, `cat`)
    ("compiled (triton)", re.compile(r"^triton_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat_|chunk_cat|split_with_sizes", re.I)),
)
OTHER_KERNELS = "other elementwise/reduction"


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), OTHER_KERNELS)


@dataclass(frozen=True)
class KernelTime:
    """One rank's window on the GPU, merged per kind (seconds): matrix products, attention, the rest of the
    compute, and the share of the window any kernel ran (the rest the GPU idled: launches, the host)."""

    matmul_seconds: float
    attention_seconds: float
    other_compute_seconds: float
    busy_seconds: float


def kernel_time(events: list[TraceEvent]) -> KernelTime | None:
    """None where the trace holds no GPU kernels (the CPU)."""
    kernels = [e for e in events if e.kind == "kernel"]
    if not kernels:
        return None
    by_kind: dict[str, list[Interval]] = {}
    for e in kernels:
        by_kind.setdefault(kernel_kind(e.name), []).append((e.start_ns, e.end_ns))
    matmul, attention = by_kind.pop("matmul", []), by_kind.pop("attention", [])
    by_kind.pop("communication", None)
    other = [interval for intervals in by_kind.values() for interval in intervals]
    return KernelTime(covered(matmul) / 1e9, covered(attention) / 1e9, covered(other) / 1e9,
                      covered([(e.start_ns, e.end_ns) for e in kernels]) / 1e9)


@dataclass(frozen=True)
class Stragglers:
    """Who the others wait for, from each rank's step time and its exposed communication (seconds per step).

    A rank's own time is its step time less its exposed communication: what it spent computing, launching
    and on the host. The rank with the most is the slowest; every other rank's collectives wait for it, so
    a rank's waiting is the slowest's own time less its own (never more than its exposed communication),
    and the rest of the collective time is transfer. An estimate by construction (a collective that waits
    while compute runs beside it is hidden, and counted as neither), exact for a rank that sleeps.
    """

    own_seconds: list[float]  # per rank
    wait_seconds: list[float]  # per rank

    @property
    def slowest_rank(self) -> int:
        return max(range(len(self.own_seconds)), key=self.own_seconds.__getitem__)

    @property
    def mean_wait_seconds(self) -> float:
        return sum(self.wait_seconds) / len(self.wait_seconds)


def stragglers(step_seconds: list[float], exposed_seconds: list[float]) -> Stragglers:
    own = [max(0.0, step - exposed) for step, exposed in zip(step_seconds, exposed_seconds, strict=True)]
    slowest = max(own)
    return Stragglers(own, [min(exposed, slowest - mine) for mine, exposed in zip(own, exposed_seconds, strict=True)])


def _kind(event) -> str:
    """Kernel or not, from what every supported torch exposes (2.11 has no `activity_type`)."""
    if event.device_type() == torch.autograd.DeviceType.CPU:
        return "cpu_op"
    if event.name().startswith(("Memcpy", "Memset")):
        return "gpu_memcpy"
    is_annotation = getattr(event, "is_user_annotation", None)
    if is_annotation is not None and is_annotation():  # record_function ranges drawn on the GPU timeline
        return "gpu_user_annotation"
    return "kernel"


def chrome_trace_events(trace: dict) -> list[TraceEvent]:
    """The events of a trace the profiler exported (`metrics.profile.trace_dir`), as the live profiler gives
    them: recorded windows are analysed by the same arithmetic, offline."""
    kinds = {"kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "gpu_memset": "gpu_memcpy", "cpu_op": "cpu_op",
             "gpu_user_annotation": "gpu_user_annotation"}
    return [TraceEvent(e["name"], kinds[e["cat"]], e.get("tid", 0), int(e["ts"] * 1000), int((e["ts"] + e["dur"]) * 1000))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in kinds]


def _trace_events(prof) -> list[TraceEvent]:
    return [TraceEvent(e.name(), _kind(e), e.start_thread_id(), e.start_ns(), e.end_ns())
            for e in prof.profiler.kineto_results.events()]


def first_window_step(cfg: ProfileConfig, start_step: int) -> int | None:
    """Where a run starting at `start_step` (0, or where it resumed) opens its first window: `first_step`,
    or for a resumed run the first step of the `every_steps` grid two steps past the resumed one (its
    first steps recompile); None for a run resumed past a window it takes once."""
    if start_step == 0 or cfg.first_step >= start_step + 2:
        return cfg.first_step
    if cfg.every_steps == 0:
        return None
    return cfg.first_step + math.ceil((start_step + 2 - cfg.first_step) / cfg.every_steps) * cfg.every_steps


def next_window_step(opened: int, closed: int, cfg: ProfileConfig, cost_seconds: float | None,
                     step_seconds: float | None) -> int | None:
    """The step the next window opens at, after one that profiled steps `opened` to `closed`: `every_steps`
    after it opened, or later where its cost (the seconds it added to the run) would otherwise exceed
    `max_overhead` of the training time until then. None: no further window."""
    if cfg.every_steps == 0:
        return None
    spaced = math.ceil(cost_seconds / (cfg.max_overhead * step_seconds)) if cost_seconds and step_seconds else 0
    return max(opened + cfg.every_steps, closed + 1 + spaced)


class CommProfiler:
    """Profiles `cfg.steps` steps starting at `first_step`, then every `every_steps` (0: once), spaced further
    apart where a window costs more than `max_overhead` of the steps between windows.

    Call `begin(step)` before a step and `end(step)` after it; `end` returns the ranks' shares as a `comm`
    record when a window closes (every rank must call it: the shares are averaged across ranks), else None.
    A window opens only where it can close before `total_steps`. The steps between windows are timed here
    (from one `begin` to the next), so a window's cost is its wall time, its analysis included, less what
    its steps take unprofiled.
    """

    def __init__(self, cfg: ProfileConfig, dist, total_steps: int, start_step: int = 0):
        self.cfg, self.dist, self.total_steps = cfg, dist, total_steps
        self._prof = None
        self._window_start = self._cost_start = 0.0
        self._next = first_window_step(cfg, start_step)
        self._last_begin: float | None = None
        self._begun = 0
        self._periods: deque[float] = deque(maxlen=20)  # seconds per unprofiled step, the latest

    def _opens_at(self, step: int) -> bool:
        return (self.cfg.enabled and self._next is not None and step >= self._next
                and step + self.cfg.steps <= self.total_steps)

    MIN_PERIODS = 3  # unprofiled steps timed before a window's cost is said

    def begin(self, step: int) -> None:
        now = time.perf_counter()
        if self._last_begin is not None and self._begun > 1:  # the step before: unprofiled, not the first
            self._periods.append(now - self._last_begin)  # (compilation), and no window's analysis in it
        self._last_begin, self._begun = now, self._begun + 1
        if self._prof is not None or not self._opens_at(step):
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.dist.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities)
        self._sync()
        self._cost_start = time.perf_counter()  # starting the profiler is part of what a window costs
        self._prof.start()
        self._opened, self._window_start = step, time.perf_counter()

    def end(self, step: int) -> CommRecord | None:
        if self._prof is None:
            return None
        self._last_begin = None  # a profiled step's time is not an unprofiled step's
        if step + 1 - self._opened < self.cfg.steps:
            return None
        self._sync()
        window = time.perf_counter() - self._window_start
        prof, self._prof = self._prof, None
        try:
            prof.stop()
            events = _trace_events(prof)
            share, kernels = comm_share(*split_events(events), window), kernel_time(events)
            if self.cfg.trace_dir:  # the whole window, for offline analysis (Holistic Trace Analysis, Perfetto)
                Path(self.cfg.trace_dir).mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(Path(self.cfg.trace_dir) / f"rank{self.dist.rank}-step{step + 1}.json.gz"))
        except Exception:  # a profiler that cannot trace here costs the measurement, never the run
            log.warning("communication share not measured at step %d", step + 1, exc_info=True)
            share = None
        steps = step + 1 - self._opened
        usual = statistics.median(self._periods) if len(self._periods) >= self.MIN_PERIODS else 0.0
        cost = max(0.0, time.perf_counter() - self._cost_start - steps * usual) if usual else -1.0
        # every rank takes part in the reductions below, so that one rank's failure cannot hang the others;
        # every rank schedules the next window from the same figures (the costliest rank's; -1: not timed)
        failed, cost, usual = self.dist.all_reduce_max([1.0 if share is None else 0.0, cost, usual])
        cost = cost if cost >= 0 else None
        self._next = next_window_step(self._opened, step, self.cfg, cost, usual or None)
        if failed:
            return None
        n = self.dist.world_size
        # every rank has kernels or none does (one device type): the same reductions run everywhere
        gpu = [kernels.matmul_seconds, kernels.attention_seconds, kernels.other_compute_seconds,
               kernels.busy_seconds / window] if kernels else [0.0] * 4
        means = [v / n for v in self.dist.all_reduce_sum(
            [share.total, share.exposed, share.comm_seconds / steps, share.exposed_seconds / steps,
             *(v / steps for v in gpu[:3]), gpu[3]])]
        ranks = self._per_rank([share.total, share.exposed, window / steps, share.exposed_seconds / steps])
        peaks = [max(r[0] for r in ranks), max(r[1] for r in ranks)]
        late = stragglers([r[2] for r in ranks], [r[3] for r in ranks])
        own = sorted(late.own_seconds)
        return CommRecord(step=step + 1, profiled_steps=steps, profiled_step_seconds=window / steps,
                          comm_share=means[0], comm_share_exposed=means[1],
                          comm_seconds_per_step=means[2], exposed_comm_seconds_per_step=means[3],
                          comm_share_max_rank=peaks[0], comm_share_exposed_max_rank=peaks[1],
                          wait_seconds_per_step=min(means[2], late.mean_wait_seconds),
                          transfer_seconds_per_step=max(0.0, means[2] - late.mean_wait_seconds),
                          rank_own_seconds_min=own[0], rank_own_seconds_median=own[len(own) // 2],
                          rank_own_seconds_max=own[-1], slowest_rank=late.slowest_rank,
                          window_cost_seconds=cost, next_window_step=self._next,
                          **({"matmul_seconds_per_step": means[4], "attention_seconds_per_step": means[5],
                              "other_compute_seconds_per_step": means[6], "gpu_busy_share": min(1.0, means[7])}
                             if kernels else {}))

    def _per_rank(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, in rank order (an all-gather made of one sum: each rank fills its own row)."""
        n, width = self.dist.world_size, len(values)
        rows = [0.0] * (n * width)
        rows[self.dist.rank * width:(self.dist.rank + 1) * width] = values
        summed = self.dist.all_reduce_sum(rows)
        return [summed[r * width:(r + 1) * width] for r in range(n)]

    def _sync(self) -> None:
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
