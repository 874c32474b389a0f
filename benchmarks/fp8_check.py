"""FP8 products (`strategy.precision: fp8`) against bf16 on one H200, through the product's own path (Ray Train):
issue 35's target 2. The same layout and optimizer state for both; 200 steps each, so that the loss curves can be
set side by side (FP8's within 1% of bf16's over the last 50 steps is the bar), tokens/s over the steps after the
warm-up, peak memory, and the planner's prediction for each. The full run's export is loaded back in bf16.

  python benchmarks/fp8_check.py --out benchmarks/results/fp8_check_h200_<date>.json --cases 8b-lora
  python benchmarks/fp8_check.py --out ... --cases 3b-full
  python benchmarks/fp8_check.py --smoke --out /tmp/f.json --cases 8b-lora   # CPU: plumbing only (it refuses fp8)
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

WARMUP_STEPS = 6
STEPS = 200
TAIL = 50  # the loss curves compared over the last steps


class Case(NamedTuple):
    name: str
    model: str
    method: str
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool = False
    compile: str = "auto"
    # the same for both precisions (bf16 LoRA's default is on, FP8's off until measured): like for like
    recompute: str = "off"


CASES = {
    "8b-lora": [Case("8b-lora", "llama-8b", "lora", 1024, 4)],
    "3b-full": [Case("3b-full", "llama-3b", "full", 2048, 4)],
    # both precisions eager: what compiling the blocks (the default) is worth to each
    "8b-lora-eager": [Case("8b-lora-eager", "llama-8b", "lora", 1024, 4, compile="off")],
    # both recomputing the blocks' elementwise work: FP8 LoRA's memory beside bf16's default
    "8b-lora-recompute": [Case("8b-lora-recompute", "llama-8b", "lora", 1024, 4, recompute="on")],
}


def predicted(case: Case, profile, precision: str) -> dict:
    cal, gpu = calibration.load()[0], planner_gpu()
    w = Workload(profile, case.method, case.seq_len, case.micro_batch, steps=1, precision=precision,
                 recompute=case.recompute)
    e = estimate(w, Layout("single", 1, 1, case.micro_batch, 1, case.activation_checkpointing),
                 measured_pool(gpu, 1), cal)
    return {"step_seconds": e.step_seconds, "tokens_per_second": w.tokens_per_step / e.step_seconds,
            "peak_memory_gib": e.peak_memory_bytes / GIB}


def run_case(case: Case, precision: str, model_dir: Path, data: Path, work: Path, smoke: bool, steps: int) -> dict:
    out = work / f"{case.name}-{precision}"
    export = case.method == "full" and precision == "fp8" and not smoke
    config = {
        "name": f"{case.name}-{precision}", "output_dir": str(out), "model": {"source": str(model_dir)},
        "method": {"type": case.method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4 if case.method == "lora" else 1e-5,
                            "lr_schedule": "constant", "warmup_ratio": 0.0, "seq_len": 128 if smoke else case.seq_len,
                            "seed": 0, "global_batch_size": case.micro_batch},
        "strategy": {**one_gpu_strategy(case.micro_batch, case.activation_checkpointing, False, smoke),
                     "precision": precision},
        # (the CPU does not compile blocks, which recompute needs: the smoke checks the plumbing only)
        "kernels": {"compile": case.compile, "recompute": "off" if smoke else case.recompute},
        "checkpoint": {"final": export},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}},
    }
    row, records, stderr = run_on_ray(config, out, timeout=580)
    if "error" in row:
        return row
    steps_ = [r for r in records if r["event"] == "step"]
    row |= measured_steps(steps_[WARMUP_STEPS:]) | {"losses": [r["loss"] for r in steps_]}
    row["kernels"] = next((line.split("kernels: ", 1)[1] for line in stderr.splitlines() if "kernels: " in line), "")
    if export:  # the exported weights load in bf16 and compute finite logits
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out / "final" / "model", dtype=torch.bfloat16).cuda()
        with torch.no_grad():
            logits = model(torch.arange(16, device="cuda")[None]).logits
        row["export_loads_in_bf16"] = bool(model.dtype == torch.bfloat16 and torch.isfinite(logits).all())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-fp8"))
    parser.add_argument("--cases", nargs="+", default=["8b-lora"], choices=list(CASES))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data.jsonl"
    write_dataset(data, 2000 if not args.smoke else 100, 2500 if not args.smoke else 200)
    models = SMOKE_MODELS if args.smoke else MODELS
    steps = 8 if args.smoke else args.steps
    rows, built = [], {}
    for group in args.cases:
        for case in CASES[group]:
            profile, extra = models[case.model]
            if case.model not in built:
                built[case.model] = args.work / case.model
                build_model(profile, extra, built[case.model])
            pair = {}
            for precision in ("bf16", "fp8"):
                pair[precision] = {"case": case._asdict(), "precision": precision,
                                   "predicted": predicted(case, profile, precision),
                                   **run_case(case, precision, built[case.model], data, args.work, args.smoke, steps)}
                rows.append(pair[precision])
                print(json.dumps({k: v for k, v in pair[precision].items() if k != "losses"})[:1200], flush=True)
            if all("losses" in r for r in pair.values()):
                tails = {p: statistics.fmean(r["losses"][-TAIL:]) for p, r in pair.items()}
                speed = pair["fp8"]["tokens_per_second"] / pair["bf16"]["tokens_per_second"]
                print(f"{case.name}: fp8 {speed:.3f}x bf16 tokens/s; last {TAIL} steps' loss fp8/bf16 "
                      f"{tails['fp8'] / tails['bf16']:.4f}", flush=True)
    args.out.write_text(json.dumps({"gpu": device_name(args.smoke),
                                    "time": time.strftime("%Y-%m-%d %H:%M"), "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
