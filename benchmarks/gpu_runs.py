"""Measured runs of the training runtime on GPUs: the planner's calibration matrix and the 8B scale runs.

Runs the real runtime (`python -m tunewright_jobs.run --no-ray`, under torchrun for several GPUs) on
models built from configs (random init: no weights can be downloaded) and a synthetic text dataset whose
examples fill whole rows (so attention is plain causal SDPA). One-GPU runs go two at a time when two GPUs
are visible (one per GPU; offloaded runs alone, since they share the host's cores). Each run's last
steps are profiled for the measured communication share; timings are medians of the steps between the
warm-up and that window. Prints a table and writes the raw numbers as JSON after every run (so a cut-off
call keeps what finished).

  python benchmarks/gpu_runs.py --matrix calibration --out results/   # on a machine with 2 GPUs
  python benchmarks/gpu_runs.py --matrix calibration-2gpu --out results/
  python benchmarks/gpu_runs.py --matrix scale-8b --out results/
  python benchmarks/gpu_runs.py --matrix calibration --out /tmp/x --smoke  # tiny sizes, CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))
sys.path.insert(0, str(ROOT / "fitting"))

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.estimate import estimate  # noqa: E402
from tunewright_core.planner.hardware import GIB, GPU, GPUS, gpu_from_product_name  # noqa: E402
from tunewright_core.planner.models import ModelProfile, hf_config  # noqa: E402
from tunewright_fit.calibration_fit import MEASURED_MODELS, measured_pool, run_setup  # noqa: E402

PEAK_FLOPS = GPUS["H200"].bf16_flops  # dense bf16 datasheet peak: the MFU denominator
# The shapes are the planner's profiles (calibration_fit.MEASURED_MODELS, which the fit reads the results
# with); beside them, what a profile leaves out: the position range and RoPE base, and GPT-2's dropout.
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
_LLAMA3 = dict(max_position_embeddings=4096, rope_theta=500000.0)
MODELS: dict[str, tuple[ModelProfile, dict]] = {name: (MEASURED_MODELS[name], extra) for name, extra in {
    "gpt2-124m": NO_DROPOUT,
    "llama-1b": _LLAMA3,
    "llama-3b": _LLAMA3,
    "qwen-0.5b": dict(max_position_embeddings=4096, rope_theta=1000000.0),
    "llama-8b": dict(max_position_embeddings=8192, rope_theta=500000.0),
}.items()}
_SMALL = dict(max_position_embeddings=256)
SMOKE_MODELS: dict[str, tuple[ModelProfile, dict]] = {
    "gpt2-124m": (ModelProfile("gpt2-smoke", 2, 64, 4, 4, 256, 512, True, gated_mlp=False, max_positions=256),
                  NO_DROPOUT),
    "llama-1b": (ModelProfile("llama-1b-smoke", 2, 64, 4, 2, 128, 512, False), _SMALL),
    "llama-3b": (ModelProfile("llama-3b-smoke", 3, 96, 4, 2, 128, 512, False), _SMALL),
    "qwen-0.5b": (ModelProfile("qwen-0.5b-smoke", 2, 64, 4, 2, 352, 512, False), _SMALL),
    "llama-8b": (ModelProfile("llama-8b-smoke", 2, 128, 4, 2, 256, 512, False), dict(max_position_embeddings=512)),
}


class Run(NamedTuple):
    model: str
    method: str
    strategy: str
    gpus: int
    micro_batch: int
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    seq_len: int = 2048
    hsdp_shard: int = 0  # GPUs per HSDP shard group
    data: str = "fixed"  # rows of seq_len tokens, or "variable": chats of many lengths, packed (vs_hf.py's)

    @property
    def name(self) -> str:
        return (f"{self.model}-{self.method}-{self.strategy}-{self.gpus}gpu"
                + (f"-g{self.hsdp_shard}" if self.hsdp_shard else "") + f"-mb{self.micro_batch}"
                + ("-ac" if self.activation_checkpointing else "") + ("-offload" if self.cpu_offload else "")
                + (f"-s{self.seq_len}" if self.seq_len != 2048 else "") + ("-var" if self.data == "variable" else ""))


MATRICES = {
    # For the planner: sizes 124M-3B, LoRA and full, activation checkpointing on and off, several
    # micro-batches, single, DDP and FSDP, CPU offload. The fit set is the one-GPU runs of the two smallest
    # models; everything else is held out.
    "calibration": [
        Run("gpt2-124m", "full", "single", 1, 16), Run("gpt2-124m", "lora", "single", 1, 16),
        Run("gpt2-124m", "full", "single", 1, 8, True), Run("gpt2-124m", "lora", "single", 1, 4, True),
        Run("llama-1b", "full", "single", 1, 8), Run("llama-1b", "lora", "single", 1, 8),
        Run("llama-1b", "full", "single", 1, 2), Run("llama-1b", "full", "single", 1, 8, True),
        Run("llama-1b", "lora", "single", 1, 4, True),
        Run("llama-3b", "lora", "single", 1, 4), Run("llama-3b", "full", "single", 1, 2),
        Run("llama-3b", "full", "single", 1, 4, True), Run("llama-3b", "lora", "single", 1, 8, True),
        Run("qwen-0.5b", "full", "single", 1, 8), Run("qwen-0.5b", "lora", "single", 1, 4, True),
        Run("llama-1b", "full", "single", 1, 8, False, True), Run("llama-3b", "full", "single", 1, 4, False, True),
        # packed variable-length rows (held out): documents of many lengths share a row
        Run("llama-1b", "lora", "single", 1, 8, data="variable"), Run("llama-1b", "full", "single", 1, 8, data="variable"),
        Run("qwen-0.5b", "full", "single", 1, 8, data="variable"),
    ],
    "calibration-2gpu": [
        Run("llama-1b", "lora", "ddp", 2, 8), Run("llama-1b", "full", "ddp", 2, 8),
        Run("llama-1b", "full", "fsdp", 2, 8), Run("llama-3b", "full", "fsdp", 2, 4),
        Run("llama-3b", "lora", "ddp", 2, 4), Run("llama-3b", "lora", "fsdp", 2, 4),
    ],
    # An ~8B Llama (Llama 3.1 8B's shape) at two sequence lengths (issue 5): full FSDP, full hybrid shard in
    # two groups and LoRA DDP on 2, 4 and 8 GPUs, LoRA on one for scaling. Full fine-tuning of 8B does not
    # fit one H200 without offload; two groups of one GPU would be DDP, so HSDP starts at 4. Runs needing
    # more GPUs than are visible are recorded as skipped.
    "scale-8b": [
        Run("llama-8b", "lora", "single", 1, 4), Run("llama-8b", "lora", "single", 1, 2, seq_len=4096),
        *[run for gpus in (2, 4, 8) for run in (
            Run("llama-8b", "lora", "ddp", gpus, 4), Run("llama-8b", "lora", "ddp", gpus, 2, seq_len=4096),
            Run("llama-8b", "full", "fsdp", gpus, 2), Run("llama-8b", "full", "fsdp", gpus, 1, seq_len=4096),
            *([Run("llama-8b", "full", "hsdp", gpus, 2, hsdp_shard=gpus // 2),
               Run("llama-8b", "full", "hsdp", gpus, 1, seq_len=4096, hsdp_shard=gpus // 2)] if gpus >= 4 else []),
        )],
    ],
}


def build_model(profile: ModelProfile, extra: dict, out: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunewright_jobs.tiny import build_tokenizer

    fields = hf_config(profile)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, **extra)
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


def runtime_env(devices: str | None = None) -> dict[str, str]:
    """A child process's environment: this checkout's runtime importable, on the GPUs named (default: all)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "jobs"), str(ROOT / "core"),
                                                        os.environ.get("PYTHONPATH")]))}
    return env | ({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {})


@contextmanager
def environment(env: dict[str, str | None]):
    """`env` in this process while the block runs (the runtime's children inherit it; None unsets a
    variable), then as it was."""
    saved = {key: os.environ.get(key) for key in env}
    try:
        for key, value in env.items():
            _set(key, value)
        yield
    finally:
        for key, value in saved.items():
            _set(key, value)


def _set(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def launch_runtime(config: dict, out: Path, gpus: int, timeout: float,
                   devices: str | None = None, ray: bool = False) -> subprocess.CompletedProcess:
    """Write `config` to out/job.json and run the runtime on it: through Ray Train as the product runs it
    (`ray`: a Ray of its own, one worker per GPU), or without Ray (under torchrun on several GPUs); its
    output is kept in out/log.txt."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(config, indent=2))
    launcher = [sys.executable, "-m", "tunewright_jobs.run"]
    if gpus > 1 and not ray:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "-m",
                    "tunewright_jobs.run"]
    proc = subprocess.run([*launcher, *([] if ray else ["--no-ray"]), "--config", str(out / "job.json")],
                          env=runtime_env(devices), capture_output=True, text=True, timeout=timeout)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return proc


PROFILED_STEPS = 3  # the last steps of a run: the communication-share window
WARMUP_STEPS = 3  # allocator growth, cuBLAS/NCCL setup


def one_gpu_strategy(micro_batch: int, activation_checkpointing: bool, cpu_offload: bool, smoke: bool) -> dict:
    """A job config's `strategy` for one GPU (or, in a smoke run, the CPU: offload needs a GPU)."""
    return {"type": "single", "num_workers": 1, "use_gpu": not smoke, "micro_batch_size": micro_batch,
            "activation_checkpointing": activation_checkpointing, "cpu_offload": cpu_offload and not smoke}


def device_name(smoke: bool) -> str:
    """What a check ran on, as its result file records it: the GPU's own name (not the card the check was
    written for: a session may be lent another)."""
    if smoke:
        return "cpu (smoke)"
    import torch

    return torch.cuda.get_device_name(0)


def planner_gpu() -> GPU:
    """The card a check runs on as the planner models one of it, so that its predictions are for that card (the
    H200's calibration on the CPU, and on a card the catalog does not know)."""
    import torch

    name = gpu_from_product_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    return calibration.for_gpu(name) if name else calibration.load()[1]


def measured_steps(measured: list[dict]) -> dict:
    """Trained tokens over the measured steps' time, their median step, their peak memory."""
    return {"tokens_per_second": sum(r["tokens"] for r in measured) / sum(r["step_seconds"] for r in measured),
            "step_seconds_median": statistics.median(r["step_seconds"] for r in measured),
            "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in measured)}


def run_on_ray(config: dict, out: Path, timeout: float) -> tuple[dict, list[dict], str]:
    """One run on one GPU through Ray Train, as the product runs it: (a row holding its wall time, or its error;
    its metrics records; what it printed on stderr)."""
    started = time.time()
    try:
        proc = launch_runtime(config, out, 1, timeout=timeout, ray=True)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}, [], ""
    row: dict = {"wall_seconds": time.time() - started}
    if proc.returncode:
        return row | {"error": (proc.stderr or proc.stdout)[-2500:]}, [], proc.stderr
    return row, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stderr


def run_one(run: Run, models: dict, work: Path, steps: int, smoke: bool, devices: str | None,
            ray: bool = False) -> dict:
    info = models[run.model]
    seq_len = 128 if smoke else run.seq_len
    out = work / run.name
    config = {
        "name": run.name.replace("_", "-"), "output_dir": str(out),
        "model": {"source": str(info["path"])},
        "method": {"type": run.method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"train": str(work / ("variable.jsonl" if run.data == "variable" else "data.jsonl")),
                    "format": "chat" if run.data == "variable" else "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "seq_len": seq_len, "warmup_ratio": 0.0,
                            "global_batch_size": run.micro_batch * run.gpus},
        "strategy": {"type": run.strategy, "num_workers": run.gpus, "use_gpu": not smoke,
                     "micro_batch_size": run.micro_batch, "activation_checkpointing": run.activation_checkpointing,
                     "cpu_offload": run.cpu_offload and not smoke,
                     **({"hsdp_shard_size": run.hsdp_shard} if run.hsdp_shard else {})},
        # the calibration's activation terms are what a block keeps without recompute (the planner scales them
        # by RECOMPUTE_ACTIVATION_SHARE where the runtime turns it on)
        "kernels": {"recompute": "off"},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1,
                    "profile": {"first_step": steps - PROFILED_STEPS, "steps": PROFILED_STEPS, "every_steps": 0}},
    }
    started = time.time()
    try:
        proc = launch_runtime(config, out, run.gpus, timeout=240, devices=devices, ray=ray)
    except subprocess.TimeoutExpired as err:
        return {"name": run.name, **run._asdict(), "returncode": None, "error": f"timed out: {err}"}
    row = {"name": run.name, **run._asdict(), "seq_len": seq_len, "wall_seconds": time.time() - started,
           "returncode": proc.returncode, "devices": devices}
    if proc.returncode:
        row["error"] = (proc.stderr or proc.stdout)[-1500:]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r["event"] == "step"][WARMUP_STEPS:steps - PROFILED_STEPS]
    comm = [r for r in records if r["event"] == "comm"]
    tokens_per_second = statistics.median(r["tokens_per_second"] for r in steps_)
    flops = info["profile"].flops_per_token(seq_len, run.method)
    row.update({
        "params": info["params"],
        "tokens_per_second": tokens_per_second,
        "tokens_per_second_per_gpu": tokens_per_second / run.gpus,
        "step_seconds_median": statistics.median(r["step_seconds"] for r in steps_),
        "forward_backward_seconds_median": statistics.median(r["forward_backward_seconds"] for r in steps_),
        "optimizer_seconds_median": statistics.median(r["optimizer_seconds"] for r in steps_),
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in steps_),
        "peak_memory_reserved_gib": max((r.get("peak_memory_reserved_gib") or 0.0) for r in steps_),
        "mfu": tokens_per_second / run.gpus * flops / PEAK_FLOPS,
        "steps_measured": len(steps_),
        "tokens_per_step_median": statistics.median(r["tokens"] for r in steps_),
    })
    if run.data == "variable":  # what packing and the attention over documents cost depend on
        from vs_hf import token_lengths

        lengths = token_lengths(info["path"], work / "variable.jsonl", "chat", seq_len)
        row["document_tokens"] = {"mean": statistics.fmean(lengths), "median": statistics.median(lengths),
                                  "mean_square": statistics.fmean(n * n for n in lengths), "max": max(lengths)}
    if comm:
        row.update({k: comm[-1][k] for k in ("comm_share", "comm_share_exposed", "comm_seconds_per_step",
                                             "exposed_comm_seconds_per_step", "profiled_step_seconds")})
    return row


