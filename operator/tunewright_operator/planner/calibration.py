"""Calibration against measured runs: fit a few constants on the smallest models, report the error on all.

Measurements come from `benchmarks/gpu_runs.py` (JSON). Every constant is linear in the model, so the
fit is a weighted least-squares solve (weights 1/measured: relative error). Under-predicting memory is
the costly error (a plan that does not fit is an OOM): tests/operator holds it to 3% on every measured run.

  python -m tunewright_operator.planner.calibration fit results/*.json --out calibration_h200.json
  python -m tunewright_operator.planner.calibration report results/*.json [--calibration FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tunewright_operator.planner.estimate import (
    BF16,
    Calibration,
    Layout,
    Workload,
    estimate,
    matmul_flops,
    precision_path,
    recompute_factor,
    state_bytes,
)
from tunewright_operator.planner.hardware import GPU, GPUS, LINKS, Pool
from tunewright_operator.planner.models import ModelProfile

DEFAULT_FILE = Path(__file__).with_name("calibration_h200.json")
GIB = 2**30

# The benchmark's models (benchmarks/gpu_runs.py MODELS), by the names its results use.
MEASURED_MODELS = {
    "gpt2-124m": ModelProfile("gpt2-124m", 12, 768, 12, 12, 3072, 50257, True, gated_mlp=False, max_positions=2048),
    "llama-1b": ModelProfile("llama-1b", 16, 2048, 32, 8, 8192, 128256, True),
    "llama-3b": ModelProfile("llama-3b", 28, 3072, 24, 8, 8192, 128256, True),
    "qwen-0.5b": ModelProfile("qwen-0.5b", 24, 896, 14, 2, 4864, 151936, True),
}
FIT_MODELS = {"gpt2-124m", "llama-1b"}  # the smallest; llama-3b is held out


@dataclass(frozen=True)
class Measurement:
    name: str
    workload: Workload
    layout: Layout
    step_seconds: float
    forward_backward_seconds: float
    optimizer_seconds: float
    peak_memory_bytes: float
    tokens_per_second: float

    @property
    def in_fit_set(self) -> bool:
        return self.workload.model.name in FIT_MODELS and self.layout.gpus == 1


def load_measurements(paths: list[Path]) -> list[Measurement]:
    out = []
    for path in paths:
        for row in json.loads(Path(path).read_text())["runs"]:
            if "tokens_per_second" not in row:
                continue  # skipped or failed runs
            model = MEASURED_MODELS[row["model"]]
            if abs(model.params - row["params"]) > 1e-3 * row["params"]:
                raise ValueError(f"{path}: {row['name']} has {row['params']} parameters, profile {model.params}")
            gpus = row["gpus"]
            workload = Workload(model, row["method"], row["seq_len"], row["micro_batch"] * gpus, steps=1)
            layout = Layout(row["strategy"], gpus, 1, row["micro_batch"], 1, row.get("activation_checkpointing", False),
                            shard_group=gpus if row["strategy"] == "fsdp" else 1)
            out.append(Measurement(row["name"], workload, layout, row["step_seconds_median"],
                                   row["forward_backward_seconds_median"], row["optimizer_seconds_median"],
                                   row["peak_memory_gib"] * GIB, row["tokens_per_second"]))
    return out


def _weighted_solve(rows: list[list[float]], targets: list[float], weights: list[float]) -> np.ndarray:
    a, y, wt = np.array(rows), np.array(targets), np.array(weights)
    solution, *_ = np.linalg.lstsq(a * wt[:, None], y * wt, rcond=None)
    if (solution < 0).any():
        raise ValueError(f"calibration fit gave a negative constant {solution.tolist()}: the model does not "
                         "describe these measurements")
    return solution


def fit(measurements: list[Measurement], gpu: GPU) -> tuple[Calibration, GPU]:
    fit_set = [m for m in measurements if m.in_fit_set]
    keys = sorted({f"{precision_path(m.layout)}/{m.workload.model.family}" for m in fit_set})
    families = sorted({m.workload.model.family for m in fit_set})
    base = Calibration({k: 0.0 for k in keys}, 0.0, {f: 0.0 for f in families}, 0.0, 0.0, 0.0, 0.0)

    # Optimizer: fused AdamW's bytes over HBM bandwidth gives the achieved memory efficiency.
    full = [m for m in fit_set if m.workload.method == "full"]
    bytes_per_s = statistics.median(28 * m.workload.trainable_params / m.layout.shard_group / m.optimizer_seconds
                                    for m in full)
    gpu = gpu.calibrated(memory_efficiency=bytes_per_s / gpu.hbm_bytes_per_s)
    bandwidth = gpu.hbm_bytes_per_s * gpu.memory_efficiency

    # Memory: measured peak - states = activations (per-path rate) + logits (shared rate).
    rows, targets = [], []
    for m in fit_set:
        w, lay, p = m.workload, m.layout, m.workload.model
        tokens = lay.micro_batch * w.seq_len
        layers = 1 if lay.activation_checkpointing else p.layers
        known = sum(state_bytes(w, lay).values()) + tokens * layers * (base.act_bytes_per_ffn * p.ffn if p.gated_mlp else 0)
        if lay.activation_checkpointing:
            known += tokens * p.layers * BF16 * p.hidden
        rows.append([tokens * layers * p.hidden * (base.key(lay, p) == k) for k in keys] + [tokens * p.vocab])
        targets.append(m.peak_memory_bytes - known)
    memory = _weighted_solve(rows, targets, [1 / m.peak_memory_bytes for m in fit_set])

    # Time of forward+backward: matmul FLOPs / efficiency + traffic / bandwidth + fixed per-layer costs.
    # Two stages: the matmul efficiency first, with traffic by family only (the autocast term is nearly
    # collinear with the FLOPs term on so few runs), then the rest with that efficiency held.
    def time_rows(with_autocast: bool) -> list[list[float]]:
        rows = []
        for m in fit_set:
            w, lay, p = m.workload, m.layout, m.workload.model
            tokens, again = lay.micro_batch * w.seq_len, recompute_factor(lay)
            lora = w.method == "lora"
            modules = p.layers * p.linear_modules_per_layer
            traffic = tokens * p.layers * p.hidden * again / bandwidth
            rows.append([matmul_flops(w, lay) / gpu.bf16_flops] + [traffic * (p.family == f) for f in families]
                        + ([traffic * (precision_path(lay) == "autocast")] if with_autocast else [])
                        + [lora * tokens * modules * p.hidden * again / bandwidth, p.layers * again,
                           lora * modules * again])
        return rows

    targets = [m.forward_backward_seconds - m.layout.micro_batch * m.workload.seq_len * m.workload.model.vocab
               * base.traffic_bytes_per_vocab / bandwidth for m in fit_set]
    weights = [1 / m.forward_backward_seconds for m in fit_set]
    inverse_efficiency = _weighted_solve(time_rows(False), targets, weights)[0]
    rest = [row[1:] for row in time_rows(True)]
    time = np.concatenate([[inverse_efficiency], _weighted_solve(
        rest, [t - row[0] * inverse_efficiency for t, row in zip(targets, time_rows(True), strict=True)], weights)])
    n, nf = len(keys), len(families)
    gpu = gpu.calibrated(matmul_efficiency=1 / time[0])
    calibration = Calibration(
        act_bytes_per_hidden=dict(zip(keys, memory[:n].tolist(), strict=True)),
        logits_bytes_per_vocab=float(memory[n]),
        traffic_bytes_per_hidden=dict(zip(families, time[1:nf + 1].tolist(), strict=True)),
        autocast_traffic_bytes_per_hidden=float(time[nf + 1]),
        lora_traffic_bytes_per_hidden=float(time[nf + 2]),
        seconds_per_layer=float(time[nf + 3]),
        seconds_per_lora_module=float(time[nf + 4]),
    )
    return calibration, gpu


def measured_pool(gpu: GPU, gpus: int) -> Pool:
    return Pool("measured", gpu, gpus_per_node=max(gpus, 1), max_nodes=1, intra_node=LINKS["nvlink4"],
                inter_node=None, price_per_gpu_hour=0.0)


def compare(measurements: list[Measurement], calibration: Calibration, gpu: GPU) -> list[dict]:
    rows = []
    for m in measurements:
        e = estimate(m.workload, m.layout, measured_pool(gpu, m.layout.gpus), calibration)
        rows.append({"name": m.name, "fit_set": m.in_fit_set,
                     "step_measured": m.step_seconds, "step_predicted": e.step_seconds,
                     "step_error": e.step_seconds / m.step_seconds - 1,
                     "memory_measured_gib": m.peak_memory_bytes / GIB, "memory_predicted_gib": e.peak_memory_bytes / GIB,
                     "memory_error": e.peak_memory_bytes / m.peak_memory_bytes - 1})
    return rows


def summary(rows: list[dict]) -> dict:
    held_out = [r for r in rows if not r["fit_set"]] or rows
    return {
        "median_abs_step_error_held_out": statistics.median(abs(r["step_error"]) for r in held_out),
        "max_abs_step_error_held_out": max(abs(r["step_error"]) for r in held_out),
        "median_abs_memory_error_held_out": statistics.median(abs(r["memory_error"]) for r in held_out),
        "max_abs_memory_error": max(abs(r["memory_error"]) for r in rows),
        "worst_memory_under_prediction": min(r["memory_error"] for r in rows),
    }


def save(path: Path, calibration: Calibration, gpu: GPU, sources: list[str]) -> None:
    path.write_text(json.dumps({"gpu": asdict(gpu), "calibration": asdict(calibration), "measurements": sources},
                               indent=2, sort_keys=True) + "\n")


def load(path: Path = DEFAULT_FILE) -> tuple[Calibration, GPU]:
    data = json.loads(Path(path).read_text())
    return Calibration(**data["calibration"]), GPU(**data["gpu"])


def markdown(rows: list[dict], stats: dict) -> str:
    lines = ["| run | fit set | step s measured | predicted | error | peak GiB measured | predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {'yes' if r['fit_set'] else 'no'} | {r['step_measured']:.3f} | "
                     f"{r['step_predicted']:.3f} | {r['step_error']:+.1%} | {r['memory_measured_gib']:.1f} | "
                     f"{r['memory_predicted_gib']:.1f} | {r['memory_error']:+.1%} |")
    lines.append("")
    lines += [f"- {k.replace('_', ' ')}: {v:+.1%}" if "under" in k else f"- {k.replace('_', ' ')}: {v:.1%}"
              for k, v in stats.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fit", "report"])
    parser.add_argument("measurements", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=DEFAULT_FILE, help="fit: where the constants go")
    parser.add_argument("--calibration", type=Path, default=DEFAULT_FILE, help="report: constants to check")
    args = parser.parse_args(argv)
    measurements = load_measurements(args.measurements)
    if args.command == "fit":
        calibration, gpu = fit(measurements, GPUS["H200"])
        save(args.out, calibration, gpu, sorted(p.name for p in args.measurements))
    else:
        calibration, gpu = load(args.calibration)
    rows = compare(measurements, calibration, gpu)
    print(markdown(rows, summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def for_gpu(name: str, path: Path = DEFAULT_FILE) -> GPU:
    """A catalog GPU with the measured efficiencies (measured on H200; the same kernels reach similar shares
    of peak on other Hopper and Ampere parts until their own runs replace them)."""
    _, measured = load(path)
    return GPUS[name].calibrated(matmul_efficiency=measured.matmul_efficiency,
                                 memory_efficiency=measured.memory_efficiency)
