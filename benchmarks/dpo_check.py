"""DPO on one GPU through the product's path (Ray Train), beside SFT on the same model and data size, and
beside the planner's predictions of both (issue 36: the planner's DPO terms, checked on the H200; not
fitted on these runs).

  python benchmarks/dpo_check.py --out OUT [--steps 20] [--model llama-1b]

Per run: median step time, tokens/s (both answers of each pair), peak memory, and for DPO the last logged
preference accuracy and reward margin. Writes OUT/dpo_check.json after every run and prints a table with
the measured and predicted DPO/SFT step-time ratios.
"""

from __future__ import annotations

import argparse
import json
import random
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

from gpu_runs import MODELS, SMOKE_MODELS, build_model, planner_gpu, runtime_env  # noqa: E402

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.estimate import Layout, Workload, estimate  # noqa: E402
from tunewright_fit.calibration_fit import measured_pool  # noqa: E402

WARMUP = 5
WORDS = ["the", "food", "staff", "room", "service", "coffee", "view", "music", "bread", "soup", "was", "great",
         "awful", "and", "lovely", "cold"]
# name: (method, objective, micro-batch: sequences for sft, pairs for dpo)
RUNS = {"sft-lora": ("lora", "sft", 8), "dpo-lora": ("lora", "dpo", 4),
        "sft-full": ("full", "sft", 8), "dpo-full": ("full", "dpo", 4)}


def write_data(folder: Path, words: int, n: int = 2000) -> tuple[Path, Path]:
    """Text examples for SFT; for DPO, pairs whose chosen answer starts 'great' and rejected 'awful'."""
    rng = random.Random(0)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    text, pairs = folder / "text.jsonl", folder / "pairs.jsonl"
    with text.open("w") as t, pairs.open("w") as p:
        for _ in range(n):
            t.write(json.dumps({"text": say(words)}) + "\n")
            prompt = say(words // 4)
            p.write(json.dumps({"prompt": prompt, "chosen": "great " + say(words // 2),
                                "rejected": "awful " + say(words // 2)}) + "\n")
    return text, pairs


def run(name: str, model: Path, data: dict, out: Path, steps: int, seq_len: int, gpu: bool) -> dict:
    method, objective, micro = RUNS[name]
    config = {
        "name": name, "output_dir": str(out), "model": {"source": str(model)},
        "method": {"type": method, "objective": objective, **({"dpo": {"beta": 0.1}} if objective == "dpo" else {})},
        "dataset": {"train": str(data[objective]), "format": "preference" if objective == "dpo" else "text",
                    "packing": objective == "sft"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-5 if objective == "dpo" else 1e-4,
                            "seq_len": seq_len, "warmup_ratio": 0.0, "global_batch_size": micro},
        "strategy": {"type": "single", "num_workers": 1, "use_gpu": gpu, "micro_batch_size": micro,
                     "activation_checkpointing": False},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(config, indent=2))
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "tunewright_jobs.run", "--config", str(out / "job.json")],
                          env=runtime_env(), capture_output=True, text=True, timeout=500)
    row = {"run": name, "method": method, "objective": objective, "micro_batch": micro,
           "returncode": proc.returncode, "wall_seconds": time.time() - started}
    if proc.returncode:
        row["error"] = (proc.stdout + proc.stderr)[-2000:]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [r for r in records if r["event"] == "step"]
    steady = logged[WARMUP:]
    row.update(step_seconds_median=statistics.median(r["step_seconds"] for r in steady),
               tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
               peak_memory_gib=max(r.get("peak_memory_gib") or 0.0 for r in steady),
               preference_accuracy=logged[-1].get("preference_accuracy"),
               reward_margin=logged[-1].get("reward_margin"))
    return row


def predicted(profile, name: str, seq_len: int) -> dict:
    method, objective, micro = RUNS[name]
    cal, gpu = calibration.load()[0], planner_gpu()
    e = estimate(Workload(profile, method, seq_len, micro, steps=1, objective=objective, recompute="auto",
                          # sft keeps the spec's default dropout (0.05); dpo turns it off
                          lora_dropout=method == "lora" and objective == "sft"),
                 Layout("single", 1, 1, micro, 1, False), measured_pool(gpu, 1), cal)
    return {"predicted_step_seconds": e.step_seconds, "predicted_peak_memory_gib": e.peak_memory_bytes / 2**30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    parser.add_argument("--smoke", action="store_true", help="the model's small stand-in, on the CPU if no GPU")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    profile, extra = (SMOKE_MODELS if args.smoke else MODELS)[args.model]
    model = work / args.model
    build_model(profile, extra, model)
    text, pairs = write_data(work, words=args.seq_len // 3)  # about seq_len / 2 tokens a pair's answer
    rows = []
    for name in args.runs:
        row = run(name, model, {"sft": text, "dpo": pairs}, work / name, args.steps, args.seq_len, gpu)
        row.update(predicted(profile, name, args.seq_len))
        rows.append(row)
        (args.out / "dpo_check.json").write_text(json.dumps({"model": args.model, "seq_len": args.seq_len,
                                                            "steps": args.steps, "rows": rows}, indent=2) + "\n")
    print(f"{'run':9} {'micro':>5} {'step s':>8} {'pred s':>8} {'tok/s':>9} {'GiB':>6} {'pred GiB':>8} "
          f"{'pref acc':>8} {'margin':>7}")
    for r in rows:
        if r["returncode"]:
            print(f"{r['run']:9} failed: {r['error'][-600:]}")
            continue
        acc, margin = r["preference_accuracy"], r["reward_margin"]
        print(f"{r['run']:9} {r['micro_batch']:5} {r['step_seconds_median']:8.3f} {r['predicted_step_seconds']:8.3f} "
              f"{r['tokens_per_second']:9,.0f} {r['peak_memory_gib']:6.1f} {r['predicted_peak_memory_gib']:8.1f} "
              f"{'-' if acc is None else format(acc, '.2f'):>8} {'-' if margin is None else format(margin, '.3f'):>7}")
    done = {r["run"]: r for r in rows if not r["returncode"]}
    for method in ("lora", "full"):
        sft, dpo = done.get(f"sft-{method}"), done.get(f"dpo-{method}")
        if sft and dpo:  # per pair against per sequence: the same tokens per answer-pair as two sequences
            print(f"{method}: DPO/SFT step time per sequence measured "
                  f"{dpo['step_seconds_median'] / (2 * dpo['micro_batch']) / (sft['step_seconds_median'] / sft['micro_batch']):.2f}, "
                  f"predicted {dpo['predicted_step_seconds'] / (2 * dpo['micro_batch']) / (sft['predicted_step_seconds'] / sft['micro_batch']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
