"""SM-active as the runtime reports it, against a GPM sampler of our own over the same time (issue 33).

NVML's GPM counters refresh about every 100 ms; a window read across too few refreshes reads stale
counters. This checks, on one Hopper GPU, in one invocation:

1. `sweep`: a steady matmul workload in 64 ms steps (busy most of each step, asleep the rest); the
   runtime's `GpuActivitySampler` read after every step with each minimum window in `--windows`
   (0 is the behaviour before the fix: every step its own window), against the reference sampler's 1 s
   windows over the same seconds.
2. `runs`: GPT-2 full fine-tuning (64 ms steps), logged every step, through the product's own path
   (`python -m tunewright_jobs.run --config`, Ray Train), once with the runtime under test and once with
   the one in `--before` (a checkout of the runtime before the fix, e.g. `git archive HEAD jobs`), each with
   the reference sampler running beside it. For every record that carries SM-active, the reference's
   time-weighted mean over the same span (from the last record that carried one to this one).

The reference sampler is a separate process with its own NVML session: it takes a GPM sample every
second and writes (start, end, SM-active) with wall-clock times, which the records also carry.

  python benchmarks/gpm_window_check.py --out OUT [--before .device/head/jobs] [--after jobs] [--steps 400]

writes OUT/gpm_window_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
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

REFERENCE_SECONDS = 1.0
STEP_SECONDS, BUSY_SHARE = 0.064, 0.75


def reference_sampler(path: str, stop, interval: float = REFERENCE_SECONDS) -> None:
    """GPM SM-active of GPU 0 over back-to-back `interval` windows, one JSON line each, until `stop` is set."""
    import pynvml as nvml

    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
    nvml.nvmlGpmSampleGet(handle, samples[0])
    start = time.time()
    with open(path, "w") as out:
        while not stop.is_set():
            time.sleep(max(0.0, start + interval - time.time()))
            nvml.nvmlGpmSampleGet(handle, samples[1])
            end = time.time()
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 1
            request.sample1, request.sample2 = samples
            request.metrics[0].metricId = 2  # NVML_GPM_METRIC_SM_UTIL
            nvml.nvmlGpmMetricsGet(request)
            out.write(json.dumps({"start": start, "end": end, "sm_active": request.metrics[0].value / 100}) + "\n")
            out.flush()
            samples.reverse()
            start = end
    nvml.nvmlShutdown()


class Reference:
    """The reference sampler in its own process, for the length of a `with` block."""

    def __init__(self, path: Path):
        self.path = path
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.process = context.Process(target=reference_sampler, args=(str(path), self.stop), daemon=True)

    def __enter__(self) -> Reference:
        self.process.start()
        time.sleep(2 * REFERENCE_SECONDS)
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.process.join(10)

    def windows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def reference_mean(windows: list[dict], start: float, end: float) -> float | None:
    """The reference's SM-active over [start, end], each window weighted by its overlap."""
    weighted = [(min(end, w["end"]) - max(start, w["start"]), w["sm_active"]) for w in windows]
    weighted = [(overlap, value) for overlap, value in weighted if overlap > 0]
    total = sum(overlap for overlap, _ in weighted)
    return sum(overlap * value for overlap, value in weighted) / total if total >= 0.5 * (end - start) else None


