"""What the planner may import and read per request, and the benchmark that measures it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunewright_core.planner import calibration
from tunewright_core.planner.models import CATALOG, from_hf_config, hf_config
from tunewright_fit.calibration_fit import MEASURED_MODELS

ROOT = Path(__file__).resolve().parents[2]
# what the API imports of the planner (its image has no numpy); the fit is the only numpy user
PER_REQUEST = ["calibration", "estimate", "comm", "band", "search", "hardware", "models", "jobs", "formulas"]


def test_the_per_request_planner_imports_without_numpy():
    imports = "; ".join(f"import tunewright_core.planner.{m}" for m in PER_REQUEST)
    code = (f"import sys; sys.modules['numpy'] = None; {imports}; "
            "from tunewright_core.planner import calibration; calibration.for_gpu('H100')")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "core")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_committed_calibration_is_read_once_per_file(tmp_path):
    first = calibration.load()
    assert calibration.load() is first
    assert calibration.load(str(calibration.DEFAULT_FILE)) is first  # same file, other spelling
    # another chip: the H200's measured efficiency times the factor published runs on it fitted (scale.json);
    # on the H200's own die (an H100), that factor only where a plan spans GPUs
    factors = json.loads(calibration.SCALE_FILE.read_text())["efficiency_over_h200"]
    assert calibration.for_gpu("A100-80GB").matmul_efficiency == pytest.approx(first[1].matmul_efficiency
                                                                             * factors["A100"])
    assert calibration.for_gpu("H100").on(2).matmul_efficiency == pytest.approx(first[1].matmul_efficiency
                                                                               * factors["H100"])
    assert calibration.for_gpu("H200").matmul_efficiency == first[1].matmul_efficiency
    copy = tmp_path / "calibration.json"
    cal, gpu = first
    calibration.save(copy, cal, gpu, [])
    assert calibration.load(copy) == first and calibration.load(copy) is not first
    faster = gpu.calibrated(matmul_efficiency=gpu.matmul_efficiency / 2)
    calibration.save(copy, cal, faster, [])  # a new fit is read again
    assert calibration.load(copy)[1] == faster


@pytest.mark.parametrize("profile", [*CATALOG.values(), *MEASURED_MODELS.values()], ids=lambda p: p.name)
def test_config_json_of_a_profile_reads_back_as_the_profile(profile):
    """The benchmark builds its models from the planner's profiles through hf_config."""
    assert from_hf_config(profile.name, hf_config(profile)) == profile


def test_benchmark_lists_its_matrices_and_refuses_others():
    script = str(ROOT / "benchmarks" / "gpu_runs.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    for name in ("calibration", "calibration-2gpu", "scale-8b", "default: calibration"):
        assert name in shown.stdout
    unknown = subprocess.run([sys.executable, script, "--matrix", "baseline", "--out", "x"],
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "invalid choice: 'baseline'" in unknown.stderr
