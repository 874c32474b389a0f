"""Calibration against measured runs: fit a few constants on the smallest models, report the error on all.

Offline only (it needs numpy); the planner reads the result through `calibration.load`.
Measurements come from `benchmarks/gpu_runs.py` (JSON). Every constant is linear in the model, so the
fit is a weighted least-squares solve (weights 1/measured: relative error). Under-predicting memory is
the costly error (a plan that does not fit is an OOM): tests/operator holds it to 3% on every measured run.

  python -m tunewright_fit.calibration_fit fit results/*.json --out calibration_h200.json
  python -m tunewright_fit.calibration_fit report results/*.json [--calibration FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunewright_core.planner.calibration import DEFAULT_FILE, load, save, update
from tunewright_core.planner.estimate import (
    BF16,
    Calibration,
    Layout,
    Workload,
    estimate,
    gpu_state_bytes,
    lora_modules,
    loss_gradient_bytes,
    loss_tokens,
    matmul_flops,
    recompute_factor,
)
from tunewright_core.planner.hardware import GIB, GPU, GPUS, LINKS, Pool
from tunewright_core.planner.models import CATALOG, ModelProfile

# The benchmark's models (benchmarks/gpu_runs.py builds them from these), by the names its results use:
# catalog shapes, GPT-2 small with 2048 learned positions.
MEASURED_MODELS: dict[str, ModelProfile] = {
    "gpt2-124m": replace(CATALOG["gpt2"], name="gpt2-124m", max_positions=2048),
    "llama-1b": replace(CATALOG["meta-llama/Llama-3.2-1B"], name="llama-1b"),
    "llama-3b": replace(CATALOG["meta-llama/Llama-3.2-3B"], name="llama-3b"),
    "qwen-0.5b": replace(CATALOG["Qwen/Qwen2.5-0.5B"], name="qwen-0.5b", model_type="llama"),  # no q/k/v biases
    "llama-8b": replace(CATALOG["meta-llama/Llama-3.1-8B"], name="llama-8b"),
}
FIT_MODELS = {"gpt2-124m", "llama-1b"}  # the smallest; the others are held out
# An 8192^3 bf16 GEMM on random data ran at 788 TFLOP/s on these H200s (device KINDS.md), 0.797 of the
# datasheet's 989: the matmul efficiency a fit may not exceed.
GEMM_CEILING = 788e12 / GPUS["H200"].bf16_flops
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
    comm_share: float | None = None  # measured by the runtime's profiler window (commshare.py)
    comm_share_exposed: float | None = None
    packed: bool = False  # documents of many lengths packed into the rows (`gpu_runs.Run.data` "variable")

    @property
    def in_fit_set(self) -> bool:
        """Fixed-length rows on one GPU of the smallest models: packed rows are held out, a check that a
        packed row costs what a full one does (attention runs per document, the row's tokens are the same)."""
        return self.workload.model.name in FIT_MODELS and self.layout.gpus == 1 and not self.packed


def run_setup(run: Mapping) -> tuple[Workload, Layout]:
    """One optimizer step of a benchmark run (a `gpu_runs.Run` as a dict, or a row of its JSON): one node,
    one micro-batch per GPU, no accumulation."""
    gpus = run["gpus"]
    workload = Workload(MEASURED_MODELS[run["model"]], run["method"], run["seq_len"], run["micro_batch"] * gpus,
                        steps=1)
    layout = Layout(run["strategy"], gpus, 1, run["micro_batch"], 1, run.get("activation_checkpointing", False),
                    shard_group={"fsdp": gpus, "hsdp": run.get("hsdp_shard", 0)}.get(run["strategy"], 1),
                    cpu_offload=run.get("cpu_offload", False))
    return workload, layout


def load_measurements(paths: list[Path]) -> list[Measurement]:
    out = []
    for path in paths:
        for row in json.loads(Path(path).read_text())["runs"]:
            if "tokens_per_second" not in row:
                continue  # skipped or failed runs
            workload, layout = run_setup(row)
            model = workload.model
            if abs(model.params - row["params"]) > 1e-3 * row["params"]:
                raise ValueError(f"{path}: {row['name']} has {row['params']} parameters, profile {model.params}")
            out.append(Measurement(row["name"], workload, layout, row["step_seconds_median"],
                                   row["forward_backward_seconds_median"], row["optimizer_seconds_median"],
                                   row["peak_memory_gib"] * GIB, row["tokens_per_second"],
                                   row.get("comm_share"), row.get("comm_share_exposed"),
                                   packed=row.get("data") == "variable"))
    return out


def weighted_solve(rows: list[list[float]], targets: list[float], weights: list[float]) -> np.ndarray:
    """Weighted least squares with every constant >= 0 (they are bytes and seconds): the best of the
    solves over subsets of the columns whose solution is non-negative (exact for the few columns here).
    A constant the measurements do not support comes out 0."""
    a, y, wt = np.array(rows) * np.array(weights)[:, None], np.array(targets), np.array(weights)
    y = y * wt
    best, best_residual = None, np.inf
    for subset in itertools.chain.from_iterable(
            itertools.combinations(range(a.shape[1]), k) for k in range(a.shape[1], 0, -1)):
        columns = list(subset)
        solution, *_ = np.linalg.lstsq(a[:, columns], y, rcond=None)
        if (solution < 0).any():
            continue
        residual = float(np.sum((a[:, columns] @ solution - y) ** 2))
        if residual < best_residual - 1e-15:
            best, best_residual = np.zeros(a.shape[1]), residual
            best[columns] = solution
    if best is None:
        raise ValueError("calibration fit: no non-negative constants describe these measurements")
    return best


def fit(measurements: list[Measurement], gpu: GPU) -> tuple[Calibration, GPU]:
    fit_set = [m for m in measurements if m.in_fit_set and not m.layout.cpu_offload]
    families = sorted({m.workload.model.family for m in fit_set})
    base = Calibration({f: 0.0 for f in families}, 0.0, {f: 0.0 for f in families}, 0.0, 0.0, 0.0)

    # Optimizer: fused AdamW's bytes over HBM bandwidth gives the achieved memory efficiency; offloaded
    # runs' host AdamW gives seconds per parameter.
    full = [m for m in fit_set if m.workload.method == "full"]
    bytes_per_s = statistics.median(28 * m.workload.trainable_params / m.layout.shard_group / m.optimizer_seconds
                                    for m in full)
    gpu = gpu.calibrated(memory_efficiency=bytes_per_s / gpu.hbm_bytes_per_s)
    bandwidth = gpu.hbm_bytes_per_s * gpu.memory_efficiency
    offloaded = [m for m in measurements if m.in_fit_set and m.layout.cpu_offload and m.workload.method == "full"]
    # Without offloaded runs the host AdamW rate is carried from the calibration being replaced: it is the
    # host's, which no GPU kernel changes.
    cpu_adam = (statistics.median(m.optimizer_seconds * m.layout.shard_group / m.workload.trainable_params
                                  for m in offloaded) if offloaded else load()[0].cpu_adam_seconds_per_param)

    # Memory: measured peak - states = activations (per-family rate) + logits (shared rate): the peak at the
    # start of backward, which on these runs (micro-batches of 2-16 sequences) is above the end of backward's.
    rows, targets = [], []
    for m in fit_set:
        w, lay, p = m.workload, m.layout, m.workload.model
        tokens = lay.micro_batch * w.seq_len
        layers = 1 if lay.activation_checkpointing else p.layers
        known = sum(gpu_state_bytes(w, lay).values()) + loss_gradient_bytes(w, lay) + tokens * layers * (
            base.act_bytes_per_ffn * p.ffn if p.gated_mlp else 0)
        if lay.activation_checkpointing:
            known += tokens * p.layers * BF16 * p.hidden
        rows.append([tokens * layers * p.hidden * (p.family == f) for f in families] + [loss_tokens(w, lay) * p.vocab])
        targets.append(m.peak_memory_bytes - known)
    memory = weighted_solve(rows, targets, [1 / m.peak_memory_bytes for m in fit_set])

    # LoRA with checkpointing is host-bound (calibration.Calibration): its runs give the host time per
    # adapted module, and stay out of the GPU-time fit below.
    host_bound = [m for m in fit_set if m.workload.method == "lora" and m.layout.activation_checkpointing]
    host_per_module = statistics.median(m.forward_backward_seconds / lora_modules(m.workload) for m in host_bound) \
        if host_bound else 0.0
    gpu_bound = [m for m in fit_set if m not in host_bound]

    # Time of forward+backward: matmul FLOPs / efficiency + traffic / bandwidth + fixed per-layer costs.
    rows = []
    for m in gpu_bound:
        w, lay, p = m.workload, m.layout, m.workload.model
        tokens, again = lay.micro_batch * w.seq_len, recompute_factor(lay, w.model.layers)
        lora = w.method == "lora"
        modules = p.layers * p.linear_modules_per_layer
        traffic = tokens * p.layers * p.hidden * again / bandwidth
        rows.append([matmul_flops(w, lay) / gpu.bf16_flops] + [traffic * (p.family == f) for f in families]
                    + [lora * tokens * modules * p.hidden * again / bandwidth, p.layers * again,
                       lora * modules * again])
    targets = [m.forward_backward_seconds - m.layout.micro_batch * m.workload.seq_len * m.workload.model.vocab
               * base.traffic_bytes_per_vocab / bandwidth for m in gpu_bound]
    weights = [1 / m.forward_backward_seconds for m in gpu_bound]
    time = weighted_solve(rows, targets, weights)
    if time[0] < 1 / GEMM_CEILING:
        # FLOPs and traffic both grow with tokens x layers x hidden, so the fit can trade one for the other;
        # no training matmul beats a large square GEMM: hold the efficiency at that ceiling and refit the rest
        rest = weighted_solve([r[1:] for r in rows], [t - r[0] / GEMM_CEILING for t, r in zip(targets, rows, strict=True)],
                               weights)
        time = np.concatenate([[1 / GEMM_CEILING], rest])
    nf = len(families)
    gpu = gpu.calibrated(matmul_efficiency=1 / time[0])
    calibration = Calibration(
        act_bytes_per_hidden=dict(zip(families, memory[:nf].tolist(), strict=True)),
        logits_bytes_per_vocab=float(memory[nf]),
        traffic_bytes_per_hidden=dict(zip(families, time[1:nf + 1].tolist(), strict=True)),
        lora_traffic_bytes_per_hidden=float(time[nf + 1]),
        seconds_per_layer=float(time[nf + 2]),
        seconds_per_lora_module=float(time[nf + 3]),
        cpu_adam_seconds_per_param=float(cpu_adam),
        host_seconds_per_lora_module_recompute=float(host_per_module),
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
                     "memory_error": e.peak_memory_bytes / m.peak_memory_bytes - 1,
                     "gpus": m.layout.gpus, "comm_measured": m.comm_share, "comm_exposed_measured": m.comm_share_exposed,
                     "comm_predicted": e.comm_share, "comm_exposed_predicted": e.exposed_comm_share})
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


