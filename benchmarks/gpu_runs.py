"""Measured runs of the training runtime on GPUs: the baseline, and the planner's calibration matrix.

Runs the real runtime (`python -m tunewright_jobs.run --no-ray`, under torchrun for two GPUs) on models
built from configs (random init: no weights can be downloaded) and a synthetic text dataset whose
examples fill whole rows (so attention is plain causal SDPA). Prints a table of trained tokens/s per
GPU, MFU, step time and peak memory, and writes the raw numbers as JSON (after every run, so a cut-off
call keeps what finished).

  python benchmarks/gpu_runs.py --matrix baseline --out results/     # on a machine with 2 GPUs
  python benchmarks/gpu_runs.py --matrix calibration --out results/
  python benchmarks/gpu_runs.py --matrix baseline --out /tmp/x --smoke  # tiny sizes, CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)
# name: (model family, config overrides); sizes follow GPT-2 small and Llama 3.2 1B and 3B.
MODELS = {
    "gpt2-124m": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=2048, vocab_size=50257, **NO_DROPOUT)),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, **_LLAMA3)),
    "llama-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                               num_key_value_heads=8, **_LLAMA3)),
    # Qwen2.5-0.5B's shape as a Llama (FFN 5.4x hidden, where the others have 4x or 2.7x)
    "qwen-0.5b": ("llama", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                                tie_word_embeddings=True, rope_theta=1000000.0)),
}
SMOKE_MODELS = {
    "gpt2-124m": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=512, **NO_DROPOUT)),
    "llama-1b": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)),
    "llama-3b": ("llama", dict(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)),
    "qwen-0.5b": ("llama", dict(hidden_size=64, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)),
}


class Run(NamedTuple):
    model: str
    method: str
    strategy: str
    gpus: int
    micro_batch: int
    activation_checkpointing: bool = False

    @property
    def name(self) -> str:
        return (f"{self.model}-{self.method}-{self.strategy}-{self.gpus}gpu-mb{self.micro_batch}"
                + ("-ac" if self.activation_checkpointing else ""))


MATRICES = {
    "baseline": [
        Run("gpt2-124m", "lora", "single", 1, 16), Run("gpt2-124m", "full", "single", 1, 16),
        Run("llama-1b", "lora", "single", 1, 8), Run("llama-1b", "full", "single", 1, 8),
        Run("llama-1b", "lora", "ddp", 2, 8), Run("llama-1b", "full", "ddp", 2, 8),
        Run("llama-1b", "full", "fsdp", 2, 8),
    ],
    # For the planner: sizes 124M-3B, LoRA and full, activation checkpointing on and off, several
    # micro-batches, DDP and FSDP (the baseline's runs count too).
    "calibration": [
        Run("gpt2-124m", "full", "single", 1, 4), Run("gpt2-124m", "full", "single", 1, 8, True),
        Run("gpt2-124m", "lora", "single", 1, 4, True),
        Run("llama-1b", "full", "single", 1, 2), Run("llama-1b", "full", "single", 1, 8, True),
        Run("llama-1b", "lora", "single", 1, 4, True),
        Run("llama-3b", "lora", "single", 1, 4), Run("llama-3b", "full", "single", 1, 2),
        Run("llama-3b", "full", "single", 1, 4, True),
        Run("llama-1b", "full", "ddp", 2, 4), Run("llama-1b", "full", "fsdp", 2, 4, True),
        Run("llama-3b", "full", "fsdp", 2, 4), Run("llama-3b", "lora", "ddp", 2, 4),
    ],
    # A third FFN/hidden ratio, so activation bytes per FFN unit are measured rather than assumed.
    "calibration-ffn": [
        Run("qwen-0.5b", "full", "single", 1, 8), Run("qwen-0.5b", "full", "single", 1, 8, True),
        Run("qwen-0.5b", "lora", "single", 1, 8), Run("qwen-0.5b", "full", "fsdp", 1, 8),
        Run("qwen-0.5b", "lora", "fsdp", 1, 4, True),
    ],
    # FSDP's mixed-precision path (bf16 parameters, no autocast) on one GPU, so the planner's fit set
    # holds every precision path the runtime has.
    "calibration-fsdp": [
        Run("gpt2-124m", "full", "fsdp", 1, 8), Run("llama-1b", "full", "fsdp", 1, 8),
        Run("llama-1b", "lora", "fsdp", 1, 8), Run("llama-1b", "full", "fsdp", 1, 4, True),
    ],
}


def build_model(family: str, overrides: dict, out: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from tunewright_jobs.tiny import build_tokenizer

    config = (GPT2Config if family == "gpt2" else LlamaConfig)(**overrides)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is slow on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out, chat_template=None)  # ids < 512: valid for every vocabulary here
    return sum(p.numel() for p in model.parameters())


def write_dataset(path: Path, n: int, words_per_example: int) -> None:
    rng = random.Random(0)
    vocab = ["the", "food", "staff", "room", "service", "coffee", "view", "music", "bread", "soup", "was", "great", "awful", "and", "lovely", "cold"]
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words_per_example))}) + "\n")


def model_flops_per_token(params: int, layers: int, hidden: int, seq: int, method: str) -> float:
    """REFERENCE.md: 6Ψ + 12·L·h·s for full fine-tuning, 4Ψ + 12·L·h·s for LoRA (no weight gradients)."""
    return (6 if method == "full" else 4) * params + 12 * layers * hidden * seq


def run_one(run: Run, models: dict, work: Path, seq_len: int, steps: int, smoke: bool) -> dict:
    info = models[run.model]
    out = work / run.name
    config = {
        "name": run.name.replace("_", "-"), "output_dir": str(out),
        "model": {"source": str(info["path"])},
        "method": {"type": run.method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"train": str(work / "data.jsonl"), "format": "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "seq_len": seq_len, "warmup_ratio": 0.0,
                            "global_batch_size": run.micro_batch * run.gpus},
        "strategy": {"type": run.strategy, "num_workers": run.gpus, "use_gpu": not smoke,
                     "micro_batch_size": run.micro_batch, "activation_checkpointing": run.activation_checkpointing},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(config, indent=2))
    launcher = [sys.executable, "-m", "tunewright_jobs.run"]
    if run.gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={run.gpus}", "-m",
                    "tunewright_jobs.run"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "jobs"), os.environ.get("PYTHONPATH")]))}
    if run.gpus == 1 and not smoke:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    started = time.time()
    proc = subprocess.run([*launcher, "--no-ray", "--config", str(out / "job.json")], env=env,
                          capture_output=True, text=True, timeout=420)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    row = {"name": run.name, **run._asdict(), "seq_len": seq_len, "wall_seconds": time.time() - started,
           "returncode": proc.returncode}
    if proc.returncode:
        row["error"] = (proc.stderr or proc.stdout)[-1500:]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r["event"] == "step"][3:]  # skip warm-up (allocator, cuDNN/cuBLAS setup)
    tokens_per_second = statistics.median(r["tokens_per_second"] for r in steps_)
    flops = model_flops_per_token(info["params"], info["layers"], info["hidden"], seq_len, run.method)
    row.update({
        "params": info["params"],
        "tokens_per_second": tokens_per_second,
        "tokens_per_second_per_gpu": tokens_per_second / run.gpus,
        "step_seconds_median": statistics.median(r["step_seconds"] for r in steps_),
        "forward_backward_seconds_median": statistics.median(r["forward_backward_seconds"] for r in steps_),
        "optimizer_seconds_median": statistics.median(r["optimizer_seconds"] for r in steps_),
        "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in steps_),
        "peak_memory_reserved_gib": max(r.get("peak_memory_reserved_gib", 0.0) for r in steps_),
        "mfu": tokens_per_second / run.gpus * flops / 989e12,  # H200 dense bf16 datasheet peak
        "steps_measured": len(steps_),
    })
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-bench"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script")
    parser.add_argument("--matrix", choices=sorted(MATRICES), default="baseline")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    seq_len = 128 if args.smoke else 2048
    runs = MATRICES[args.matrix]
    if args.smoke:
        runs = [run._replace(micro_batch=2) for run in runs]
    write_dataset(args.work / "data.jsonl", n=400 if args.smoke else 3000, words_per_example=seq_len)

    models = {}
    needed = {run.model for run in runs}
    for name, (family, overrides) in (SMOKE_MODELS if args.smoke else MODELS).items():
        if name not in needed:
            continue
        path = args.work / name
        params = build_model(family, overrides, path)
        layers = overrides.get("n_layer") or overrides["num_hidden_layers"]
        hidden = overrides.get("n_embd") or overrides["hidden_size"]
        models[name] = {"path": path, "params": params, "layers": layers, "hidden": hidden}
        print(f"built {name}: {params / 1e6:.0f}M parameters", flush=True)

    import torch

    environment = {"torch": torch.__version__, "cuda": torch.version.cuda,
                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   "gpus_visible": torch.cuda.device_count()}
    rows = []
    for run in runs:
        if run.gpus > max(1, environment["gpus_visible"]) and not args.smoke:
            rows.append({"name": run.name, "skipped": f"needs {run.gpus} GPUs"})
            continue
        row = run_one(run, models, args.work, seq_len, args.steps, args.smoke)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        if "error" in row:
            print(row["error"], flush=True)
        (args.out / f"gpu_{args.matrix}.json").write_text(
            json.dumps({"matrix": args.matrix, "steps": args.steps, "environment": environment, "runs": rows},
                       indent=2))

    print(f"\n{'run':40} {'tok/s/GPU':>10} {'MFU':>6} {'peak GiB':>9} {'step s':>7}")
    for row in rows:
        if "tokens_per_second" in row:
            print(f"{row['name']:40} {row['tokens_per_second_per_gpu']:>10,.0f} {row['mfu']:>6.1%} "
                  f"{row['peak_memory_gib']:>9.1f} {row['step_seconds_median']:>7.3f}")
        else:
            status = row.get("skipped") or f"FAILED (exit {row.get('returncode')})"
            print(f"{row['name']:40} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
