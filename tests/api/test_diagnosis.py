"""The diagnosis, table-tested on recorded runs: H200 runs of the runtime (their step phases and profiler
windows, as committed in benchmarks/results), against the planner's predictions for the same layouts, and
the same runs with one thing made to go wrong."""

import gzip
import json
from pathlib import Path

import pytest

from tunewright_api.diagnosis import Observed, diagnose, measured_components, predicted_components
from tunewright_core.planner import calibration
from tunewright_core.planner.estimate import estimate
from tunewright_core.spec import JobPlan, Predicted, RejectedOption
from tunewright_fit.calibration_fit import measured_pool, run_setup
from tunewright_jobs.commshare import chrome_trace_events, comm_share, kernel_time, split_events

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# Recorded before issue 12's runtime, predicted with the calibration fitted on them (the table's cases are
# the diagnosis's arithmetic, not the planner's current constants)
RECORDED_CALIBRATION = RESULTS / "superseded" / "calibration_h200.json"
RUNS = {row["name"]: row for name in ("superseded/gpu_calibration_h200.json", "superseded/gpu_calibration-2gpu_h200.json")
        for row in json.loads((RESULTS / name).read_text())["runs"]}


def plan_for(row: dict, rejected: list[RejectedOption] = ()) -> JobPlan:
    """The planner's prediction for the run's layout on the measured H200s."""
    cal, gpu = calibration.load(RECORDED_CALIBRATION)
    w, layout = run_setup(row)
    e = estimate(w, layout, measured_pool(gpu, layout.gpus), cal)
    tokens_per_second = w.tokens_per_step / e.step_seconds
    predicted = Predicted(peak_memory_gib=e.peak_memory_bytes / 2**30, step_seconds=e.step_seconds,
                          matmul_seconds=e.matmul_seconds, memory_bound_seconds=e.memory_bound_seconds,
                          optimizer_seconds=e.optimizer_seconds, comm_seconds=e.comm_seconds,
                          exposed_comm_seconds=e.exposed_comm_seconds, offload_seconds=e.offload_seconds,
                          exposed_offload_seconds=e.exposed_offload_seconds, host_memory_gib_per_node=0,
                          comm_share=e.comm_share, exposed_comm_share=e.exposed_comm_share, mfu=0.4,
                          tokens_per_second=tokens_per_second, duration_seconds=3600, cost_usd=10,
                          memory_breakdown_gib={})
    return JobPlan(pool="h200", strategy=row["strategy"], workers=row["gpus"], gpus=row["gpus"],
                   micro_batch=row["micro_batch"], grad_accum=1, cpu_offload=row.get("cpu_offload", False),
                   shard_group=layout.shard_group, predicted=predicted, explanation="recorded", rejected=list(rejected))


def observed_from(row: dict, steps: int = 100, data_seconds: float = 0.0, checkpoint_seconds: float = 0.0,
                  comm: dict | None = None, held: float | None = None) -> Observed:
    """The run's medians as the API keeps its recent points, and its profiler window (multi-GPU runs)."""
    fb, opt = row["forward_backward_seconds_median"], row["optimizer_seconds_median"]
    step = row["step_seconds_median"] + data_seconds
    point = {"step_seconds": step, "data_seconds": max(0.0, step - fb - opt), "forward_backward_seconds": fb,
             "optimizer_seconds": opt}
    if comm is None and "comm_share" in row:
        comm = {k: row[k] for k in ("comm_share", "comm_share_exposed", "comm_seconds_per_step",
                                    "exposed_comm_seconds_per_step", "profiled_step_seconds")}
    return Observed(steps=steps, points=[point] * 10, comm=comm, checkpoint_seconds=checkpoint_seconds,
                    held_seconds=held if held is not None else steps * step * 1.05, checkpoint_every=50)


FSDP_1B = RUNS["llama-1b-full-fsdp-2gpu-mb8"]
OFFLOAD_1B = RUNS["llama-1b-full-single-1gpu-mb8-offload"]
ALTERNATIVES = [RejectedOption(strategy="hsdp", gpus=16, reason="12% slower on NVLink"),
                RejectedOption(strategy="ddp", gpus=2, reason="does not fit: 81 GiB per GPU")]


