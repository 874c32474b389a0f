"""Full fine-tuning with bf16 weights and moments (`optimizer_state: bf16`) on one H200, through the product's own
path (Ray Train), against fp32 master weights: issue 35's target 3.

- quality: Llama-1B (random init, the benchmark's fixed-length text), 500 steps each, the same data order: the
  loss curves side by side and the mean of the last 50 steps' losses, bf16 over fp32.
- fit and speed: Llama-8B full on one GPU: fp32 masters need CPU offload there; bf16 state fits on the GPU. Tokens/s,
  MFU and peak memory of both, beside the planner's predictions for the same layouts.

  python benchmarks/light_state_check.py --out benchmarks/results/light_state_h200_<date>.json --cases quality
  python benchmarks/light_state_check.py --out ... --cases 8b
  python benchmarks/light_state_check.py --smoke --out /tmp/l.json     # CPU, tiny shapes: the code paths
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_runs import (  # noqa: E402
    MODELS,
    PEAK_FLOPS,
    SMOKE_MODELS,
    build_model,
    device_name,
    measured_steps,
    one_gpu_strategy,
    planner_gpu,
    run_on_ray,
    write_dataset,
)

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.estimate import Layout, Workload, estimate  # noqa: E402
from tunewright_core.planner.hardware import GIB  # noqa: E402
from tunewright_fit.calibration_fit import measured_pool  # noqa: E402

WARMUP_STEPS = 4


class Case(NamedTuple):
    name: str
    model: str
    optimizer_state: str  # fp32 | bf16
    micro_batch: int
    steps: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    seq_len: int = 2048


CASES = {
    "quality": [Case("1b-fp32", "llama-1b", "fp32", 8, 500), Case("1b-bf16", "llama-1b", "bf16", 8, 500)],
    "8b": [Case("8b-fp32-offload", "llama-8b", "fp32", 4, 8, activation_checkpointing=True, cpu_offload=True),
           Case("8b-bf16", "llama-8b", "bf16", 4, 12, activation_checkpointing=True)],
}


def predicted(case: Case, profile) -> dict:
    cal, gpu = calibration.load()[0], planner_gpu()
    w = Workload(profile, "full", case.seq_len, case.micro_batch, steps=1, optimizer_state=case.optimizer_state)
    layout = Layout("single", 1, 1, case.micro_batch, 1, case.activation_checkpointing, cpu_offload=case.cpu_offload)
    e = estimate(w, layout, measured_pool(gpu, 1), cal)
    return {"step_seconds": e.step_seconds, "peak_memory_gib": e.peak_memory_bytes / GIB,
            "optimizer_seconds": e.optimizer_seconds, "tokens_per_second": w.tokens_per_step / e.step_seconds}


def run_case(case: Case, model_dir: Path, data: Path, work: Path, smoke: bool, profile) -> dict:
    out = work / case.name
    seq_len = 128 if smoke else case.seq_len
    config = {
        "name": case.name, "output_dir": str(out), "model": {"source": str(model_dir)},
        "method": {"type": "full"}, "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": case.steps, "learning_rate": 2e-5, "lr_schedule": "cosine",
                            "warmup_ratio": 0.03, "seq_len": seq_len, "seed": 0, "global_batch_size": case.micro_batch,
                            "optimizer_state": case.optimizer_state},
        "strategy": one_gpu_strategy(case.micro_batch, case.activation_checkpointing, case.cpu_offload, smoke),
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}},
    }
    row, records, _ = run_on_ray(config, out, timeout=580)
    if "error" in row:
        return row
    steps = [r for r in records if r["event"] == "step"]
    measured = steps[WARMUP_STEPS:]
    summary = measured_steps(measured)
    return row | summary | {
        "mfu": summary["tokens_per_second"] * profile.flops_per_token(seq_len, "full") / PEAK_FLOPS,
        "optimizer_seconds_median": statistics.median(r["optimizer_seconds"] for r in measured),
        "losses": [r["loss"] for r in steps],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-light-state"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 6 steps: the code paths")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data.jsonl"
    write_dataset(data, 4000 if not args.smoke else 200, 3000 if not args.smoke else 200)
    models = SMOKE_MODELS if args.smoke else MODELS
    rows, built = [], {}
    for group in args.cases:
        for case in CASES[group]:
            if args.smoke:
                case = case._replace(steps=6)
            profile, extra = models[case.model]
            if case.model not in built:
                built[case.model] = args.work / case.model
                build_model(profile, extra, built[case.model])
            row = {"case": case._asdict(), "predicted": predicted(case, profile),
                   **run_case(case, built[case.model], data, args.work, args.smoke, profile)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"})[:1200], flush=True)
    by_name = {r["case"]["name"]: r for r in rows}
    if "losses" in by_name.get("1b-fp32", {}) and "losses" in by_name.get("1b-bf16", {}):
        tail = {n: statistics.fmean(by_name[n]["losses"][-50:]) for n in ("1b-fp32", "1b-bf16")}
        print(f"last 50 steps' mean loss: fp32 {tail['1b-fp32']:.4f}, bf16 {tail['1b-bf16']:.4f}, "
              f"ratio {tail['1b-bf16'] / tail['1b-fp32']:.4f}")
    args.out.write_text(json.dumps({"gpu": device_name(args.smoke),
                                    "time": time.strftime("%Y-%m-%d %H:%M"), "runs": rows}, indent=2) + "\n")
    for row in rows:
        print(f"{row['case']['name']:18} tok/s {row.get('tokens_per_second', 0):9.0f} "
              f"(pred {row['predicted']['tokens_per_second']:9.0f}) MFU {row.get('mfu', 0):.3f} "
              f"peak {row.get('peak_memory_gib', 0):6.1f} GiB (pred {row['predicted']['peak_memory_gib']:6.1f}) "
              f"{row.get('error', '')[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