def predictions(runs: list[Run], measured_json: Path | None) -> str:
    """Markdown: the planner's prediction for each run on H200s, and the measurement where there is one."""
    cal, gpu = calibration.load()
    measured = {}
    if measured_json is not None:
        measured = {r["name"]: r for r in json.loads(measured_json.read_text())["runs"] if "tokens_per_second" in r}
    lines = ["| run | predicted tok/s/GPU | measured | error | predicted peak GiB | measured | predicted comm "
             "(total / exposed) | measured |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        w, layout = run_setup(run._asdict())
        e = estimate(w, layout, measured_pool(gpu, run.gpus), cal)
        speed = w.tokens_per_step / e.step_seconds / run.gpus
        m = measured.get(run.name)
        got = (f"{m['tokens_per_second_per_gpu']:,.0f} | {speed / m['tokens_per_second_per_gpu'] - 1:+.1%} | "
               if m else "not run | | ")
        mem = f"{m['peak_memory_gib']:.1f}" if m else ""
        comm = f"{m['comm_share']:.1%} / {m['comm_share_exposed']:.1%}" if m and "comm_share" in m else ""
        lines.append(f"| {run.name} | {speed:,.0f} | {got}{e.peak_memory_bytes / GIB:.1f} | {mem} | "
                     f"{e.comm_share:.1%} / {e.exposed_comm_share:.1%} | {comm} |")
    return "\n".join(lines)


def selected(runs: list[Run], only: list[str] | None) -> list[Run]:
    """The runs `--only` names: exact names, or NAME* for every run whose name starts with NAME."""
    return [r for r in runs if not only or any(
        r.name.startswith(o[:-1]) if o.endswith("*") else r.name == o for o in only)]


def _gpus(runs: list[Run]) -> str:
    counts = sorted({run.gpus for run in runs})
    return f"{len(runs)} runs on {counts[0]}{f'-{counts[-1]}' if len(counts) > 1 else ''} GPU{'s' if counts[-1] > 1 else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tunewright-bench"))
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU: checks the script")
    parser.add_argument("--matrix", choices=sorted(MATRICES), default="calibration",
                        help="the runs: " + "; ".join(f"{name} ({_gpus(runs)})" for name, runs in MATRICES.items())
                        + " (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--only", nargs="*", help="run names to run, of the matrix (NAME* for every run whose name "
                                                  "starts with NAME)")
    parser.add_argument("--predict", action="store_true",
                        help="no runs: the planner's predictions for the matrix (beside --out's measured JSON, if any)")
    args = parser.parse_args()
    if args.predict:
        measured = args.out / f"gpu_{args.matrix}_h200.json"
        print(predictions(MATRICES[args.matrix], measured if measured.exists() else None))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    runs = selected(MATRICES[args.matrix], args.only)
    if args.smoke:
        runs = [run._replace(micro_batch=2) for run in runs]
    longest = 128 if args.smoke else max(run.seq_len for run in runs)
    write_dataset(args.work / "data.jsonl", n=400 if args.smoke else 3000, words_per_example=longest)
    if any(run.data == "variable" for run in runs):
        from vs_hf import write_variable

        write_variable(args.work / "variable.jsonl", 200 if args.smoke else 2500, longest)

    models = {}
    needed = {run.model for run in runs}
    for name, (profile, extra) in (SMOKE_MODELS if args.smoke else MODELS).items():
        if name not in needed:
            continue
        path = args.work / name
        params = build_model(profile, extra, path)
        models[name] = {"path": path, "params": params, "profile": profile}
        print(f"built {name}: {params / 1e6:.0f}M parameters", flush=True)

    import torch

    visible = torch.cuda.device_count()
    environment = {"torch": torch.__version__, "cuda": torch.version.cuda,
                   "gpu": torch.cuda.get_device_name(0) if visible else "cpu", "gpus_visible": visible,
                   "cpus": os.cpu_count()}
    rows: dict[str, dict] = {}

    def record(row: dict) -> None:
        rows[row["name"]] = row
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        if "error" in row:
            print(row["error"], flush=True)
        ordered = [rows[r.name] for r in runs if r.name in rows]
        (args.out / f"gpu_{args.matrix}.json").write_text(
            json.dumps({"matrix": args.matrix, "steps": args.steps, "environment": environment, "runs": ordered},
                       indent=2))

    # one-GPU runs in parallel, one per visible GPU (offloaded ones alone: they share the host)
    free_gpus: queue.Queue[str] = queue.Queue()
    for index in range(max(1, visible)):
        free_gpus.put(str(index))

    def on_free_gpu(run: Run) -> None:
        device = free_gpus.get()
        try:
            record(run_one(run, models, args.work, args.steps, args.smoke, None if args.smoke else device))
        finally:
            free_gpus.put(device)

    parallel = [r for r in runs if r.gpus == 1 and not r.cpu_offload]
    with ThreadPoolExecutor(max_workers=1 if args.smoke else max(1, visible)) as pool:
        list(pool.map(on_free_gpu, parallel))
    for run in runs:
        if run in parallel:
            continue
        if run.gpus > max(1, visible) and not args.smoke:
            record({"name": run.name, "skipped": f"needs {run.gpus} GPUs"})
            continue
        devices = None if args.smoke else ",".join(str(i) for i in range(run.gpus))
        record(run_one(run, models, args.work, args.steps, args.smoke, devices))
    rows = [rows[r.name] for r in runs if r.name in rows]

    print(f"\n{'run':44} {'tok/s/GPU':>10} {'MFU':>6} {'peak GiB':>9} {'step s':>7} {'comm':>6} {'exposed':>8}")
    for row in rows:
        if "tokens_per_second" in row:
            print(f"{row['name']:44} {row['tokens_per_second_per_gpu']:>10,.0f} {row['mfu']:>6.1%} "
                  f"{row['peak_memory_gib']:>9.1f} {row['step_seconds_median']:>7.3f} "
                  f"{row.get('comm_share', 0):>6.1%} {row.get('comm_share_exposed', 0):>8.1%}")
        else:
            status = row.get("skipped") or f"FAILED (exit {row.get('returncode')})"
            print(f"{row['name']:40} {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
