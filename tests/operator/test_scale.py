"""The planner at scale against published multi-GPU measurements (benchmarks/published/multi_gpu_runs.json):
fitted on one source, checked on every other (scale_fit.py), and the band that follows (band.py)."""

import json
import math

import pytest

from tunewright_core.planner import calibration
from tunewright_core.planner.band import Evidence, band
from tunewright_core.planner.hardware import LINKS
from tunewright_fit import scale_fit

COMMITTED = json.loads(scale_fit.SCALE_FILE.read_text())


@pytest.fixture(scope="module")
def found() -> list[dict]:
    cal, h200 = calibration.load()
    constants = scale_fit.ScaleConstants(COMMITTED["efficiency_over_h200"], COMMITTED["sync_jitter"],
                                         COMMITTED["comm_interference"])
    return scale_fit.errors(scale_fit.rows(), cal, h200, constants)


@pytest.mark.slow
def test_the_committed_constants_are_the_fit_of_the_published_runs():
    cal, h200 = calibration.load()
    fitted = scale_fit.fit(scale_fit.rows(), cal, h200)
    assert fitted.efficiency == pytest.approx(COMMITTED["efficiency_over_h200"], rel=1e-6)
    assert fitted.sync_jitter == COMMITTED["sync_jitter"]
    assert fitted.comm_interference == pytest.approx(COMMITTED["comm_interference"], rel=1e-6)


def test_the_fit_set_and_the_held_out_runs_come_from_different_sources(found):
    fit = {r["id"].split("-")[0] for r in found if not r["held_out"]}
    held_out = {r["id"].split("-")[0] for r in found if r["held_out"]}
    assert fit == {"llmfoundry"} and len(held_out) >= 4 and not fit & held_out
    assert sum(not r["held_out"] for r in found) >= 100 and sum(r["held_out"] for r in found) >= 25
    assert max(r["gpus"] for r in found if r["held_out"]) >= 256  # the largest runs are held out


def test_held_out_published_runs_are_predicted_within_the_targets_without_one_sided_bias(found):
    """Issue 32: tokens/s per GPU within 15% in the median and 35% at worst on runs not fitted on, neither
    always faster nor always slower. Runs the framework compiled (torch.compile) are outside the model and
    reported apart (scale_fit's `held_out_compiled`)."""
    held_out = scale_fit.summary(found)["held_out"]
    assert held_out["median_abs_error"] <= 0.15 and held_out["max_abs_error"] <= 0.35
    assert 0.2 <= held_out["share_over_predicted"] <= 0.8
    for key in ("median_abs_error", "max_abs_error", "p10_ratio", "p90_ratio"):  # what the band is made of
        assert held_out[key] == pytest.approx(COMMITTED["held_out"][key]), key


def test_scaling_losses_come_with_exposed_communication_and_weak_scaling_follows_the_published(found):
    """Where published per-GPU throughput falls by more than 5% from a series' smallest GPU count to its
    largest, the model exposes more communication at the largest (the first gathers are exposed at any
    count: more than zero alone would say nothing); where it does not rise (a rise is no communication
    effect: the tables' other settings), the predicted ratio is within 0.03 of the published one. The
    series are llm-foundry's but one (KempnerForge, 2 to 4 GPUs): the held-out sources publish one GPU count
    per setting, their scaling is checked by their rows' errors above."""
    series = scale_fit.weak_scaling(found)
    assert len(series) >= 10 and sum(s["measured"] < 0.95 for s in series) >= 2
    for s in series:
        if s["measured"] < 0.95:
            assert s["exposed_at_largest"] > s["exposed_at_smallest"], s
        if s["measured"] <= scale_fit.RISING:
            assert abs(s["predicted"] - s["measured"]) <= 0.03, s


EVIDENCE = Evidence(one_gpu=(0.94, 1.28), published=(0.96, 1.21), published_rows=28, one_gpu_rows=9,
                    largest_gpu_count=464, longest_sequence=8192, network_range=(45e9, 360e9))


@pytest.mark.parametrize(("gpu", "gpus", "network", "seq_len", "method", "widened", "says"), [
    ("H200", 1, None, 2048, "full", 1.0, "one-GPU H200 runs"),
    ("H100", 64, LINKS["ib-8x400g"], 4096, "full", 1.0, "within what was measured"),
    ("H100", 64, LINKS["eth-100g"], 4096, "full", 1.5, "no published run crossed nodes at 11.2 GB/s"),
    ("H100", 928, LINKS["ib-8x400g"], 4096, "full", 1.5, "928 GPUs, beyond the largest published run (464)"),
    ("L40S", 8, None, 2048, "full", 2.0, "no run measured a L40S"),
    ("H100", 8, None, 32768, "full", 2.0, "sequences of 32768 tokens"),
    ("H100", 8, None, 2048, "lora", 1.25, "lora on several GPUs"),
])
def test_the_band_widens_where_the_plan_extrapolates(gpu, gpus, network, seq_len, method, widened, says):
    b = band(EVIDENCE, gpu, gpus, network, seq_len, method)
    base = EVIDENCE.one_gpu if (gpu, gpus) == ("H200", 1) else EVIDENCE.published
    assert math.log(b.low) == pytest.approx(math.log(min(base[0], 1.0)) * widened)
    assert math.log(b.high) == pytest.approx(math.log(max(base[1], 1.0)) * widened)
    assert b.low <= 1 <= b.high and says in b.basis
    low, high = b.around(100.0)
    assert (low, high) == pytest.approx((100 * b.low, 100 * b.high))
    assert b.around(10.0, inverse=True) == pytest.approx((10 / b.high, 10 / b.low))  # step time, cost


def test_the_band_widens_for_cpu_offload_whose_copies_one_run_fitted():
    offloaded, not_offloaded = (band(EVIDENCE, "H200", 1, None, 2048, "lora", cpu_offload=o) for o in (True, False))
    assert math.log(offloaded.high) == pytest.approx(math.log(not_offloaded.high) * 1.25)
    assert "CPU offload (its copies' rate fitted on one Llama-8B LoRA run on one H100" in offloaded.basis
    assert "within what was measured" in not_offloaded.basis


@pytest.mark.parametrize(("windows", "widened", "says"), [
    (0, 2.0, "no run measured a L40S"),
    (1, 2.0, "no run measured a L40S but 1 window of this pool's jobs"),
    (3, 1.0, "the L40S's compute efficiency as 3 profiler windows of this pool's jobs measured it"),
])
def test_a_gpu_the_pools_own_jobs_measured_is_not_widened_as_unmeasured(windows, widened, says):
    b = band(EVIDENCE, "L40S", 8, None, 2048, "full", learned_windows=windows)
    assert math.log(b.high) == pytest.approx(math.log(EVIDENCE.published[1]) * widened) and says in b.basis


def test_a_learned_gpu_carries_the_windows_it_was_learned_over():
    from tunewright_core.planner.hardware import learned_gpu

    catalog = calibration.for_gpu("L40S")
    record = {"factor": 0.8, "windows": 4, "lastJob": "j", "measuredAt": 1}
    learnt = learned_gpu(catalog, "L40S", {"gpu": "L40S", "severalGPUs": record})
    assert learnt.windows_on(8) == learnt.windows_on(1) == 4
    assert learnt.matmul_efficiency == pytest.approx(0.8 * catalog.matmul_efficiency)
    assert learned_gpu(catalog, "L40S", {"gpu": "H100", "severalGPUs": record}) == catalog
