"""Tiny-model kit command line.

  python -m tunewright_jobs.tiny build --out DIR    build the tiny models (DIR/tiny-gpt2, DIR/tiny-llama), copy
                                                    the sentiment data (DIR/data), write a ready LoRA job config
  python -m tunewright_jobs.tiny demo --out DIR     ...and run it on local Ray through the runtime's CLI
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tunewright_core.records import EndRecord, StepRecord, read_records
from tunewright_jobs.tiny import DATA_DIR, build_model


def demo_config(model_dir: Path, output_dir: Path, workers: int) -> dict:
    return {
        "name": "tiny-lora-demo",
        "output_dir": str(output_dir),
        "model": {"source": str(model_dir)},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["all-linear"]}},
        "dataset": {"train": str(DATA_DIR / "train.jsonl"), "validation": str(DATA_DIR / "validation.jsonl"),
                    "format": "chat"},
        "hyperparameters": {"epochs": 8, "learning_rate": 5e-3, "lr_schedule": "cosine", "warmup_ratio": 0.05,
                            "global_batch_size": 8, "seq_len": 256, "seed": 0},
        "strategy": {"type": "ddp" if workers > 1 else "single", "num_workers": workers,
                     "micro_batch_size": 8 // workers},
        "checkpoint": {"every_steps": 50, "keep_last": 2},
        "eval": {"exact_match": True, "exact_match_max_examples": 100, "max_new_tokens": 4},
        "metrics": {"log_every_steps": 10},
    }


def build(out: Path, workers: int) -> Path:
    for kind in ("gpt2", "llama"):
        build_model(kind, out / f"tiny-{kind}")
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "validation.jsonl"):  # beside the models: what examples/ name
        shutil.copyfile(DATA_DIR / name, out / "data" / name)
    config_path = out / "job.json"
    config_path.write_text(json.dumps(demo_config(out / "tiny-gpt2", out / "run", workers), indent=2))
    return config_path


def summarize(run_dir: Path) -> str:
    """The demo's report, from the run's telemetry (the demo config evaluates with exact match)."""
    end = EndRecord.model_validate_json((run_dir / "result.json").read_text())
    speeds = [r.tokens_per_second for r in read_records(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]
    before, after = end.eval_before, end.eval_after
    return "\n".join([
        f"strategy           {end.strategy} on {end.workers} Ray workers (CPU, gloo)",
        f"optimizer steps    {end.steps}",
        f"validation loss    {before.val_loss:.3f} -> {after.val_loss:.3f}",
        f"token accuracy     {before.val_token_accuracy:.1%} -> {after.val_token_accuracy:.1%}",
        f"exact match        {before.exact_match:.1%} -> {after.exact_match:.1%}"
        f"  ({after.exact_match_examples} held-out reviews; sample answers in the log)",
        f"trained tokens/s   {sorted(speeds)[len(speeds) // 2]:,.0f} (median over logged windows)",
        f"adapter            {end.export.adapter}",
    ])


def demo(out: Path, workers: int) -> int:
    shutil.rmtree(out / "run", ignore_errors=True)  # a fresh run, not a resume of the last demo
    config_path = build(out, workers)
    log_path = out / "train.log"
    print(f"job config: {config_path}\nrunning:    python -m tunewright_jobs.run --config {config_path}\n"
          f"log:        {log_path} (Ray's and the workers' output)", flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        code = subprocess.call([sys.executable, "-m", "tunewright_jobs.run", "--config", str(config_path)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        print("".join(log_path.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        print(f"the run failed (exit {code}); full log: {log_path}", file=sys.stderr)
        return code
    print("\n=== tunewright demo: LoRA fine-tune of a tiny GPT-2 on local Ray ===")
    print(summarize(out / "run"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "demo"])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workers", type=int, default=2, help="Ray workers for the job (DDP when > 1)")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.command == "build":
        print(build(out, args.workers))
        return 0
    return demo(out, args.workers)


if __name__ == "__main__":
    sys.exit(main())
