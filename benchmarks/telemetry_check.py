"""Check the runtime's online telemetry against a trusted reference, and measure what it costs (issue 13).

On the GPU machine (no Ray: the runtime under this script, one process per run, under torchrun on two GPUs):

  python benchmarks/telemetry_check.py run --out OUT [--cases gpt2-full llama1b-lora] [--steps 110]
  python benchmarks/telemetry_check.py run --out OUT --cases llama1b-lora-ddp llama1b-full-fsdp llama1b-lora-ddp-slow

(the default: every case; those the visible GPUs cannot run are recorded as skipped).

For each case, in the same invocation and on the same GPU:
- telemetry off (no profiler windows, no GPM reads) and on (the defaults: GPM every logged step, a
  two-step profiler window every 100 steps or further apart, `metrics.profile.max_overhead`), alternated,
  `--repeats` times each. The overhead is what a long run pays: the unprofiled steps' mean time with it on
  over the mean with it off, plus each window's measured cost over the training time until the next window
  (a short run holds one window at most, so its own mean would price a window as if it came every run);
- one traced run: a profiler window at steps 11-13 with its full Chrome trace kept (one per rank), and the
  GPM shares of the same steps, for the offline comparison. A straggler case (one rank sleeps in every
  step) runs traced only: its `comm` record must name the slow rank and show the others waiting for it.
It writes OUT/telemetry_check.json and OUT/traces.tar.gz.

Offline, where the Holistic Trace Analysis package is installed (`pip install HolisticTraceAnalysis`, in a
venv of its own: it pins pandas):

  python benchmarks/telemetry_check.py analyze OUT/telemetry_check.json OUT/traces.tar.gz \
      --write benchmarks/results/telemetry_check_h200.json

compares, per traced window, the online figures with HTA's analysis of the same trace (communication
share total and exposed within 3 points; the profiler's GPU-busy share with HTA's compute + non-compute
time) and SM-active with the trace's own SM coverage (each kernel's time x the share of the SMs its grid
fills, from the trace's `blocks per SM`), and prints a table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))

from gpu_runs import MODELS, SMOKE_MODELS, build_model, environment, launch_runtime, write_dataset  # noqa: E402

from tunewright_jobs.commshare import chrome_trace_events, comm_share, kernel_time, split_events  # noqa: E402
from tunewright_jobs.train import SLOW_RANK_ENV  # noqa: E402


class Case(NamedTuple):
    model: str
    method: str
    seq_len: int
    micro_batch: int
    gpus: int = 1
    strategy: str = "single"
    slow_rank: str | None = None  # "RANK:SECONDS": that rank sleeps in every step (train.SLOW_RANK_ENV)


CASES = {
    "gpt2-full": Case("gpt2-124m", "full", 1024, 16),  # short steps: where per-step costs show most
    "llama1b-lora": Case("llama-1b", "lora", 2048, 8),
    # two GPUs, where communication overlaps compute: DDP's one all-reduce, FSDP's gathers and reductions
    "llama1b-lora-ddp": Case("llama-1b", "lora", 2048, 8, gpus=2, strategy="ddp"),
    "llama1b-full-fsdp": Case("llama-1b", "full", 2048, 8, gpus=2, strategy="fsdp"),
    # rank 1 sleeps 50 ms in every step: named as the straggler, rank 0's collectives wait for it
    "llama1b-lora-ddp-slow": Case("llama-1b", "lora", 2048, 8, gpus=2, strategy="ddp", slow_rank="1:0.05"),
}
TRACED_FIRST_STEP, TRACED_STEPS = 10, 3
WARMUP = 5  # steps left out of the overhead: compilation, allocator growth


def job_config(name: str, model_path: Path, data: Path, out: Path, case: Case, steps: int, telemetry: str,
               gpu: bool = True) -> dict:
    profile = {"enabled": False}
    if telemetry == "on":
        profile = {}  # the defaults users get
    elif telemetry == "traced":
        profile = {"first_step": TRACED_FIRST_STEP, "steps": TRACED_STEPS, "every_steps": 0,
                   "trace_dir": str(out / "traces")}
    return {
        "name": name, "output_dir": str(out), "model": {"source": str(model_path)},
        "method": {"type": case.method, "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
        "dataset": {"train": str(data), "format": "text"},
        "hyperparameters": {"max_steps": steps, "learning_rate": 1e-4, "seq_len": case.seq_len, "warmup_ratio": 0.0,
                            "global_batch_size": case.micro_batch * case.gpus},
        "strategy": {"type": case.strategy, "num_workers": case.gpus, "use_gpu": gpu,
                     "micro_batch_size": case.micro_batch},
        "checkpoint": {"final": False},
        "metrics": {"log_every_steps": 1, "profile": profile, "gpu_activity": telemetry != "off"},
    }


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def profiled_steps(recs: list[dict]) -> set[int]:
    """The 1-based steps whose records hold a profiler window's time: its steps (the first holds starting the
    profiler, the last reading its events). Their cost is the window's `window_cost_seconds`."""
    return {s for r in recs if r["event"] == "comm" for s in range(r["step"] - r["profiled_steps"] + 1, r["step"] + 1)}


