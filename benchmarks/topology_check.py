"""The planner's topology half, checked where no second node exists (issue 13).

On two GPUs of one host, NCCL is kept off NVLink and shared memory (`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`:
TCP sockets, a slow "network" between the two GPUs). In one invocation, for each link (NVLink, sockets):
- the link is measured: an all-reduce's bus bandwidth (nccl-tests' busbw: 2(n-1)/n x bytes / time) over
  large messages, and its latency over small ones;
- LoRA and full fine-tuning run as DDP and as FSDP over it (the runtime under torchrun, `gpu_runs.run_one`;
  with `--ray`, through Ray Train as the product runs it);
- the planner is given a pool whose link is the measured one, and its step time (with its P10-P90 band),
  communication shares and choice between DDP and FSDP are set beside the measured runs.

  python benchmarks/topology_check.py run --out OUT          # on a machine with two GPUs
  python benchmarks/topology_check.py run --out OUT --smoke  # two gloo ranks on the CPU: checks the script

It writes OUT/topology_check.json (after every run: a cut-off call keeps what finished) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_runs import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    Run,
    build_model,
    environment,
    planner_gpu,
    run_one,
    runtime_env,
    write_dataset,
)

from tunewright_core.planner import calibration  # noqa: E402
from tunewright_core.planner.band import band  # noqa: E402
from tunewright_core.planner.estimate import Calibration, estimate  # noqa: E402
from tunewright_core.planner.hardware import GPU, Link, Pool  # noqa: E402
from tunewright_fit.calibration_fit import run_setup  # noqa: E402

# NCCL's own choice (NVLink between two GPUs of one host), and TCP sockets: no peer-to-peer, no shared memory,
# no InfiniBand or RoCE card either (None: the variable is unset)
_OFF = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
LINK_ENVS: dict[str, dict[str, str | None]] = {
    "nvlink": dict.fromkeys(_OFF),
    "sockets": dict.fromkeys(_OFF, "1"),
}
RUNS = [Run("llama-1b", method, strategy, 2, 8) for method in ("lora", "full") for strategy in ("ddp", "fsdp")]
STEPS = 15
LARGE_BYTES = (64 << 20, 256 << 20)  # bandwidth: messages the size of a block's gradients and larger
SMALL_BYTES = 8  # latency
REPEATS = 10


# --- the link, measured (each of two ranks runs this under torchrun) ------------------------------------


def measure_link(out: Path) -> None:
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)

    def seconds(nbytes: int) -> float:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / REPEATS

    bus = {n: 2 * (world - 1) / world * n / seconds(n) for n in LARGE_BYTES}
    # the planner charges its latency per step of a ring all-reduce, 2(n-1) of them
    latency = seconds(SMALL_BYTES) / (2 * (world - 1))
    if rank == 0:
        out.write_text(json.dumps({"bus_bytes_per_s": max(bus.values()), "latency_s": latency, "ranks": world,
                                   "bus_bytes_per_s_by_size": {str(n): b for n, b in bus.items()}}))
    dist.destroy_process_group()


def link_of(name: str, env: dict[str, str | None], work: Path, gpus: int) -> dict:
    out = work / f"link-{name}.json"
    with environment(env):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
                               str(Path(__file__).resolve()), "link-worker", "--out", str(out)],
                              env=runtime_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"measuring the {name} link failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


# --- the planner beside the runs -------------------------------------------------------------------------


def predicted(run: Run, link: dict, name: str, cal: Calibration, gpu: GPU) -> dict:
    pool = Pool(f"two-gpus-{name}", gpu, gpus_per_node=run.gpus, max_nodes=1, price_per_gpu_hour=0.0,
                intra_node=Link(f"{name} (measured)", link["bus_bytes_per_s"], link["latency_s"]), inter_node=None)
    workload, layout = run_setup(run._asdict())
    e = estimate(workload, layout, pool, cal)
    spread = band(calibration.evidence(), gpu.name, layout.gpus, None, workload.seq_len, workload.method)
    low, high = spread.around(e.step_seconds, inverse=True)
    return {"step_seconds": e.step_seconds, "comm_share": e.comm_share, "comm_share_exposed": e.exposed_comm_share,
            "peak_memory_gib": e.peak_memory_bytes / 2**30, "step_seconds_p10": low, "step_seconds_p90": high,
            "band_basis": spread.basis}


def compare(rows: list[dict]) -> dict:
    """Per link and method: which of DDP and FSDP the planner predicts faster, and which ran faster."""
    choices = {}
    for link in LINK_ENVS:
        for method in ("lora", "full"):
            pair = [r for r in rows if r["link"] == link and r["method"] == method and "step_seconds_median" in r]
            if len(pair) < 2:
                continue
            by_prediction = min(pair, key=lambda r: r["predicted"]["step_seconds"])["strategy"]
            by_measurement = min(pair, key=lambda r: r["step_seconds_median"])["strategy"]
            choices[f"{method} over {link}"] = {"planner": by_prediction, "measured": by_measurement,
                                               "agree": by_prediction == by_measurement}
    return choices


# --- the invocation --------------------------------------------------------------------------------------


def run(args) -> int:
    import torch

    visible = torch.cuda.device_count()
    if visible < 2 and not args.smoke:
        print(f"needs two GPUs, {visible} visible", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    runs = [r for r in RUNS if r.method in args.methods]
    if args.smoke:
        runs = [r._replace(micro_batch=2) for r in runs]
    profile, extra = (SMOKE_MODELS if args.smoke else MODELS)["llama-1b"]
    path = work / "llama-1b"
    params = build_model(profile, extra, path)
    models = {"llama-1b": {"path": path, "params": params, "profile": profile}}
    cal, gpu = calibration.load()[0], planner_gpu()  # its several-GPU figure: this check is what would measure it
    result = {"environment": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if visible else "cpu",
                              "gpus_visible": visible},
              "steps": args.steps, "links": {}, "runs": [], "choices": {}}

    def write() -> None:
        (args.out / "topology_check.json").write_text(json.dumps(result, indent=2))

    for name in args.links:
        env = LINK_ENVS[name]
        link_work = work / name  # each link's runs keep their own logs
        link_work.mkdir(parents=True, exist_ok=True)
        write_dataset(link_work / "data.jsonl", n=400 if args.smoke else 3000,
                      words_per_example=128 if args.smoke else 2048)
        link = link_of(name, env, link_work, 2)
        result["links"][name] = {"env": env, **link}
        print(f"{name}: bus bandwidth {link['bus_bytes_per_s'] / 1e9:.2f} GB/s, latency {link['latency_s'] * 1e6:.0f} us",
              flush=True)
        write()
        for r in runs:
            with environment(env):
                row = run_one(r, models, link_work, args.steps, args.smoke, None, ray=args.ray)
            row.update({"link": name, "predicted": predicted(r, link, name, cal, gpu)})
            result["runs"].append(row)
            print(json.dumps({k: row.get(k) for k in ("name", "link", "step_seconds_median", "comm_share",
                                                      "comm_share_exposed", "predicted", "error")}), flush=True)
            write()
    result["choices"] = compare(result["runs"])
    write()
    print(f"\n{'run':34} {'link':8} {'step ms pred/meas':>18} {'P10-P90 ms':>13} {'error':>7} {'comm pred/meas':>15} "
          f"{'exposed pred/meas':>18}")
    for row in result["runs"]:
        p = row["predicted"]
        if "step_seconds_median" not in row:
            print(f"{row['name']:34} {row['link']:8} FAILED")
            continue
        error = p["step_seconds"] / row["step_seconds_median"] - 1
        print(f"{row['name']:34} {row['link']:8} {p['step_seconds'] * 1e3:>8.0f} / {row['step_seconds_median'] * 1e3:<7.0f} "
              f"{p['step_seconds_p10'] * 1e3:>6.0f}-{p['step_seconds_p90'] * 1e3:<6.0f} "
              f"{error:>+7.1%} {_pair(p['comm_share'], row.get('comm_share')):>15} "
              f"{_pair(p['comm_share_exposed'], row.get('comm_share_exposed')):>18}")
    for what, choice in result["choices"].items():
        print(f"{what}: the planner picks {choice['planner']}, {choice['measured']} ran faster")
    errors = [abs(r["predicted"]["step_seconds"] / r["step_seconds_median"] - 1) for r in result["runs"]
              if "step_seconds_median" in r]
    if errors:
        print(f"step time error: median {statistics.median(errors):.1%}, max {max(errors):.1%}")
    return 0


def _pair(predicted_share: float, measured_share: float | None) -> str:
    measured = "n/a" if measured_share is None else f"{measured_share:.1%}"
    return f"{predicted_share:.1%} / {measured}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, default=Path("/tmp/tunewright-topology"))
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--links", nargs="+", choices=list(LINK_ENVS), default=list(LINK_ENVS))
    r.add_argument("--methods", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    r.add_argument("--smoke", action="store_true", help="tiny models, two gloo ranks on the CPU")
    r.add_argument("--ray", action="store_true", help="run through Ray Train, as the product does (default: torchrun)")
    w = sub.add_parser("link-worker", help="one rank of the link measurement (under torchrun)")
    w.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.verb == "link-worker":
        measure_link(args.out)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
