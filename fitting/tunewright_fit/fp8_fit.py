"""FP8's one fitted constant, `Calibration.fp8_activation_cast_bytes`, fitted on `benchmarks/fp8_check.py` runs.

Every other term of an FP8 step is counted or bf16's (the FP8 products at the datasheet's FP8 rate times the bf16
matmul efficiency; the weights' casts and their layout for backward by count). The activations' casts are where
compiling the blocks changes the bytes most (the largest magnitude and the cast fuse into the work before): the
step is linear in the constant, so the fit is a one-column weighted least squares (weights 1/measured: relative
error), as qlora_fit's. The constant is in bytes, a count of traffic and not of a card: each run is predicted on
the card it ran on (`calibration.for_gpu`).

Fit set: the FP8 rows of fp8_check files (through Ray Train, as the product runs). Held out and reported: the FP8
rows of vs_hf files (tw-fp8, without Ray).

  PYTHONPATH=core:fitting python -m tunewright_fit.fp8_fit fit benchmarks/results/{fp8_check,vs_}*_h100_*.json
  PYTHONPATH=core:fitting python -m tunewright_fit.fp8_fit report benchmarks/results/{fp8_check,vs_}*_h100_*.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from tunewright_core.planner.calibration import for_gpu
from tunewright_core.planner.estimate import Calibration, estimate
from tunewright_fit.calibration_fit import Columns, constant_fitter, fit_constant, measured_pool
from tunewright_fit.chip_check import Run, load_runs


def in_fit_set(run: Run) -> bool:
    return run.source.startswith("fp8_check")


def fp8_runs(paths: list[Path]) -> list[Run]:
    return [r for r in load_runs(paths)[0] if r.workload.precision == "fp8"]


def _step(run: Run, calibration: Calibration) -> float:
    return estimate(run.workload, run.layout, measured_pool(for_gpu(run.chip), 1), calibration).step_seconds


def fit(runs: list[Run], calibration: Calibration) -> float:
    """The bytes per activation element per cast that best predict the fit set's steps."""
    fit_set = [r for r in runs if in_fit_set(r)]
    if not fit_set:
        raise ValueError("fp8 fit: no fp8_check FP8 run among the measurements")
    return fit_constant("fp8_activation_cast_bytes", calibration, fit_set, _step,
                        lambda r: r.workload.tokens_per_step / r.tokens_per_second)


def compare(runs: list[Run], calibration: Calibration) -> list[dict]:
    rows = []
    for r in runs:
        predicted = r.workload.tokens_per_step / _step(r, calibration)
        rows.append({"run": r.name, "source": r.source, "chip": r.chip, "fit_set": in_fit_set(r),
                     "measured": r.tokens_per_second, "predicted": predicted,
                     "error": predicted / r.tokens_per_second - 1})
    return rows


COLUMNS: Columns = [("measured tok/s", lambda r: f"{r['measured']:,.0f}"),
                     ("predicted", lambda r: f"{r['predicted']:,.0f}"), ("error", lambda r: f"{r['error']:+.1%}")]


def main(argv: list[str] | None = None) -> int:
    return constant_fitter(argv, __doc__, "fp8_activation_cast_bytes", fp8_runs, in_fit_set,
                           lambda runs, c, _gpu: fit(runs, c), lambda runs, c, _gpu: compare(runs, c), COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
