"""The committed calibration: the constants the planner runs with, read once per file.

What the API and the operator import per plan: no numpy in its imports. The constants are fitted to
measured runs offline by `calibration_fit.py`, which writes them here with `save`.

  python -m tunewright_operator.planner.calibration_fit fit results/*.json --out calibration_h200.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from tunewright_operator.planner.estimate import Calibration
from tunewright_operator.planner.hardware import GPU, GPUS

DEFAULT_FILE = Path(__file__).with_name("calibration_h200.json")


def save(path: Path, calibration: Calibration, gpu: GPU, sources: list[str]) -> None:
    path.write_text(json.dumps({"gpu": asdict(gpu), "calibration": asdict(calibration), "measurements": sources},
                               indent=2, sort_keys=True) + "\n")
    _read.cache_clear()


@lru_cache(maxsize=8)
def _read(path: Path) -> tuple[Calibration, GPU]:
    data = json.loads(path.read_text())
    return Calibration(**data["calibration"]), GPU(**data["gpu"])


def load(path: Path = DEFAULT_FILE) -> tuple[Calibration, GPU]:
    """The constants and the measured GPU in `path`, read on the first call for that file only."""
    return _read(Path(path).resolve())


def for_gpu(name: str, path: Path = DEFAULT_FILE) -> GPU:
    """A catalog GPU with the measured efficiencies (measured on H200; the same kernels reach similar shares
    of peak on other Hopper and Ampere parts until their own runs replace them)."""
    _, measured = load(path)
    return GPUS[name].calibrated(matmul_efficiency=measured.matmul_efficiency,
                                 memory_efficiency=measured.memory_efficiency)


if __name__ == "__main__":  # the command that README and benchmarks/results name: the fit's own CLI
    from tunewright_operator.planner.calibration_fit import main

    sys.exit(main())
