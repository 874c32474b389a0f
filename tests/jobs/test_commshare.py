"""Communication share arithmetic: merged collective time, and the part of it no compute overlaps."""

import gzip
import json
from pathlib import Path

import pytest

from tunewright_jobs.commshare import (
    TraceEvent,
    comm_share,
    covered,
    merge,
    split_events,
    stragglers,
    uncovered,
)


@pytest.mark.parametrize(("intervals", "merged"), [
    ([], []),
    ([(0, 10)], [(0, 10)]),
    ([(5, 10), (0, 3)], [(0, 3), (5, 10)]),
    ([(0, 5), (3, 8), (8, 9)], [(0, 9)]),  # overlapping and touching
    ([(0, 10), (2, 4)], [(0, 10)]),  # nested
    ([(4, 4), (1, 2)], [(1, 2)]),  # empty intervals drop out
])
def test_merge(intervals, merged):
    assert merge(intervals) == merged


@pytest.mark.parametrize(("comm", "compute", "exposed"), [
    ([(0, 10)], [], 10),
    ([(0, 10)], [(0, 10)], 0),
    ([(0, 10)], [(2, 4), (6, 7)], 7),  # holes in the compute
    ([(0, 10)], [(-5, 3), (8, 20)], 5),  # compute sticking out on both sides
    ([(0, 4), (6, 10)], [(3, 7)], 6),  # one compute interval across two collectives
    ([(0, 4), (2, 6)], [(5, 6)], 5),  # overlapping collectives count once
    ([(10, 20)], [(0, 5), (25, 30)], 10),  # compute elsewhere
])
def test_exposed_time(comm, compute, exposed):
    assert uncovered(comm, compute) == exposed
    assert uncovered(comm, compute) <= covered(comm)


def test_shares_of_the_window():
    share = comm_share([(0, 300_000_000), (200_000_000, 400_000_000)], [(100_000_000, 300_000_000)], 1.0)
    assert (share.comm_seconds, share.exposed_seconds) == (pytest.approx(0.4), pytest.approx(0.2))
    assert (share.total, share.exposed) == (pytest.approx(0.4), pytest.approx(0.2))
    assert comm_share([], [], 0.0).total == 0.0