def _share(measured: float | None, predicted: float) -> str:
    return f"{measured:.1%} / {predicted:.1%}" if measured is not None else f"- / {predicted:.1%}"


def markdown(rows: list[dict], stats: dict) -> str:
    lines = ["| run | fit set | step s measured | predicted | error | peak GiB measured | predicted | error "
             "| comm share measured / predicted | exposed measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        comm = (f"{_share(r['comm_measured'], r['comm_predicted'])} | "
                f"{_share(r['comm_exposed_measured'], r['comm_exposed_predicted'])}") if r["gpus"] > 1 else "| "
        lines.append(f"| {r['name']} | {'yes' if r['fit_set'] else 'no'} | {r['step_measured']:.3f} | "
                     f"{r['step_predicted']:.3f} | {r['step_error']:+.1%} | {r['memory_measured_gib']:.1f} | "
                     f"{r['memory_predicted_gib']:.1f} | {r['memory_error']:+.1%} | {comm} |")
    lines.append("")
    lines += [f"- {k.replace('_', ' ')}: {v:+.1%}" if "under" in k else f"- {k.replace('_', ' ')}: {v:.1%}"
              for k, v in stats.items()]
    return "\n".join(lines)


def fit_constant(field: str, calibration: Calibration, fit_set: list, step: Callable[[Any, Calibration], float],
                 measured_step: Callable[[Any], float]) -> float:
    """One constant the predicted step is linear in (base + constant x the seconds one unit of it adds), fitted on
    `fit_set` by weighted least squares (weights 1/measured: relative error): qlora_fit's and fp8_fit's."""
    rows, targets, weights = [], [], []
    for run in fit_set:
        base = step(run, replace(calibration, **{field: 0.0}))
        rows.append([step(run, replace(calibration, **{field: 1.0})) - base])
        targets.append(measured_step(run) - base)
        weights.append(1 / measured_step(run))
    return float(weighted_solve(rows, targets, weights)[0])


