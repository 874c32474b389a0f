"""What a profiler window leaves behind (issue 13's 1% target): step times before and after one window, in
the same run, for several ways of taking it.

On the GPU machine (no Ray: the runtime under this script, one process per run):

  python benchmarks/profiler_overhead.py run --out OUT [--case gpt2-full] [--steps 150] [--window-at 40]

Each variant runs the runtime once with a single two-step profiler window at `--window-at` (or none) and
GPM reads on, logging every step. Per run: the after/before ratio (the median step time from
`window-at + 5` to the end over the median from step 10 to the window: a window that leaves nothing behind
reads as the runs without one do), the pauses (steps over twice the median, the window's own left out),
and what the window added (its two steps over the median, beside the cost the runtime itself reports in
its `comm` record). Variants, each twice, alternated:
- `off`: no window, the runtime as it ships (the heap frozen after the first step);
- `off-no-freeze`: no window, the heap left to the collector (the pauses the freeze removes);
- `window`: a window as the runtime takes it (host operators and GPU kernels);
- `window-cuda-only`: a window of GPU activity only (is tracing the host's operators the cost?).
Writes OUT/profiler_overhead.json, prints a line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))

VARIANTS = {  # name: (window, extra environment)
    "off": (False, {}),
    "off-no-freeze": (False, {"TW_PROBE_NO_GC_FREEZE": "1"}),
    "window": (True, {}),
    "window-cuda-only": (True, {"TW_PROBE_CUDA_ONLY": "1"}),
}
ORDER = ["off", "off-no-freeze", "window", "window-cuda-only", "off", "off-no-freeze", "window", "window-cuda-only"]
SPIKE = 2.0  # a step this many times the run's median: a pause


def child(config: str) -> int:
    """The runtime, with the probe's changes: the heap left unfrozen, or the window's host operators left out."""
    if os.environ.get("TW_PROBE_NO_GC_FREEZE"):
        import gc

        gc.freeze = lambda: None
    import torch

    if os.environ.get("TW_PROBE_CUDA_ONLY") and torch.cuda.is_available():  # (the CPU smoke run: as `window`)
        import torch.profiler

        real = torch.profiler.profile

        def cuda_only(*args, activities=None, **kwargs):
            return real(*args, activities=[torch.profiler.ProfilerActivity.CUDA], **kwargs)
        torch.profiler.profile = cuda_only
    from tunewright_jobs.run import main

    return main(["--no-ray", "--config", config])


def run(args) -> int:
    from gpu_runs import MODELS, SMOKE_MODELS, build_model, runtime_env, write_dataset
    from telemetry_check import CASES, job_config, records

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tw-profiler-overhead-"))
    case = CASES[args.case]
    if case.gpus != 1:
        raise SystemExit(f"--case {args.case}: this probe runs one process, the case {case.gpus}")
    if args.smoke:
        case = case._replace(seq_len=128, micro_batch=2)
    profile, extra = (SMOKE_MODELS if args.smoke else MODELS)[case.model]
    write_dataset(work / "data.jsonl", n=400 if args.smoke else 3000, words_per_example=case.seq_len)
    build_model(profile, extra, work / case.model)
    result = {"case": args.case, "steps": args.steps, "window_at": args.window_at, "runs": []}
    for i, variant in enumerate(ORDER):
        window, env = VARIANTS[variant]
        out = work / f"{i}-{variant}"
        config = job_config(variant, work / case.model, work / "data.jsonl", out, case, args.steps, "on",
                            gpu=not args.smoke)
        config["metrics"]["profile"] = ({"first_step": args.window_at, "steps": 2, "every_steps": 100} if window
                                        else {"enabled": False})
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.json").write_text(json.dumps(config))
        proc = subprocess.run([sys.executable, __file__, "child", str(out / "job.json")],
                              env=runtime_env() | env | {"TORCH_LOGS": "recompiles"},
                              capture_output=True, text=True, timeout=args.timeout)
        log = proc.stdout + proc.stderr
        if proc.returncode:
            print(variant, "FAILED", log[-2000:], flush=True)
            result["runs"].append({"variant": variant, "error": log[-1500:]})
            (args.out / "profiler_overhead.json").write_text(json.dumps(result, indent=2))
            continue
        recs = records(out)
        steps = [r["step_seconds"] for r in recs if r["event"] == "step"]
        before = statistics.median(steps[10:args.window_at])
        after = statistics.median(steps[args.window_at + 5:])
        median = statistics.median(steps[5:])
        comm = next((r for r in recs if r["event"] == "comm"), {})
        # the window's steps over what they take unprofiled (the second one also stops and reads the profiler)
        window_steps = steps[args.window_at:args.window_at + 2] if window else []
        row = {"variant": variant, "before_median_s": before, "after_median_s": after, "after_over_before": after / before,
               "pauses": [(i, round(s, 4)) for i, s in enumerate(steps[5:], 5) if s > SPIKE * median
                          and not args.window_at <= i < args.window_at + 2],
               "window_extra_s": sum(window_steps) - len(window_steps) * median if window else None,
               "window_cost_s": comm.get("window_cost_seconds"), "recompiles": log.count("Recompiling function"),
               "step_seconds": [round(s, 5) for s in steps]}
        result["runs"].append(row)
        extra = "" if not window else (f"  window +{row['window_extra_s'] * 1e3:6.0f} ms (runtime says "
                                       f"{(row['window_cost_s'] or 0) * 1e3:.0f})")
        print(f"{variant:16} before {before * 1e3:6.2f} ms  after {after * 1e3:6.2f} ms  ratio {after / before:5.3f}  "
              f"pauses {[p[1] for p in row['pauses']]}{extra}  recompiles {row['recompiles']}", flush=True)
        (args.out / "profiler_overhead.json").write_text(json.dumps(result, indent=2))
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        return child(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", default="gpt2-full")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window-at", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