def summarize_run(out: Path, telemetry: str) -> dict:
    recs = records(out)
    steps = [r for r in recs if r["event"] == "step"]
    windowed = profiled_steps(recs)
    steady = [r for r in steps[WARMUP:] if r["step"] not in windowed]
    row = {"telemetry": telemetry, "steps": len(steps),
           "mean_step_seconds": statistics.fmean(r["step_seconds"] for r in steady),
           "median_step_seconds": statistics.median(r["step_seconds"] for r in steady),
           "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steady),
           "step_seconds": [round(r["step_seconds"], 5) for r in steps],
           "sm_active": [r.get("sm_active_share") for r in steps]}
    if telemetry != "off":
        for field in ("sm_active_share", "tensor_active_share", "dram_bandwidth_share", "kernel_active_share"):
            values = [r[field] for r in steady if r.get(field) is not None]
            row[field] = statistics.fmean(values) if values else None
        row["gpu_activity_unavailable"] = steady[-1].get("gpu_activity_unavailable")
    if telemetry == "on":
        # each window's cost and where the next opens: the share of training time the windows take in a
        # long run, whatever this run's length
        row["windows"] = [{"opened": r["step"] - r["profiled_steps"], "closed": r["step"],
                           "cost_seconds": r.get("window_cost_seconds"), "next_step": r.get("next_window_step")}
                          for r in recs if r["event"] == "comm"]
    if telemetry == "traced":
        # the window's steps but its last: that step's record also covers stopping the profiler and writing
        # the trace (seconds with the GPU idle), which the trace itself does not hold
        window = [r for r in steps if TRACED_FIRST_STEP < r["step"] < TRACED_FIRST_STEP + TRACED_STEPS]
        row["window_gpm"] = {field: statistics.fmean(r[field] for r in window) if all(
            r.get(field) is not None for r in window) else None
            for field in ("sm_active_share", "tensor_active_share", "dram_bandwidth_share", "kernel_active_share")}
        row["window_comm"] = next(r for r in recs if r["event"] == "comm")
    return row


