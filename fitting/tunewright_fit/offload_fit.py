"""CPU offload's one fitted constant, `Calibration.host_copy_slowdown`: the card's host link rate over what the
copies of offloaded shards reach, fitted on `benchmarks/qlora_check.py`'s offload runs.

An offloaded step is the step on the GPU, the host's AdamW (calibration_fit's rate) and the copies: each block's
shard in for forward and again for backward, its gradients out, the two directions at once (estimate's
`offload_seconds`). The copies are counted exposed: FSDP2 copies a block in as it gathers it, and on both runs
measured the step was the sum, none of the copies hidden under the compute. The step is linear in the constant, so
the fit is a one-column weighted least squares (weights 1/measured), as qlora_fit's.

Fit set: the offload rows of qlora_check files on an H100 (Llama-8B LoRA, where the copies are two thirds of the
step). Held out and reported: the offloaded rows of gpu_calibration files (Llama-1B full fine-tuning on an H200,
where the host's AdamW is most of the step; that rate is calibration_fit's, fitted on the same run, so the row's
forward-and-backward is the check of the copies).

  PYTHONPATH=core:fitting python -m tunewright_fit.offload_fit fit benchmarks/results/{qlora_check,gpu_calibration}_*.json
  PYTHONPATH=core:fitting python -m tunewright_fit.offload_fit report benchmarks/results/{qlora_check,gpu_calibration}_*.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunewright_core.planner.calibration import for_gpu
from tunewright_core.planner.estimate import Calibration, Layout, Workload, estimate
from tunewright_core.planner.hardware import GPU, gpu_from_product_name
from tunewright_fit.calibration_fit import (
    FITTED_ELSEWHERE,
    MEASURED_MODELS,
    Columns,
    constant_fitter,
    fit_constant,
    load_measurements,
    measured_pool,
)
from tunewright_fit.chip_check import RECOMPUTED

FIELD = "host_copy_slowdown"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    chip: str
    workload: Workload
    layout: Layout
    step_seconds: float
    forward_backward_seconds: float | None  # where the run timed it apart from the optimizer step

    @property
    def in_fit_set(self) -> bool:
        return self.source.startswith(FITTED_ELSEWHERE[FIELD])


def load_runs(paths: list[Path]) -> list[Run]:
    """The offloaded runs that finished, from qlora_check and gpu_calibration JSON files (the latter: the H200's)."""
    runs = []
    for path in map(Path, paths):
        if path.name.startswith("gpu_calibration"):
            runs += [Run(m.name, path.name, "H200", m.workload, m.layout, m.step_seconds, m.forward_backward_seconds)
                     for m in load_measurements([path]) if m.layout.cpu_offload]
            continue
        if not path.name.startswith("qlora_check"):
            raise ValueError(f"{path.name}: offload_fit reads qlora_check.py and gpu_calibration results only")
        data = json.loads(path.read_text())
        chip = "H200" if data["gpu"] == "cpu (smoke)" else gpu_from_product_name(data["gpu"])
        if chip is None:
            raise ValueError(f"{path.name}: a run on {data['gpu']}, a card the planner's catalog does not know")
        for row in data["runs"]:
            case = row["case"]
            if not case["cpu_offload"] or "step_seconds_median" not in row:
                continue
            recompute = "on" if RECOMPUTED in row.get("kernels", "") else "off"
            workload = Workload(MEASURED_MODELS[case["model"]], "qlora" if case["quantization"] == "nf4" else "lora",
                                case["seq_len"], case["micro_batch"], steps=1, recompute=recompute)
            layout = Layout("single", 1, 1, case["micro_batch"], 1, case["activation_checkpointing"],
                            cpu_offload=True)
            runs.append(Run(case["name"], path.name, chip, workload, layout, row["step_seconds_median"], None))
    return runs


def _estimate(run: Run, calibration: Calibration, gpu: GPU):
    card = gpu if run.chip == gpu.name else for_gpu(run.chip)
    return estimate(run.workload, run.layout, measured_pool(card, 1), calibration)


def fit(runs: list[Run], calibration: Calibration, gpu: GPU) -> float:
    fit_set = [r for r in runs if r.in_fit_set]
    if not fit_set:
        raise ValueError(f"offload fit: no offloaded run among {FITTED_ELSEWHERE[FIELD]}* files")
    return fit_constant(FIELD, calibration, fit_set, lambda r, c: _estimate(r, c, gpu).step_seconds,
                        lambda r: r.step_seconds)


def compare(runs: list[Run], calibration: Calibration, gpu: GPU) -> list[dict]:
    rows = []
    for r in runs:
        e = _estimate(r, calibration, gpu)
        forward_backward = e.step_seconds - e.optimizer_seconds
        rows.append({"run": r.name, "source": r.source, "chip": r.chip, "fit_set": r.in_fit_set,
                     "step_seconds": r.step_seconds, "predicted_step_seconds": e.step_seconds,
                     "step_error": e.step_seconds / r.step_seconds - 1, "copies_seconds": e.offload_seconds,
                     "forward_backward_seconds": r.forward_backward_seconds,
                     "predicted_forward_backward_seconds": forward_backward,
                     "forward_backward_error": (forward_backward / r.forward_backward_seconds - 1
                                                if r.forward_backward_seconds else None)})
    return rows


def _seconds(key: str) -> Callable[[dict], str]:
    return lambda r: "-" if r[key] is None else f"{r[key]:.3f}"


COLUMNS: Columns = [
    ("step s", _seconds("step_seconds")), ("predicted", _seconds("predicted_step_seconds")),
    ("error", lambda r: f"{r['step_error']:+.1%}"), ("copies s", _seconds("copies_seconds")),
    ("fwd+bwd s", _seconds("forward_backward_seconds")),
    ("predicted", lambda r: f"{r['predicted_forward_backward_seconds']:.3f}" if r["forward_backward_seconds"] else "-"),
    ("error", lambda r: "-" if r["forward_backward_error"] is None else f"{r['forward_backward_error']:+.1%}"),
]


def main(argv: list[str] | None = None) -> int:
    return constant_fitter(argv, __doc__, FIELD, load_runs, lambda r: r.in_fit_set, fit, compare, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
