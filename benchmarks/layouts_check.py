"""Activation checkpointing of every block, of every other block, and of none, measured on one GPU through
the product's path (Ray Train) beside the planner's predictions of each (issue 32, item 4).

  python benchmarks/layouts_check.py --out OUT [--steps 30] [--cases llama-1b-full llama-3b-full]

writes OUT/layouts_check.json (after every run) and prints a table: step time and peak memory, measured
and predicted, per layout. (Weights kept gathered until backward need several GPUs to differ from the
one-GPU path, which keeps every block gathered already: they wait for a machine of several GPUs.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))
sys.path.insert(0, str(ROOT / "fitting"))

from gpu_runs import MODELS, build_model, planner_gpu, write_dataset  # noqa: E402

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.estimate import Layout, Workload, estimate  # noqa: E402
from tunewright_fit.calibration_fit import measured_pool  # noqa: E402

CASES = {"llama-1b-full": ("llama-1b", "full", 2048, 8), "llama-3b-full": ("llama-3b", "full", 2048, 4)}
LAYOUTS = {"none": (False, 1), "every-block": (True, 1), "every-other-block": (True, 2)}
WARMUP = 5


def run(case: str, layout: str, model_path: Path, data: Path, out: Path, steps: int) -> dict:
    model, method, seq_len, micro = CASES[case]
    checkpointing, every = LAYOUTS[layout]
    config = {
        "name": f"{case}-{layout}", "output_dir": str(out), "model": {"source": str(model_path)},
        "method": {"type": method}, "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "seq_len": seq_len, "warmup_ratio": 0.0,
                            "global_batch_size": micro},
        "strategy": {"type": "single", "num_workers": 1, "use_gpu": True, "micro_batch_size": micro,
                     "activation_checkpointing": checkpointing, "activation_checkpointing_every": every},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(config, indent=2))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "tunewright_jobs.run", "--config", str(out / "job.json")], env=env,
                          capture_output=True, text=True, timeout=400)
    row = {"case": case, "layout": layout, "returncode": proc.returncode, "wall_seconds": time.time() - started}
    if proc.returncode:
        row["error"] = (proc.stdout + proc.stderr)[-1500:]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r for r in records if r["event"] == "step"][WARMUP:]
    row.update(step_seconds_median=statistics.median(r["step_seconds"] for r in steady),
               peak_memory_gib=max(r["peak_memory_gib"] for r in steady),
               tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady))
    cal, gpu = calibration.load()[0], planner_gpu()
    profile = MODELS[model][0]
    e = estimate(Workload(profile, method, seq_len, micro, steps=1, recompute="auto"),
                 Layout("single", 1, 1, micro, 1, checkpointing, checkpoint_every=every), measured_pool(gpu, 1), cal)
    row.update(predicted_step_seconds=e.step_seconds, predicted_peak_memory_gib=e.peak_memory_bytes / 2**30,
               step_error=e.step_seconds / row["step_seconds_median"] - 1,
               memory_error=e.peak_memory_bytes / 2**30 / row["peak_memory_gib"] - 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    import torch

    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    write_dataset(work / "data.jsonl", n=2000, words_per_example=2048)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps, "rows": []}
    for case in args.cases:
        model = CASES[case][0]
        profile, extra = MODELS[model]
        if not (work / model).exists():
            build_model(profile, extra, work / model)
        torch.cuda.empty_cache()
        for layout in LAYOUTS:
            row = run(case, layout, work / model, work / "data.jsonl", work / f"{case}-{layout}", args.steps)
            result["rows"].append(row)
            print(json.dumps(row)[:400], flush=True)
            (args.out / "layouts_check.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'case':16} {'layout':18} {'step s meas/pred':>18} {'error':>7} {'peak GiB meas/pred':>20} {'error':>7}")
    for r in result["rows"]:
        if r["returncode"]:
            print(f"{r['case']:16} {r['layout']:18} FAILED")
            continue
        print(f"{r['case']:16} {r['layout']:18} {r['step_seconds_median']:8.3f} / {r['predicted_step_seconds']:<7.3f} "
              f"{r['step_error']:>+7.1%} {r['peak_memory_gib']:9.1f} / {r['predicted_peak_memory_gib']:<8.1f} "
              f"{r['memory_error']:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