def run(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tw-telemetry-"))
    import torch

    visible = torch.cuda.device_count()
    cases = args.cases or list(CASES)
    runnable = [c for c in cases if args.smoke or CASES[c].gpus <= visible]
    if not runnable:
        print(f"no case can run on {visible} GPUs", file=sys.stderr)
        return 2
    longest = 128 if args.smoke else max(CASES[c].seq_len for c in runnable)
    write_dataset(work / "data.jsonl", n=400 if args.smoke else 3000, words_per_example=longest)
    result = {"environment": {"torch": torch.__version__,
                              "gpu": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0)},
              "steps": args.steps, "warmup_steps": WARMUP, "cases": {}}
    traces = work / "traces"
    for case in cases:
        spec = CASES[case]
        if case not in runnable:
            result["cases"][case] = {"skipped": f"needs {spec.gpus} GPUs, {visible} visible"}
            (args.out / "telemetry_check.json").write_text(json.dumps(result, indent=2))
            continue
        if args.smoke:
            spec = spec._replace(seq_len=128, micro_batch=2)
        profile, extra = (SMOKE_MODELS if args.smoke else MODELS)[spec.model]
        model_path = work / spec.model
        if not model_path.exists():
            build_model(profile, extra, model_path)
        runs = []
        # a straggler's run only shows where the time went: no overhead pairs
        order = ["traced"] if spec.slow_rank else ["off", "on"] * args.repeats + ["traced"]
        for i, telemetry in enumerate(order):
            out = work / f"{case}-{i}-{telemetry}"
            steps = TRACED_FIRST_STEP + TRACED_STEPS + 2 if telemetry == "traced" else args.steps
            config = job_config(f"{case}-{i}", model_path, work / "data.jsonl", out, spec, steps, telemetry,
                                gpu=not args.smoke)
            started = time.time()
            try:
                with environment({SLOW_RANK_ENV: spec.slow_rank}):  # the runtime's environment is this one's
                    proc = launch_runtime(config, out, spec.gpus, timeout=300, ray=args.ray)
            except subprocess.TimeoutExpired as err:
                runs.append({"telemetry": telemetry, "error": f"timed out: {err}"})
                continue
            if proc.returncode:
                print(proc.stderr[-3000:], flush=True)
                runs.append({"telemetry": telemetry, "error": proc.stderr[-1500:]})
                continue
            row = summarize_run(out, telemetry) | {"wall_seconds": time.time() - started}
            runs.append(row)
            print(case, json.dumps({k: v for k, v in row.items() if k not in ("window_comm", "step_seconds", "sm_active")}),
                  flush=True)
            if telemetry == "traced":
                (traces / case).mkdir(parents=True, exist_ok=True)
                for trace in (out / "traces").glob("*.json.gz"):
                    trace.rename(traces / case / trace.name)
        ok = [r for r in runs if "error" not in r]
        on = [r["mean_step_seconds"] for r in ok if r["telemetry"] == "on"]
        off = [r["mean_step_seconds"] for r in ok if r["telemetry"] == "off"]
        steady = statistics.fmean(on) / statistics.fmean(off) - 1 if on and off else None
        windows = window_share([r for r in ok if r["telemetry"] == "on"], statistics.fmean(off)) if off else None
        result["cases"][case] = {
            **spec._asdict(), "runs": runs,
            # what a long run pays: the unprofiled steps' slow-down (GPM reads, records) plus the windows'
            # measured cost over the steps between them
            "overhead": steady + windows if steady is not None and windows is not None else None,
            "overhead_steady_steps": steady, "overhead_windows": windows,
            # run-to-run spread of the same setting: the overhead is only as precise as this
            "spread_off": (max(off) - min(off)) / statistics.fmean(off) if len(off) > 1 else None,
            "spread_on": (max(on) - min(on)) / statistics.fmean(on) if len(on) > 1 else None}
        # after every case: a call cut short keeps what finished
        (args.out / "telemetry_check.json").write_text(json.dumps(result, indent=2))
        if traces.exists():
            with tarfile.open(args.out / "traces.tar.gz", "w:gz") as tar:
                tar.add(traces, arcname="traces")
    print(f"\n{'case':22} {'off s/step':>11} {'on s/step':>10} {'steps':>7} {'windows':>8} {'overhead':>9} "
          f"{'spread':>7} {'SM-active':>10} {'tensor':>7} {'DRAM':>6} {'kernel-active':>14}")
    for case, c in result["cases"].items():
        if "skipped" in c:
            print(f"{case:22} {c['skipped']}")
            continue
        on_runs = [r for r in c["runs"] if r.get("telemetry") == "on" and "error" not in r]
        off_runs = [r for r in c["runs"] if r.get("telemetry") == "off" and "error" not in r]
        if not on_runs or not off_runs:
            print(f"{case:22} {'traced only' if c['slow_rank'] else 'FAILED'}")
            continue
        g = on_runs[-1]
        spread = max(c["spread_off"] or 0.0, c["spread_on"] or 0.0)
        print(f"{case:22} {statistics.fmean(r['mean_step_seconds'] for r in off_runs):>11.4f} "
              f"{statistics.fmean(r['mean_step_seconds'] for r in on_runs):>10.4f} "
              f"{c['overhead_steady_steps']:>+7.2%} {_pct(c['overhead_windows']):>8} {_opt_pct(c['overhead']):>9} "
              f"{spread:>7.2%} {_pct(g.get('sm_active_share')):>10} {_pct(g.get('tensor_active_share')):>7} "
              f"{_pct(g.get('dram_bandwidth_share')):>6} {_pct(g.get('kernel_active_share')):>14}")
    print(f"\n{'traced window':22} {'comm':>6} {'exposed':>8} {'wait ms':>8} {'transfer ms':>12} {'slowest':>8} "
          f"{'rank ms min-max':>16}")
    for case, c in result["cases"].items():
        traced = next((r for r in c.get("runs", []) if r.get("telemetry") == "traced" and "error" not in r), None)
        if traced is None:
            continue
        w = traced["window_comm"]
        print(f"{case:22} {w['comm_share']:>6.1%} {w['comm_share_exposed']:>8.1%} {_ms(w['wait_seconds_per_step']):>8} "
              f"{_ms(w['transfer_seconds_per_step']):>12} {_rank(w['slowest_rank']):>8} "
              f"{_ms(w['rank_own_seconds_min']) + '-' + _ms(w['rank_own_seconds_max']):>16}")
    return 0


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def _rank(rank: int | None) -> str:
    return "n/a" if rank is None else str(rank)


