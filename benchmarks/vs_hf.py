"""tunewright's runtime against Hugging Face Trainer + PEFT, plain and with Liger kernels, on the same GPU in
one invocation: the same model (built from a config: random init), the same tokens and loss masks, sequence
length, micro-batch, bf16, SDPA and fused AdamW. Prints trained (non-padding) tokens/s, MFU, peak memory,
the ratios against the stronger baseline and whether the loss curves agree; writes the raw numbers as JSON
after every run (a cut-off call keeps what finished).

Systems: `hf`, `hf+liger` (`Trainer(..., use_liger_kernel=True)`), `unsloth` (2026.10.9 with unsloth_zoo, trl, datasets
and a bitsandbytes slimmed to the GPU's CUDA, carried to the GPU machine as wheels; SDPA there: flash-attn is
not in the image; its defaults, offloaded gradient checkpointing) and `unsloth-no-ckpt` (the same without
checkpointing: its fastest, issue 35's like-for-like bar), `tunewright` (its defaults: every fast path on), and the levers one by one for the accounting: `tw-plain` (all off: the runtime before them),
`tw-fused` (+ fused linear cross-entropy), `tw-fused-varlen` (+ varlen attention; + compile = `tunewright`), and
`tw-recompute` (`tunewright` + `kernels.recompute: on`: its compiled blocks recompute their elementwise work in
backward, keeping a third fewer activations; the default for bf16 LoRA sft since 2026-12-05, so there the same
as `tunewright`); `tw-fp8` (`strategy.precision: fp8`: another precision, so its ratios are reported apart).

  python benchmarks/vs_hf.py --out benchmarks/results/vs_hf_h200.json                 # every case
  python benchmarks/vs_hf.py --out ... --cases llama1b-full gpt2-full --systems tunewright hf
  python benchmarks/vs_hf.py --out /tmp/smoke.json --smoke    # tiny models on the CPU: checks the script

Data: fixed-length rows (text examples that fill the row) and variable-length chat examples (log-normal,
median about 950 tokens, a tail cut at 2048: HF pads each batch to its longest, tunewright packs rows).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_runs import MODELS, PEAK_FLOPS, SMOKE_MODELS, build_model, launch_runtime, runtime_env  # noqa: E402
from hf_baseline import UNSLOTH_SYSTEMS  # noqa: E402

WARMUP_STEPS = 6  # compilation, allocator growth, cuBLAS autotuning
STEPS = 18
LEARNING_RATE = 1e-4
SEED = 0


class Case(NamedTuple):
    model: str
    method: str
    seq_len: int
    micro_batch: int
    data: str  # "fixed" (rows of seq_len tokens) or "variable" (chat examples of many lengths)
    gpus: int = 1
    strategy: str = "single"


CASES = {
    "gpt2-full": Case("gpt2-124m", "full", 1024, 32, "fixed"),
    "llama1b-full": Case("llama-1b", "full", 2048, 8, "fixed"),
    "llama1b-lora": Case("llama-1b", "lora", 2048, 8, "fixed"),
    "llama1b-lora-variable": Case("llama-1b", "lora", 2048, 8, "variable"),
    "llama8b-lora": Case("llama-8b", "lora", 1024, 4, "fixed"),
    "llama8b-full-fsdp-2gpu": Case("llama-8b", "full", 2048, 2, "fixed", gpus=2, strategy="fsdp"),
}
TW_SYSTEMS = {  # job config sections over the runtime's defaults
    "tunewright": {},
    "tw-plain": {"model": {"attn_implementation": "sdpa"}, "kernels": {"fused_loss": "off", "compile": "off"}},
    "tw-fused": {"model": {"attn_implementation": "sdpa"}, "kernels": {"compile": "off"}},
    "tw-fused-varlen": {"kernels": {"compile": "off"}},
    "tw-recompute": {"kernels": {"recompute": "on"}},  # + fewer activations kept (kernels.recompute)
    "tw-fp8": {"strategy": {"precision": "fp8"}},  # the blocks' products in FP8 (opt-in; a GPU of Hopper's kind)
}
HF_SYSTEMS = ("hf", "hf+liger", *UNSLOTH_SYSTEMS)  # hf_baseline.py runs each
SYSTEMS = (*TW_SYSTEMS, *HF_SYSTEMS)
DEFAULT_SYSTEMS = ("tunewright", "tw-plain", "hf", "hf+liger")


# --- data --------------------------------------------------------------------------------------------

WORDS = ["the", "food", "staff", "room", "service", "coffee", "view", "music", "bread", "soup", "was", "great",
         "awful", "and", "lovely", "cold", "we", "asked", "for", "a", "table", "near", "window", "it"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_fixed(path: Path, n: int, seq_len: int) -> None:
    """Text examples longer than a row: each is cut to exactly seq_len tokens (no padding, no packing)."""
    rng = random.Random(SEED)
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": words(rng, seq_len + 16)}) + "\n")


def write_variable(path: Path, n: int, longest: int) -> None:
    """Instruction chats whose lengths spread as real SFT data does: log-normal in words, median 430 words
    (a quarter of the row in smoke runs), a tail up to `longest` (cut there); a third of each is the prompt
    (not trained on). With the benchmark's tokenizer a word is about two tokens: the H200 run's examples had
    a median of 956 tokens, a mean of 1,077, and 14% were cut at 2048 (the JSON records the lengths)."""
    rng = random.Random(SEED)
    median = min(430, longest // 4)
    with path.open("w") as fh:
        for _ in range(n):
            length = int(min(longest - 24, max(8, rng.lognormvariate(math.log(median), 0.75))))
            prompt = max(4, length // 3)
            fh.write(json.dumps({"messages": [
                {"role": "system", "content": "Answer the question."},
                {"role": "user", "content": words(rng, prompt)},
                {"role": "assistant", "content": words(rng, length - prompt)}]}) + "\n")


def token_lengths(model_dir: Path, data: Path, fmt: str, seq_len: int) -> list[int]:
    sys.path.insert(0, str(ROOT / "jobs"))
    sys.path.insert(0, str(ROOT / "core"))
    from transformers import AutoTokenizer

    from tunewright_jobs.data import read_jsonl, tokenize_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(e.input_ids) for e in tokenize_dataset(tokenizer, read_jsonl(data, fmt), fmt, seq_len,
                                                       str(data)).examples]


# --- runs --------------------------------------------------------------------------------------------


PROFILED_STEPS = 2  # the last steps, when profiled (not measured)


def run_tunewright(name: str, case: Case, system: str, model_dir: Path, data: Path, work: Path, steps: int,
                   smoke: bool, trace_dir: Path | None = None) -> dict:
    out = work / f"{name}--{system}"
    fmt = "chat" if case.data == "variable" else "text"
    profiled = case.gpus > 1 or trace_dir is not None
    config = {
        "name": f"{name}-{system}".replace("+", "-"), "output_dir": str(out),
        "model": {"source": str(model_dir), **TW_SYSTEMS[system].get("model", {})},
        "method": {"type": case.method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"train": str(data), "format": fmt},
        "hyperparameters": {"max_steps": steps, "learning_rate": LEARNING_RATE, "lr_schedule": "constant",
                            "seq_len": case.seq_len, "warmup_ratio": 0.0, "seed": SEED,
                            "global_batch_size": case.micro_batch * case.gpus},
        "strategy": {"type": case.strategy, "num_workers": case.gpus, "use_gpu": not smoke,
                     "micro_batch_size": case.micro_batch, **TW_SYSTEMS[system].get("strategy", {})},
        "kernels": TW_SYSTEMS[system].get("kernels", {}),
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": (
            {"first_step": steps - PROFILED_STEPS, "steps": PROFILED_STEPS, "every_steps": 0,
             **({"trace_dir": str(trace_dir / f"{name}--{system}")} if trace_dir else {})}
            if profiled else {"enabled": False})},
    }
    proc = launch_runtime(config, out, case.gpus, timeout=420)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r["event"] == "step"]
    measured = steps_[WARMUP_STEPS:steps - PROFILED_STEPS if profiled else steps]  # not the profiled window
    kernels = next((line.split("kernels: ", 1)[1] for line in proc.stderr.splitlines() if "kernels: " in line), "")
    row = {  # trained tokens over the time of the measured steps, as hf_baseline.py reports
        "tokens_per_second": sum(r["tokens"] for r in measured) / sum(r["step_seconds"] for r in measured),
        "step_seconds_median": statistics.median(r["step_seconds"] for r in measured),
        "trained_tokens_per_step": statistics.mean(r["tokens"] for r in measured),
        "padding_share": 1 - statistics.mean(r["tokens"] for r in measured) / (case.micro_batch * case.gpus
                                                                                * case.seq_len),
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in measured) or None,
        "peak_memory_reserved_gib": max((r.get("peak_memory_reserved_gib") or 0.0) for r in measured) or None,
        "losses": [r["loss"] for r in steps_], "steps_measured": len(measured), "kernels": kernels,
    }
    comm = [r for r in records if r["event"] == "comm"]
    if comm:
        row.update({k: comm[-1][k] for k in ("comm_share", "comm_share_exposed")})
    return row


def run_hf(name: str, case: Case, system: str, model_dir: Path, data: Path, work: Path, steps: int,
           smoke: bool = False) -> dict:
    if case.gpus > 1:
        return {"skipped": "the HF baseline here runs on one GPU"}
    if system in UNSLOTH_SYSTEMS and smoke:
        return {"skipped": "Unsloth needs a CUDA GPU"}
    out = work / f"{name}--{system}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"system": system, "model_dir": str(model_dir), "data": str(data),
            "format": "chat" if case.data == "variable" else "text", "method": case.method, "seq_len": case.seq_len,
            "micro_batch": case.micro_batch, "steps": steps, "warmup_steps": WARMUP_STEPS,
            "learning_rate": LEARNING_RATE, "seed": SEED, "work_dir": str(out)}
    (out / "case.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_baseline.py"), str(out / "case.json")],
                          env=runtime_env(), capture_output=True, text=True, timeout=420)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the comparison ----------------------------------------------------------------------------------


def loss_gap(a: list[float], b: list[float]) -> float | None:
    """Largest relative difference between two loss curves, step by step."""
    n = min(len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n], strict=True)) if n else None


def over(ours: dict, theirs: dict, speedup: str, memory_ratio: str) -> dict[str, float]:
    """`ours` against `theirs`: the tokens/s ratio and, where both measured it, the peak memory ratio."""
    ratios = {speedup: ours["tokens_per_second"] / theirs["tokens_per_second"]}
    if ours.get("peak_memory_gib") and theirs.get("peak_memory_gib"):
        ratios[memory_ratio] = ours["peak_memory_gib"] / theirs["peak_memory_gib"]
    return ratios


def summarize(rows: dict[str, dict[str, dict]], cases: dict[str, Case]) -> dict[str, dict]:
    """Per case: tunewright against the strongest baseline (HF, HF + Liger or Unsloth) and against each Unsloth
    configuration (bf16 and FP8 apart), packed against fixed rows, the levers."""
    out = {}
    for name, by_system in rows.items():
        ok = {s: r for s, r in by_system.items() if "tokens_per_second" in r}
        ours = ok.get("tunewright")
        baselines = [s for s in HF_SYSTEMS if s in ok]
        summary: dict = {}
        if ours and baselines:
            stronger = max(baselines, key=lambda s: ok[s]["tokens_per_second"])
            summary |= {"stronger_baseline": stronger} | over(ours, ok[stronger], "speedup", "memory_ratio")
        for unsloth in (u for u in UNSLOTH_SYSTEMS if u in ok):  # issue 35's bar: 1.3x at or below its memory
            for key, system in (("", "tunewright"), ("fp8_", "tw-fp8")):  # FP8 against bf16: another precision
                if system in ok:
                    summary |= over(ok[system], ok[unsloth], f"{key}speedup_over_{unsloth}",
                                    f"{key}memory_ratio_over_{unsloth}")
        if ours and "tw-fp8" in ok:
            summary["fp8_speedup"] = ok["tw-fp8"]["tokens_per_second"] / ours["tokens_per_second"]
        if ours and "tw-plain" in ok:
            summary["speedup_over_plain"] = ours["tokens_per_second"] / ok["tw-plain"]["tokens_per_second"]
            summary["loss_curve_max_rel_gap_vs_plain"] = loss_gap(ours["losses"], ok["tw-plain"]["losses"])
        out[name] = summary
    variable, fixed = rows.get("llama1b-lora-variable", {}), rows.get("llama1b-lora", {})
    for system in SYSTEMS:
        if "tokens_per_second" in variable.get(system, {}) and "tokens_per_second" in fixed.get(system, {}):
            out.setdefault("packed_vs_fixed", {})[system] = (variable[system]["tokens_per_second"]
                                                             / fixed[system]["tokens_per_second"])
    return out


def mfu(tokens_per_second: float, case: Case, profile, mean_length: float) -> float:
    """Model FLOPs (6Ψ or 4Ψ, plus attention over the documents' own length) over the dense bf16 peak."""
    attention_len = case.seq_len if case.data == "fixed" else mean_length
    return tokens_per_second / case.gpus * profile.flops_per_token(attention_len, case.method) / PEAK_FLOPS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="JSON results (merged into, when it exists)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-vs-hf"))
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), help="default: all")
    parser.add_argument("--systems", nargs="*", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script")
    parser.add_argument("--trace", type=Path, help="tunewright runs: write the last steps' profiler traces here "
                                                   "(benchmarks/trace_summary.py reads them)")
    args = parser.parse_args()
    names = args.cases or list(CASES)
    steps = 10 if args.smoke else args.steps
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    visible = torch.cuda.device_count()
    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    environment = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus_visible": visible,
                   "gpu": torch.cuda.get_device_name(0) if visible else "cpu"}
    for package in ("transformers", "peft", "liger-kernel", "triton", "unsloth"):  # liger_kernel: no __version__
        try:
            environment[package.replace("-", "_")] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # a missing baseline package is recorded, not fatal
            environment[package.replace("-", "_")] = "not installed"
    results["environment"] = environment
    # each row names the invocation that measured it: ratios hold between rows of one invocation
    invocation = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results.setdefault("invocations", {})[invocation] = {"cases": names, "systems": args.systems,
                                                         "environment": environment}
    results.update({"steps": steps, "warmup_steps": WARMUP_STEPS, "learning_rate": LEARNING_RATE})

    models: dict[str, tuple[Path, object]] = {}
    data_files: dict[tuple[str, int], tuple[Path, list[int]]] = {}
    for name in names:
        case = CASES[name]
        if case.gpus > max(1, visible) and not args.smoke:
            results["runs"][name] = {s: {"skipped": f"needs {case.gpus} GPUs, {visible} visible"}
                                     for s in args.systems}
            continue
        if args.smoke:
            case = case._replace(seq_len=128, micro_batch=2, gpus=1, strategy="single")
        if case.model not in models:
            profile, extra = (SMOKE_MODELS if args.smoke else MODELS)[case.model]
            started = time.time()
            build_model(profile, extra, args.work / case.model)
            models[case.model] = (args.work / case.model, profile)
            print(f"built {case.model} in {time.time() - started:.0f} s", flush=True)
        model_dir, profile = models[case.model]
        key = (case.data, case.seq_len)
        if key not in data_files:
            path = args.work / f"{case.data}-{case.seq_len}.jsonl"
            if case.data == "fixed":
                write_fixed(path, 64 if args.smoke else 1200, case.seq_len)
            else:
                write_variable(path, 200 if args.smoke else 2500, case.seq_len)
            data_files[key] = (path, token_lengths(model_dir, path, "chat" if case.data == "variable" else "text",
                                                   case.seq_len))
        data, lengths = data_files[key]
        mean_length = statistics.mean(lengths)
        runs = results["runs"].setdefault(name, {})
        for system in args.systems:
            started = time.time()
            if system in TW_SYSTEMS:
                row = run_tunewright(name, case, system, model_dir, data, args.work, steps, args.smoke,
                                     args.trace if system == "tunewright" else None)
            else:
                row = run_hf(name, case, system, model_dir, data, args.work, steps, args.smoke)
            row["wall_seconds"] = time.time() - started
            row["invocation"] = invocation
            if "tokens_per_second" in row:
                row["mfu"] = mfu(row["tokens_per_second"], case, profile, mean_length)
            row["case"] = case._asdict() | {"mean_example_tokens": mean_length,
                                            "median_example_tokens": statistics.median(lengths),
                                            "longest_example_tokens": max(lengths)}
            runs[system] = row
            results["summary"] = summarize(results["runs"], CASES)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
            shown = {k: v for k, v in row.items() if k not in ("losses", "error", "case")}
            print(json.dumps({"case": name, "system": system, **shown}), flush=True)
            if "error" in row:
                print(row["error"], flush=True)

    print(f"\n{'case':24} {'system':16} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'pad':>5}")
    for name, by_system in results["runs"].items():
        for system, row in by_system.items():
            if "tokens_per_second" in row:
                memory = f"{row['peak_memory_gib']:.1f}" if row.get("peak_memory_gib") else "-"
                print(f"{name:24} {system:16} {row['tokens_per_second']:>10,.0f} {row['mfu']:>6.1%} {memory:>9} "
                      f"{row.get('padding_share', 0):>5.0%}")
            else:
                print(f"{name:24} {system:16} {row.get('skipped') or 'FAILED'}")
    print("\n" + json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
