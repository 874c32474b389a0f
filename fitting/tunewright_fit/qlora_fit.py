"""QLoRA's one constant, `Calibration.nf4_dequant_bytes_per_param`, fitted on `benchmarks/qlora_check.py` runs.

Every other term of a QLoRA step is bf16 LoRA's (fitted by `calibration_fit`); what 4-bit adds is memory-bound
dequantization, linear in the constant: the step predicted with the constant at 0, plus the constant times the
bytes-per-parameter's seconds. The fit is a one-column weighted least squares (weights 1/measured: relative
error) over the fit set; the other runs are held out and reported.

Fit set: Llama-8B runs on the H200 (the calibration's card) whose 4-bit blocks were compiled (the runtime's
default on a GPU). Runs with eager 4-bit blocks (the default before 2026-12-05: 1.56x slower), the 70B-shaped runs
and the runs on another card (an H100's, predicted at the H200's efficiencies) are held out.

  python -m tunewright_fit.qlora_fit fit benchmarks/results/qlora_check_*.json
  python -m tunewright_fit.qlora_fit report benchmarks/results/qlora_check_*.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tunewright_core.planner.calibration import for_gpu
from tunewright_core.planner.estimate import Calibration, Layout, Workload, estimate
from tunewright_core.planner.hardware import GIB, GPU, gpu_from_product_name
from tunewright_core.planner.models import CATALOG
from tunewright_fit.calibration_fit import (
    MEASURED_MODELS,
    Columns,
    constant_fitter,
    fit_constant,
    measured_pool,
)

MODELS = {"llama-8b": MEASURED_MODELS["llama-8b"], "llama-70b": CATALOG["meta-llama/Llama-3.1-70B"]}
COMPILED = "compile: decoder blocks"  # the runtime's kernel line for compiled blocks


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    workload: Workload
    layout: Layout
    compiled: bool
    step_seconds: float
    peak_memory_bytes: float
    chip: str  # the catalog key of the card it ran on

    @property
    def in_fit_set(self) -> bool:
        return self.compiled and self.workload.model.name == "llama-8b" and self.chip == "H200"


def load_runs(paths: list[Path]) -> list[Run]:
    """The 4-bit runs that finished, from qlora_check JSON files (their offload rows are offload_fit's)."""
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        # a smoke run (the CPU) stands for the H200 the calibration is of
        chip = "H200" if data["gpu"] == "cpu (smoke)" else gpu_from_product_name(data["gpu"])
        if chip is None:
            raise ValueError(f"{path}: a run on {data['gpu']}, a card the planner's catalog does not know")
        for row in data["runs"]:
            case = row["case"]
            if case["quantization"] != "nf4" or "step_seconds_median" not in row:
                continue
            workload = Workload(MODELS[case["model"]], "qlora", case["seq_len"], case["micro_batch"], steps=1)
            layout = Layout("single", 1, 1, case["micro_batch"], 1, case["activation_checkpointing"])
            runs.append(Run(case["name"], Path(path).name, workload, layout, COMPILED in row.get("kernels", ""),
                            row["step_seconds_median"], row["peak_memory_gib"] * GIB, chip))
    return runs


def fit(runs: list[Run], calibration: Calibration, gpu: GPU) -> float:
    """The bytes per block weight per dequantizing product that best predict the fit set's steps."""
    fit_set = [r for r in runs if r.in_fit_set]
    if not fit_set:
        raise ValueError("qlora fit: no Llama-8B run on an H200 with compiled 4-bit blocks among the measurements")
    return fit_constant("nf4_dequant_bytes_per_param", calibration, fit_set, lambda r, c: _step(r, c, gpu),
                        lambda r: r.step_seconds)


def _card(run: Run, gpu: GPU) -> GPU:
    """`gpu` (the calibration's) for a run on its chip; another chip's run on that chip as the planner models it."""
    return gpu if run.chip == gpu.name else for_gpu(run.chip)


def _step(run: Run, calibration: Calibration, gpu: GPU) -> float:
    return estimate(run.workload, run.layout, measured_pool(_card(run, gpu), 1), calibration).step_seconds


def compare(runs: list[Run], calibration: Calibration, gpu: GPU) -> list[dict]:
    rows = []
    for r in runs:
        e = estimate(r.workload, r.layout, measured_pool(_card(r, gpu), 1), calibration)
        rows.append({"run": r.name, "source": r.source, "chip": r.chip, "fit_set": r.in_fit_set, "compiled": r.compiled,
                     "step_seconds": r.step_seconds, "predicted_step_seconds": e.step_seconds,
                     "step_error": e.step_seconds / r.step_seconds - 1,
                     "peak_memory_gib": r.peak_memory_bytes / GIB, "predicted_peak_memory_gib": e.peak_memory_bytes / GIB,
                     "memory_error": e.peak_memory_bytes / r.peak_memory_bytes - 1})
    return rows


COLUMNS: Columns = [
    ("blocks", lambda r: "compiled" if r["compiled"] else "eager"),
    ("step s", lambda r: f"{r['step_seconds']:.3f}"), ("predicted", lambda r: f"{r['predicted_step_seconds']:.3f}"),
    ("error", lambda r: f"{r['step_error']:+.1%}"), ("peak GiB", lambda r: f"{r['peak_memory_gib']:.1f}"),
    ("predicted", lambda r: f"{r['predicted_peak_memory_gib']:.1f}"), ("error", lambda r: f"{r['memory_error']:+.1%}"),
]


def main(argv: list[str] | None = None) -> int:
    return constant_fitter(argv, __doc__, "nf4_dequant_bytes_per_param", load_runs,
                           lambda r: r.in_fit_set, fit, compare, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