def window_share(on_runs: list[dict], off_step_seconds: float) -> float | None:
    """The profiler windows' share of a long run's training time: each window's measured cost over the
    training time from its opening to the next's (at the unprofiled step time), averaged over the windows."""
    shares = [w["cost_seconds"] / ((w["next_step"] - w["opened"]) * off_step_seconds)
              for r in on_runs for w in r["windows"] if w["cost_seconds"] is not None and w["next_step"]]
    return statistics.fmean(shares) if shares else None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _opt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2%}"


# --- offline: the same windows through our arithmetic, HTA's, and the trace's SM coverage ---------------


def sm_coverage(trace: dict, sms: int) -> tuple[float, float]:
    """(share of the window with a kernel on the GPU, share of SM time the kernels' grids covered): each
    kernel counts for its duration x min(1, its blocks / the SMs), overlapping kernels added up to a cap of 1."""
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    covered = 0.0
    for e in kernels:
        args = e.get("args", {})
        per_sm = args.get("blocks per SM")
        if per_sm is None:
            grid = args.get("grid", [1, 1, 1])
            per_sm = grid[0] * grid[1] * grid[2] / sms
        covered += e["dur"] * min(1.0, float(per_sm))
    busy = kernel_time(chrome_trace_events(trace)).busy_seconds * 1e6
    return busy / (end - start), min(1.0, covered / (end - start))


def hta_breakdown(trace_dir: Path) -> dict:
    """HTA's shares of a window traced on every rank (one file each): times summed over the ranks, the
    overlap of communication with compute averaged over them."""
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=str(trace_dir))
    temporal = analysis.get_temporal_breakdown(visualize=False)  # a row per rank
    idle, compute, other = (float(temporal[f"{kind}_time(us)"].sum()) for kind in ("idle", "compute", "non_compute"))
    kernels = analysis.get_gpu_kernel_breakdown(visualize=False)[0]  # by kernel type, all ranks: COMMUNICATION, ...
    comm_us = sum(row["sum"] for _, row in kernels.iterrows() if "COMMUNICATION" in row["kernel_type"])
    total = idle + compute + other
    out = {"idle_share": idle / total, "busy_share": (compute + other) / total, "comm_share": comm_us / total,
           "ranks": len(temporal)}
    if comm_us:
        overlap = float(analysis.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].mean()) / 100
        out["comm_share_exposed"] = comm_us * (1 - overlap) / total
    else:
        out["comm_share_exposed"] = 0.0
    return out


def offline_shares(path: Path, sms: int) -> dict[str, float]:
    """One rank's trace through the runtime's own arithmetic, offline: its communication shares over the span
    of its kernels, and its busy and SM coverage shares."""
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    events = chrome_trace_events(trace)
    kernels = [e for e in events if e.kind == "kernel"]
    window_s = (max(e.end_ns for e in kernels) - min(e.start_ns for e in kernels)) / 1e9
    share = comm_share(*split_events(events), window_s)
    busy, coverage = sm_coverage(trace, sms)
    return {"comm": share.total, "exposed": share.exposed, "busy": busy, "coverage": coverage}