def test_cuda_traces_split_on_nccl_kernels():
    events = [TraceEvent("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 7, 0, 10),
              TraceEvent("ampere_bf16_s16816gemm_bf16_128x128", "kernel", 7, 5, 20),
              TraceEvent("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 7, 0, 30),
              TraceEvent("aten::mm", "cpu_op", 1, 0, 30)]
    assert split_events(events) == ([(0, 10)], [(5, 20)])


def test_cpu_traces_split_on_gloo_threads():
    events = [TraceEvent("gloo:all_reduce", "user_annotation", 2, 0, 10),
              TraceEvent("aten::mm", "cpu_op", 1, 5, 20),
              TraceEvent("aten::copy_", "cpu_op", 2, 1, 2),  # on gloo's thread: part of the collective
              TraceEvent("c10d::allreduce_", "cpu_op", 1, 0, 1)]
    assert split_events(events) == ([(0, 10)], [(5, 20)])


@pytest.mark.parametrize(("total", "every", "opened"), [
    (10, 4, [2, 6]),  # a window at 10 could not close
    (11, 4, [2, 6]),
    (12, 4, [2, 6, 10]),
    (10, 0, [2]),  # once
    (3, 4, []),  # the first window would end past the run
])
def test_windows_open_only_where_they_can_close(total, every, opened):
    from tunewright_jobs.commshare import CommProfiler, next_window_step
    from tunewright_jobs.config import ProfileConfig

    cfg = ProfileConfig(first_step=2, steps=2, every_steps=every)
    profiler, seen = CommProfiler(cfg, dist=None, total_steps=total), []
    for step in range(total):
        if profiler._opens_at(step):  # a window costing nothing: the next every_steps after it opened
            seen.append(step)
            profiler._next = next_window_step(step, step + 1, cfg, 0.0, 0.1)
    assert seen == opened


@pytest.mark.parametrize(("start", "every", "first"), [
    (0, 100, 2),
    (537, 100, 602),  # resumed: the grid's next step past its two recompiling steps
    (500, 100, 502),
    (501, 100, 602),
    (1, 100, 102),
    (537, 0, None),  # the once-only window lies before where it resumed
    (0, 0, 2),
])
def test_a_resumed_run_opens_its_first_window_on_the_grid_past_its_first_steps(start, every, first):
    from tunewright_jobs.commshare import first_window_step
    from tunewright_jobs.config import ProfileConfig

    assert first_window_step(ProfileConfig(first_step=2, steps=2, every_steps=every), start) == first


@pytest.mark.parametrize(("cost", "step_seconds", "expected"), [
    (None, None, 102),  # not measured: every_steps after it opened
    (0.0, 0.08, 102),
    (0.03, 0.08, 102),  # 30 ms over 98 steps of 80 ms: within 0.5%
    (0.1, 0.08, 254),  # 100 ms is 0.5% of 250 steps of 80 ms, counted from the step after it closed
    (0.5, 0.08, 1254),  # 0.5 s: 1250 steps of 80 ms after it closed
    (0.5, 2.0, 102),  # long steps: every_steps is the bound
])
def test_a_costly_window_puts_the_next_off_until_it_is_within_max_overhead(cost, step_seconds, expected):
    from tunewright_jobs.commshare import next_window_step
    from tunewright_jobs.config import ProfileConfig

    cfg = ProfileConfig(first_step=2, steps=2, every_steps=100, max_overhead=0.005)
    assert next_window_step(2, 3, cfg, cost, step_seconds) == expected
    assert next_window_step(2, 3, cfg.model_copy(update={"every_steps": 0}), cost, step_seconds) is None


RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "traces"


def recorded(name: str) -> list:
    from tunewright_jobs.commshare import chrome_trace_events

    with gzip.open(RECORDED / f"{name}--tunewright.json.gz", "rt") as fh:
        return chrome_trace_events(json.load(fh))


# Two profiled steps of each benchmark run on one H200 (benchmarks/vs_hf.py --trace). The matmul and
# attention shares are what benchmarks/trace_summary.py reads from the same files by summing durations; it
# counts copies by the DMA engines as busy too (97.5%, 95.1%, 90.2%), kernel_time only kernels.
@pytest.mark.parametrize(("name", "window_ms", "busy", "matmul", "attention"), [
    ("llama1b-full", 535.5, 0.962, 0.595, 0.149),
    ("llama1b-lora", 441.7, 0.936, 0.560, 0.170),
    ("gpt2-full", 274.3, 0.898, 0.628, 0.095),  # before the head was padded: alignment-1 GEMMs
])
def test_recorded_gpu_windows_break_down_by_kernel_kind(name, window_ms, busy, matmul, attention):
    from tunewright_jobs.commshare import kernel_time

    events = recorded(name)
    kernels = [e for e in events if e.kind == "kernel"]
    window = (max(e.end_ns for e in kernels) - min(e.start_ns for e in kernels)) / 1e9
    assert window * 1e3 == pytest.approx(window_ms, rel=0.01)
    got = kernel_time(events)
    assert got.busy_seconds / window == pytest.approx(busy, abs=0.01)
    assert got.matmul_seconds / window == pytest.approx(matmul, abs=0.01)
    assert got.attention_seconds / window == pytest.approx(attention, abs=0.01)
    assert got.matmul_seconds + got.attention_seconds + got.other_compute_seconds <= got.busy_seconds * 1.001
    comm, compute = split_events(events)
    assert comm == [] and comm_share(comm, compute, window).total == 0  # one GPU: no collectives


def test_a_cpu_trace_has_no_kernel_breakdown():
    from tunewright_jobs.commshare import kernel_time

    assert kernel_time([TraceEvent("aten::mm", "cpu_op", 1, 0, 10)]) is None


@pytest.mark.parametrize(("step", "exposed", "slowest", "own", "wait"), [
    # balanced ranks: nobody waits, all exposed communication is transfer
    ([1.0, 1.0], [0.2, 0.2], 0, [0.8, 0.8], [0.0, 0.0]),
    # rank 1 sleeps 0.3 s: rank 0 waits for it (0.3 of its 0.35 exposed), rank 1 only transfers
    ([1.0, 1.0], [0.35, 0.05], 1, [0.65, 0.95], [0.3, 0.0]),
    # waiting can never exceed the exposed communication it hides in
    ([1.0, 1.0, 1.0], [0.1, 0.5, 0.0], 2, [0.9, 0.5, 1.0], [0.1, 0.5, 0.0]),
])
def test_stragglers_are_the_ranks_the_others_wait_for(step, exposed, slowest, own, wait):
    found = stragglers(step, exposed)
    assert found.slowest_rank == slowest
    assert found.own_seconds == pytest.approx(own)
    assert found.wait_seconds == pytest.approx(wait)
    assert found.mean_wait_seconds == pytest.approx(sum(wait) / len(wait))