def sweep(out: Path, windows: list[float], seconds: float) -> list[dict]:
    import torch

    from tunewright_jobs.gpu_activity import GpuActivitySampler

    device = torch.device("cuda", 0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    torch.cuda.synchronize()
    started = time.perf_counter()
    matmuls = 0
    while time.perf_counter() - started < 0.5:  # how many matmuls fill the busy part of a step
        a @ b
        torch.cuda.synchronize()
        matmuls += 1
    per_step = max(1, round(matmuls / (0.5 / (STEP_SECONDS * BUSY_SHARE))))
    rows = []
    for minimum in windows:
        with Reference(out / f"reference-sweep-{minimum}.jsonl") as reference:
            sampler = GpuActivitySampler(device, min_window=minimum)
            closed, last_closed = [], time.time()
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                step_start = time.perf_counter()
                for _ in range(per_step):
                    a @ b
                torch.cuda.synchronize()
                time.sleep(max(0.0, step_start + STEP_SECONDS - time.perf_counter()))
                reading = sampler.read()
                if reading.sm_active_share is not None:
                    now = time.time()
                    closed.append((last_closed, now, reading.sm_active_share))
                    last_closed = now
            sampler.close()
        rows.append(compare(f"sweep min_window={minimum * 1e3:.0f} ms", closed, reference.windows()))
    return rows


def compare(name: str, closed: list[tuple[float, float, float]], windows: list[dict]) -> dict:
    """The reported windows against the reference over the same spans. The first two and the last are left
    out: start-up, and a reference window that runs past the end into idle time."""
    pairs = [(end - start, value, reference_mean(windows, start, end)) for start, end, value in closed[2:-1]]
    pairs = [p for p in pairs if p[2] is not None]
    if not pairs:
        return {"case": name, "windows": 0}
    total = sum(d for d, _, _ in pairs)
    return {
        "case": name, "windows": len(pairs),
        "median_window_ms": round(statistics.median(d for d, _, _ in pairs) * 1e3, 1),
        "reported_mean": round(statistics.fmean(v for _, v, _ in pairs), 4),
        "reported_time_weighted": round(sum(d * v for d, v, _ in pairs) / total, 4),
        "reference_time_weighted": round(sum(d * r for d, _, r in pairs) / total, 4),
        "median_abs_error": round(statistics.median(abs(v - r) for _, v, r in pairs), 4),
        "max_abs_error": round(max(abs(v - r) for _, v, r in pairs), 4),
        "zero_readings": sum(1 for _, v, _ in pairs if v == 0.0),
        "windows_ms_reported_reference": [(round(d * 1e3), round(v, 3), round(r, 3)) for d, v, r in pairs],
    }


def gpt2_run(out: Path, runtime: Path, steps: int, label: str, model: Path, data: Path) -> dict:
    config = {
        "name": f"gpm-{label}", "output_dir": str(out), "model": {"source": str(model)},
        "method": {"type": "full"}, "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "seq_len": 1024, "warmup_ratio": 0.0,
                            "global_batch_size": 16},
        "strategy": {"type": "single", "num_workers": 1, "use_gpu": True, "micro_batch_size": 16},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": {"enabled": False}, "gpu_activity": True},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(config, indent=2))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(runtime), str(ROOT / "core"),
                                                        os.environ.get("PYTHONPATH")]))}
    with Reference(out / "reference.jsonl") as reference:
        proc = subprocess.run([sys.executable, "-m", "tunewright_jobs.run", "--config", str(out / "job.json")],
                              env=env, capture_output=True, text=True, timeout=400)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"case": f"gpt2-full {label}", "error": (proc.stdout + proc.stderr)[-2000:]}
    steps_seen = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                  if line.strip() and json.loads(line)["event"] == "step"]
    closed, last = [], None
    for record in steps_seen:
        if record.get("sm_active_share") is not None:
            if last is not None:
                closed.append((last, record["time"], record["sm_active_share"]))
            last = record["time"]
    row = compare(f"gpt2-full {label}", closed, reference.windows())
    row["median_step_ms"] = round(statistics.median(r["step_seconds"] for r in steps_seen[5:]) * 1e3, 1)
    row["records_without_sm_active"] = sum(1 for r in steps_seen if r.get("sm_active_share") is None)
    row["why_missing"] = sorted({r["gpu_activity_unavailable"].split(":")[0] for r in steps_seen
                                 if r.get("gpu_activity_unavailable")})
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", type=Path, help="the runtime package's folder before the fix (its jobs/)")
    parser.add_argument("--after", type=Path, default=ROOT / "jobs", help="the runtime package's folder under test")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--windows", type=float, nargs="*", default=[0.0, 0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--sweep-seconds", type=float, default=12.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    from gpu_runs import MODELS, build_model, write_dataset

    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "reference_seconds": REFERENCE_SECONDS, "rows": []}

    def record(row: dict) -> None:
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out / "gpm_window_check.json").write_text(json.dumps(result, indent=2))

    for row in sweep(args.out, args.windows, args.sweep_seconds):
        record(row)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    write_dataset(work / "data.jsonl", n=3000, words_per_example=1024)
    profile, extra = MODELS["gpt2-124m"]
    build_model(profile, extra, work / "gpt2")
    torch.cuda.empty_cache()
    runtimes = [("after", args.after)] + ([("before", args.before)] if args.before else [])
    for label, runtime in runtimes:
        record(gpt2_run(work / label, runtime, args.steps, label, work / "gpt2", work / "data.jsonl"))
    print(f"\n{'case':34} {'windows':>7} {'win ms':>7} {'reported':>9} {'reference':>9} {'med err':>8} "
          f"{'max err':>8} {'zeros':>5}")
    for row in result["rows"]:
        if "reported_time_weighted" in row:
            print(f"{row['case']:34} {row['windows']:7} {row['median_window_ms']:7} "
                  f"{row['reported_time_weighted']:9} {row['reference_time_weighted']:9} "
                  f"{row['median_abs_error']:8} {row['max_abs_error']:8} {row['zero_readings']:5}")
        else:
            print(f"{row['case']:34} {json.dumps(row)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