def analyze(args) -> int:
    measured = json.loads(args.measured.read_text())
    traces = Path(tempfile.mkdtemp(prefix="tw-traces-"))
    with tarfile.open(args.traces) as tar:
        tar.extractall(traces, filter="data")
    rows = []
    for case, c in measured["cases"].items():
        traced = next((r for r in c.get("runs", []) if r.get("telemetry") == "traced" and "error" not in r), None)
        files = sorted((traces / "traces" / case).glob("*.json.gz"))  # one a rank
        if traced is None or not files:
            continue
        ranks = [offline_shares(f, args.sms) for f in files]
        mean = {key: statistics.fmean(r[key] for r in ranks) for key in ranks[0]}
        hta = hta_breakdown(files[0].parent)
        online = traced["window_comm"]
        gpm = traced["window_gpm"]
        steady = [r["sm_active_share"] for r in c["runs"] if r.get("telemetry") == "on" and r.get("sm_active_share")]
        rows.append({
            "case": case, "ranks": len(files),
            "comm_share": {"online": online["comm_share"], "offline_ours": mean["comm"], "hta": hta["comm_share"]},
            "comm_share_exposed": {"online": online["comm_share_exposed"], "offline_ours": mean["exposed"],
                                   "hta": hta["comm_share_exposed"]},
            "gpu_busy_share": {"online": online.get("gpu_busy_share"), "trace": mean["busy"], "hta": hta["busy_share"]},
            "sm_active": {"gpm_window": gpm["sm_active_share"], "trace_sm_coverage": mean["coverage"],
                          # the same setting's steady steps, in the runs with telemetry on
                          "gpm_steady": statistics.fmean(steady) if steady else None},
            "kernel_active": {"nvml": gpm["kernel_active_share"], "trace_busy": mean["busy"]},
            "straggler": {key: online.get(key) for key in ("slowest_rank", "wait_seconds_per_step",
                                                           "transfer_seconds_per_step", "rank_own_seconds_min",
                                                           "rank_own_seconds_max")},
            "overhead": c["overhead"], "spread": max(c["spread_off"] or 0.0, c["spread_on"] or 0.0),
        })
    print(f"{'case':22} {'comm online/HTA':>16} {'exposed online/HTA':>19} {'busy online/HTA':>16} "
          f"{'SM-active GPM/trace':>20} {'overhead':>9}")
    for r in rows:
        print(f"{r['case']:22} {_pair(r['comm_share'], 'online', 'hta'):>16} "
              f"{_pair(r['comm_share_exposed'], 'online', 'hta'):>19} {_pair(r['gpu_busy_share'], 'online', 'hta'):>16} "
              f"{_pair(r['sm_active'], 'gpm_steady', 'trace_sm_coverage'):>20} {_opt_pct(r['overhead']):>9}")
    if args.write:
        args.write.write_text(json.dumps({"measured": measured, "comparison": rows,
                                          "reference": "HolisticTraceAnalysis "
                                          + _version("HolisticTraceAnalysis")}, indent=2))
    return 0


def _pair(d: dict, a: str, b: str) -> str:
    return f"{_pct(d[a])} / {_pct(d[b])}"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cases", nargs="+", choices=sorted(CASES), help="default: every case (those the visible "
                                                                      "GPUs cannot run are recorded as skipped; "
                                                                      "with --smoke all run, on gloo)")
    r.add_argument("--steps", type=int, default=110, help="a run's steps (default %(default)s: one default "
                                                          "profiler window past step 100)")
    r.add_argument("--repeats", type=int, default=2, help="off/on pairs per case")
    r.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script")
    r.add_argument("--ray", action="store_true", help="run through Ray Train, as the product does (default: torchrun)")
    a = sub.add_parser("analyze")
    a.add_argument("measured", type=Path)
    a.add_argument("traces", type=Path)
    a.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    a.add_argument("--write", type=Path)
    args = parser.parse_args()
    return run(args) if args.verb == "run" else analyze(args)


if __name__ == "__main__":
    sys.exit(main())
