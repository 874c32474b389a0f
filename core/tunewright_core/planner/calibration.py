"""The committed calibration: the constants the planner runs with, read once per file.

What the API and the operator import per plan: no numpy in its imports. The constants are fitted to
measured runs offline by `calibration_fit.py`, which writes them here with `save`.

  PYTHONPATH=fitting python -m tunewright_fit.calibration_fit fit benchmarks/results/gpu_*_h200.json
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from functools import lru_cache
from pathlib import Path

from tunewright_core.planner.band import Evidence
from tunewright_core.planner.estimate import Calibration
from tunewright_core.planner.hardware import GPU, GPUS, H200_DIE

DEFAULT_FILE = Path(__file__).with_name("calibration_h200.json")


# what a calibration file holds of its GPU: the datasheet figures and the efficiencies measured on it (not what a
# pool learns or a plan across GPUs takes, nor the multi-GPU terms scale.json holds)
NOT_SAVED = ("learned_windows", "several_learned_windows", "several_gpus_factor", "fp8_flops")
NOT_SAVED_CALIBRATION = ("sync_jitter", "comm_interference")


def save(path: Path, calibration: Calibration, gpu: GPU, sources: list[str]) -> None:
    saved_gpu = {k: v for k, v in asdict(gpu).items() if k not in NOT_SAVED}
    saved = {k: v for k, v in asdict(calibration).items() if k not in NOT_SAVED_CALIBRATION}
    path.write_text(json.dumps({"gpu": saved_gpu, "calibration": saved, "measurements": sorted(sources)},
                               indent=2, sort_keys=True) + "\n")
    _read.cache_clear()


def update(path: Path, constants: dict[str, float], sources: list[str], replacing: str) -> None:
    """`path` with these constants replaced and these runs among its sources (in place of those whose names
    start with `replacing`): a fit of some constants on runs of their own (qlora_fit), the rest kept."""
    data = json.loads(path.read_text())
    data["calibration"].update(constants)
    data["measurements"] = sorted({*(s for s in data["measurements"] if not s.startswith(replacing)), *sources})
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _read.cache_clear()


SCALE_FILE = Path(__file__).with_name("scale.json")  # scale_fit's: fitted on published multi-GPU runs
# where a catalog GPU's compute efficiency comes from: the chip scale_fit learned it for, or the nearest one
# measured (an Ada or Blackwell part borrows the Hopper factor, an Ampere one the A100's; the band widens)
EFFICIENCY_OF = {"H100": "H100", "A100-80GB": "A100", "A100-40GB": "A100", "A10G": "A100", "L40S": "H100",
                 "L4": "H100"}


@lru_cache(maxsize=8)
def _read(path: Path) -> tuple[Calibration, GPU]:
    """The constants, with the multi-GPU terms the published runs fitted (step-time jitter, interference of
    overlapped collectives)."""
    data, scale = json.loads(path.read_text()), _scale(SCALE_FILE)
    # datasheet figures the measured GPU's file predates (its FP8 rate) come from the catalog
    catalog = GPUS.get(data["gpu"]["name"])
    datasheet = {"fp8_flops": catalog.fp8_flops} if catalog else {}
    return (replace(Calibration(**data["calibration"]), sync_jitter=scale["sync_jitter"],
                    comm_interference=scale["comm_interference"]), GPU(**{**datasheet, **data["gpu"]}))


@lru_cache(maxsize=2)
def _scale(path: Path) -> dict:
    return json.loads(path.read_text())


def load(path: Path = DEFAULT_FILE) -> tuple[Calibration, GPU]:
    """The constants and the measured GPU in `path`, read on the first call for that file only."""
    return _read(Path(path).resolve())


def published_factor(name: str) -> float:
    """The compute efficiency published FSDP runs on this catalog GPU's chip reached over our H200's (scale_fit;
    1 for a chip of no family it learned)."""
    return _scale(SCALE_FILE)["efficiency_over_h200"].get(EFFICIENCY_OF.get(name, ""), 1.0)


def for_gpu(name: str, path: Path = DEFAULT_FILE) -> GPU:
    """A catalog GPU with its compute efficiencies. One GPU: the H200's as our runs measured them, on the
    H200's die too (`H200_DIE`). Several: the factor published FSDP runs on that chip reached over our H200's
    (scale_fit: their frameworks' kernels, not ours; no run of ours has crossed GPUs); on a chip of another
    die the factor stands for one GPU too. A pool's own runs replace either (pools.learned_gpu)."""
    _, measured = load(path)
    factor = published_factor(name)
    if name in H200_DIE:
        return GPUS[name].calibrated(matmul_efficiency=measured.matmul_efficiency,
                                     memory_efficiency=measured.memory_efficiency, several_gpus_factor=factor)
    return GPUS[name].calibrated(matmul_efficiency=measured.matmul_efficiency * factor,
                                 memory_efficiency=measured.memory_efficiency * factor)


def evidence() -> Evidence:
    """What the uncertainty band of a plan is made of (band.py)."""
    data = _scale(SCALE_FILE)
    return Evidence(one_gpu=(data["one_gpu_h200"]["p10_ratio"], data["one_gpu_h200"]["p90_ratio"]),
                    published=(data["held_out"]["p10_ratio"], data["held_out"]["p90_ratio"]),
                    published_rows=data["held_out"]["rows"], one_gpu_rows=data["one_gpu_h200"]["rows"],
                    largest_gpu_count=data["largest_gpu_count"], longest_sequence=data["longest_sequence"],
                    network_range=tuple(data["network_bus_bytes_per_s"]))