def slow_link(row: dict, factor: float) -> Observed:
    """The run had its collectives been `factor` times slower, none of the extra hidden by compute."""
    extra = row["comm_seconds_per_step"] * (factor - 1)
    comm = {"comm_share": row["comm_share"], "comm_share_exposed": row["comm_share_exposed"],
            "comm_seconds_per_step": row["comm_seconds_per_step"] * factor,
            "exposed_comm_seconds_per_step": row["exposed_comm_seconds_per_step"] + extra,
            "profiled_step_seconds": row["profiled_step_seconds"] + extra}
    point = {"step_seconds": row["step_seconds_median"] + extra, "data_seconds": 0.0,
             "forward_backward_seconds": row["forward_backward_seconds_median"] + extra,
             "optimizer_seconds": row["optimizer_seconds_median"]}
    return Observed(steps=100, points=[point] * 5, comm=comm, checkpoint_seconds=0, held_seconds=None)


def test_offloaded_copies_are_predicted_where_the_gpu_idles_through_them():
    """Host copies are memcpys, not kernels: a profiled window shows them as the GPU idling, counted with the
    memory-bound work. The prediction puts them there too, so an offloaded run on plan reads on plan, not as
    communication far under its prediction and memory-bound work far over."""
    plan = plan_for(OFFLOAD_1B)
    p = plan.predicted
    assert p.exposed_offload_seconds > 0.1 and p.exposed_comm_seconds == 0
    predicted = predicted_components(plan)
    assert predicted["memory-bound and launches"] == pytest.approx(p.memory_bound_seconds + p.exposed_offload_seconds)
    assert predicted["exposed communication"] == 0
    # the run as the plan has it, profiled: products, other kernels, and the GPU idle through the copies and
    # through the host's optimizer step
    fb = p.matmul_seconds + p.memory_bound_seconds + p.exposed_offload_seconds
    window = fb + p.optimizer_seconds
    comm = {"matmul_seconds_per_step": p.matmul_seconds, "attention_seconds_per_step": 0.0,
            "other_compute_seconds_per_step": p.memory_bound_seconds,
            "gpu_busy_share": 1 - (p.exposed_offload_seconds + p.optimizer_seconds) / window,
            "profiled_step_seconds": window, "exposed_comm_seconds_per_step": 0.0}
    point = {"step_seconds": window, "data_seconds": 0.0, "forward_backward_seconds": fb,
             "optimizer_seconds": p.optimizer_seconds}
    observed = Observed(steps=100, points=[point] * 5, comm=comm, checkpoint_seconds=0, held_seconds=None)
    measured = measured_components(observed)
    assert measured["memory-bound and launches"] == pytest.approx(predicted["memory-bound and launches"], rel=1e-6)
    found = diagnose(plan, observed)
    assert found.status == "on plan" and found.explains_gap is None, found.findings


@pytest.mark.parametrize(("case", "plan", "observed", "status", "dominant", "explains", "finding"), [
    # recorded as they ran: within the planner's error
    ("fsdp 2 GPUs", plan_for(FSDP_1B), observed_from(FSDP_1B), "on plan", "compute", None, "on plan: 340 ms"),
    ("offload", plan_for(OFFLOAD_1B), observed_from(OFFLOAD_1B), "on plan", "optimizer and host", None,
     "the optimizer step takes"),
    # the same FSDP run over a link 8x slower than the pool declares, nothing more hidden
    ("slow link", plan_for(FSDP_1B, ALTERNATIVES), slow_link(FSDP_1B, 8), "slower than planned",
     "exposed communication", "exposed communication", "the collectives ran at 3% of the speed"),
    # the host starves the loop: 120 ms a step waiting for data
    ("data wait", plan_for(FSDP_1B), observed_from(FSDP_1B, data_seconds=0.12), "slower than planned", "compute",
     "data wait", "waits 26% of its time for its next batch"),
    # checkpoints of 3 s every 50 steps: outside the median step, spread over the steps
    ("checkpoints", plan_for(FSDP_1B), observed_from(FSDP_1B, checkpoint_seconds=6.0, steps=100), "on plan",
     "compute", None, "checkpoints every 50 steps take 18% of the training time"),
    # a job that waited for its GPUs: half the held time went to steps
    ("start-up", plan_for(FSDP_1B), observed_from(FSDP_1B, held=100 * 0.34 * 2), "on plan", "compute", None,
     "50% of the time the workers were held went to training steps"),
])
def test_recorded_runs_are_diagnosed(case, plan, observed, status, dominant, explains, finding):
    found = diagnose(plan, observed)
    assert found.status == status, (case, found.findings)
    assert found.dominant == dominant and found.explains_gap == explains, (case, found)
    assert any(finding in line for line in found.findings), (case, found.findings)
    names = [c.name for c in found.components]
    assert {"compute", "exposed communication", "optimizer and host", "data wait", "checkpoints"} <= set(names)