# the constants other fitters fit on runs of their own, and the start of the names of the result files they fit on
FITTED_ELSEWHERE = {"nf4_dequant_bytes_per_param": "qlora_check_h200",  # qlora_fit
                    "fp8_activation_cast_bytes": "fp8_check",  # fp8_fit
                    "host_copy_slowdown": "qlora_check_h100"}  # offload_fit


# a report's columns after the run, its result file, its card and its set: (header, the cell of a compared row)
Columns = list[tuple[str, Callable[[dict], str]]]


def constant_report(field: str, constant: float, columns: Columns, rows: list[dict]) -> str:
    """A fitted constant's value, then a table of the runs compared against it (qlora_fit's, fp8_fit's,
    offload_fit's rows: run, source, chip, fit_set and their own)."""
    head = ["run", "source", "card", "set", *(name for name, _ in columns)]
    lines = [f"{field} = {constant:.3f}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], r["source"], r["chip"], "fit" if r["fit_set"] else "held out", *(cell(r) for _, cell in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def constant_fitter(argv: list[str] | None, description: str, field: str,
                    load_runs: Callable[[list[Path]], list], in_fit_set: Callable[[Any], bool],
                    fit: Callable[[list, Calibration, GPU], float],
                    compare: Callable[[list, Calibration, GPU], list[dict]], columns: Columns) -> int:
    """The command line of a fitter of one constant: `fit` writes it into the calibration file, with its fit set's
    result files as its sources (in place of those whose names start with its FITTED_ELSEWHERE prefix); both print
    `compare`'s rows as `constant_report` does."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fit", "report"])
    parser.add_argument("measurements", nargs="+", type=Path)
    parser.add_argument("--calibration", type=Path, default=DEFAULT_FILE,
                        help="the file whose constant is fitted (fit) or checked (report)")
    args = parser.parse_args(argv)
    runs = load_runs(args.measurements)
    calibration, gpu = load(args.calibration)
    if args.command == "fit":
        calibration = replace(calibration, **{field: fit(runs, calibration, gpu)})
        update(args.calibration, {field: getattr(calibration, field)},
               sorted({r.source for r in runs if in_fit_set(r)}), replacing=FITTED_ELSEWHERE[field])
    print(constant_report(field, getattr(calibration, field), columns, compare(runs, calibration, gpu)))
    return 0


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
        sources = sorted(p.name for p in args.measurements)
        if args.out.exists():  # the constants fitted on runs of their own (qlora_fit's, fp8_fit's): kept
            kept = json.loads(args.out.read_text())
            calibration = replace(calibration, **{field: kept["calibration"].get(field, getattr(calibration, field))
                                                  for field in FITTED_ELSEWHERE})
            sources += [s for s in kept["measurements"] if s.startswith(tuple(FITTED_ELSEWHERE.values()))]
        save(args.out, calibration, gpu, sources)
    else:
        calibration, gpu = load(args.calibration)
    rows = compare(measurements, calibration, gpu)
    print(markdown(rows, summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