def test_a_slow_link_names_the_alternatives_that_communicate_less():
    found = diagnose(plan_for(FSDP_1B, ALTERNATIVES), slow_link(FSDP_1B, 8))
    line = next(f for f in found.findings if "alternatives" in f)
    assert "hsdp on 16 GPUs (12% slower on NVLink)" in line and "ddp on 2 GPUs" in line


def test_a_recorded_gpu_window_splits_the_step_into_the_planners_terms():
    """The Llama-1B full run of the throughput benchmark (one H200, its profiler trace committed): matrix
    products and attention against the planner's matmul time, and a step faster than the calibration of
    the runtime before the fast paths predicts."""
    with gzip.open(RESULTS / "traces" / "llama1b-full--tunewright.json.gz", "rt") as fh:
        events = chrome_trace_events(json.load(fh))
    kernels, window = kernel_time(events), 0.5355  # two steps
    share = comm_share(*split_events(events), window)
    comm = {"comm_share": share.total, "comm_share_exposed": share.exposed, "comm_seconds_per_step": 0.0,
            "exposed_comm_seconds_per_step": 0.0, "profiled_step_seconds": window / 2,
            "matmul_seconds_per_step": kernels.matmul_seconds / 2, "attention_seconds_per_step":
            kernels.attention_seconds / 2, "other_compute_seconds_per_step": kernels.other_compute_seconds / 2,
            "gpu_busy_share": kernels.busy_seconds / window}
    step = 16384 / 60253  # its median step (tokens per step / tokens per second)
    row = {"model": "llama-1b", "method": "full", "strategy": "single", "gpus": 1, "micro_batch": 8,
           "seq_len": 2048}
    point = {"step_seconds": step, "data_seconds": 0.0005, "forward_backward_seconds": step - 0.016,
             "optimizer_seconds": 0.0155}
    found = diagnose(plan_for(row), Observed(steps=18, points=[point] * 12, comm=comm, checkpoint_seconds=0,
                                             held_seconds=None))
    assert found.status == "faster than planned" and found.dominant == "matrix products"
    parts = {c.name: c for c in found.components}
    assert 0.55 < parts["matrix products"].measured_share < 0.85
    # the calibration predates the compiled blocks and the fused loss: its memory-bound time is 3x what
    # ran, while the GEMMs ran at about 80% of the rate it was fitted at (the GEMM ceiling)
    assert parts["memory-bound and launches"].measured_seconds < parts["memory-bound and launches"].predicted_seconds / 2
    assert any("matrix products run at 80% of the calibrated rate" in f for f in found.findings)
    assert sum(c.measured_seconds for c in found.components if c.name != "checkpoints") == pytest.approx(step, rel=0.02)


def test_nothing_measured_yet_says_so():
    found = diagnose(plan_for(FSDP_1B), Observed(steps=0, points=[], comm=None, checkpoint_seconds=0,
                                                 held_seconds=1))
    assert found.status == "not measured yet" and found.components == []


def test_a_cpu_run_has_no_prediction_but_a_breakdown():
    point = {"step_seconds": 0.5, "data_seconds": 0.01, "forward_backward_seconds": 0.45, "optimizer_seconds": 0.02}
    comm = {"comm_share": 0.12, "comm_share_exposed": 0.12, "comm_seconds_per_step": 0.06,
            "exposed_comm_seconds_per_step": 0.06, "profiled_step_seconds": 0.5}
    found = diagnose(None, Observed(steps=20, points=[point] * 5, comm=comm, checkpoint_seconds=0,
                                    held_seconds=20))
    assert found.status == "no prediction (CPU)" and found.dominant == "compute"
    parts = {c.name: c.measured_seconds for c in found.components}
    assert parts["compute"] == pytest.approx(0.39) and parts["exposed communication"] == pytest.approx(0.06)
    assert "exposed communication is 12% of the step" in " ".join(found.findings)
    assert found.goodput == pytest.approx(20 * 0.49 / 20)
