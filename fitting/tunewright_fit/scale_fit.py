"""The planner at scale, fitted on published multi-GPU measurements and checked on others (offline).

`benchmarks/published/multi_gpu_runs.json` holds published FSDP runs (source, table, model, GPUs, links,
layout, batch, measured tokens/s per GPU or MFU). Each in-scope row becomes a workload, a layout and a
pool, and the planner's `estimate` predicts its tokens/s per GPU. What the rows fit:

- each GPU type's compute efficiency relative to the H200's measured one (our runs), one factor per chip
  (`GPU_FAMILIES`): the published frameworks' kernels on that chip, not ours;
- `sync_jitter`: the step-time jitter whose maximum over n ranks every step waits for;
- `comm_interference`: what collectives overlapped with compute still cost it (SMs and HBM they share),
  fitted with the jitter on the fit set's weak scaling (each series' throughput at its largest GPU count
  over its smallest) as well as its rows.

The fit set is one source (MosaicML's llm-foundry tables, 8-128 GPUs); every other source (torchtitan,
IBM's fms-fsdp and PyTorch blogs, KempnerForge) is held out and only checked. Their errors (measured over
predicted) give the planner's uncertainty band (`band.py`).

  python -m tunewright_fit.scale_fit fit      # writes planner/scale.json, prints the check
  python -m tunewright_fit.scale_fit report   # the check with the committed constants
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tunewright_core.planner.calibration import SCALE_FILE, load
from tunewright_core.planner.estimate import Calibration, Layout, Workload, estimate
from tunewright_core.planner.hardware import GPU, GPUS, LINKS, Link, Pool
from tunewright_core.planner.models import ModelProfile

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published" / "multi_gpu_runs.json"
FIT_FRAMEWORK = "llm-foundry"
# the chips whose efficiency the fit learns; a published GPU name maps to one
GPU_FAMILIES = {"H100": "H100", "H100-96GB-HBM2e-500W": "H100", "A100-80GB": "A100", "A100-40GB": "A100",
                "H200": "H200"}
CATALOG_GPU = {"H100": "H100", "H100-96GB-HBM2e-500W": "H100", "A100-80GB": "A100-80GB", "A100-40GB": "A100-40GB",
               "H200": "H200"}
# a node's network when the source names none for a multi-node run: what that generation's clusters carry
# (an assumption, stated in the report): 8 x 400 Gb/s for H100, 8 x 200 Gb/s for A100
ASSUMED_NETWORK = {"H100": "ib-8x400g", "A100": "ib-8x200g", "H200": "ib-8x400g"}
BUS_SHARE = 0.9  # of a network's line rate that large collectives reach (as hardware.LINKS assumes)
# Sequences longer than this are left out of the fit and the check: there attention's rate, not the GEMMs',
# decides the step (the fit set's 16k-64k rows ran up to 2x slower than the GEMM rate predicts); plans for
# them carry a wider band
LONGEST_SEQUENCE = 8192
# the IBM team's second FSDP post gives MFU for the same models and clusters as its first, which states a
# sequence of 4096 and 2 sequences per GPU without accumulation
ASSUMED_SEQ_LEN = {"ptblog-compile-": 4096}
ASSUMED_GLOBAL_BATCH_PER_GPU = {"ptblog-compile-": 2}
SHAPE = ("layers", "hidden", "heads", "ffn", "vocab")


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    framework: str
    workload: Workload
    layout: Layout
    gpu_name: str  # as published
    family: str
    intra: Link
    inter: Link | None
    assumed_network: bool
    tokens_per_second_per_gpu: float
    derived_from_mfu: bool
    compiled: bool  # the framework compiled its model (torch.compile): kernels the fit set's framework lacks

    @property
    def held_out(self) -> bool:
        return FIT_FRAMEWORK not in self.framework


def profile(row: dict) -> ModelProfile:
    s = row["shape"]
    gated = s["ffn"] != 4 * s["hidden"]
    untied = ModelProfile(row["model"], s["layers"], s["hidden"], s["heads"], s["kv_heads"] or s["heads"], s["ffn"],
                          s["vocab"], False, gated_mlp=gated)
    tied = replace(untied, tied_embeddings=True)
    if not s.get("params"):
        return untied
    return min((untied, tied), key=lambda p: abs(p.params - s["params"]))


def network(text: str | None, family: str, nodes: int) -> tuple[Link | None, bool]:
    """A source's inter-node network as a link: its named rate per node (per GPU rates times 8), else the
    generation's usual one, flagged as assumed."""
    if nodes <= 1:
        return None, False
    text = (text or "unknown").lower()
    per_node = re.search(r"([\d.]+)\s*(t|g)bps", text)
    if per_node:
        gbps = float(per_node[1]) * (1000 if per_node[2] == "t" else 1)
        if "per-gpu" in text:
            gbps *= 8
        latency = LINKS["eth-400g" if "eth" in text else "ib-8x400g"].latency_s
        return Link(f"{gbps:g} Gb/s per node (as published)", BUS_SHARE * gbps / 8 * 1e9, latency), False
    return LINKS[ASSUMED_NETWORK[family]], True


def rows(path: Path = PUBLISHED) -> list[Row]:
    """The in-scope published rows the planner can be asked about (a layout it models, a shape, a rate)."""
    out = []
    for r in json.loads(path.read_text())["rows"]:
        lay, measured, derived = r["layout"], r["measured"], r.get("derived") or {}
        seq_len = r.get("seq_len") or next((v for k, v in ASSUMED_SEQ_LEN.items() if r["id"].startswith(k)), None)
        global_batch = (r.get("global_batch") or (derived.get("global_batch") or {}).get("value")
                        or next((v * r["gpus"] for k, v in ASSUMED_GLOBAL_BATCH_PER_GPU.items() if r["id"].startswith(k)),
                                None))
        shape = r.get("shape") or {}
        if (not r["in_scope"] or r["gpu"] not in GPU_FAMILIES or not all(shape.get(k) for k in SHAPE) or not global_batch
                or not seq_len or seq_len > LONGEST_SEQUENCE):
            continue
        if lay["strategy"] not in ("fsdp", "hsdp", "fsdp-family-unspecified") or not r.get("micro_batch"):
            continue
        model = profile(r)
        per_node = r.get("gpus_per_node") or 8
        gpus = r["gpus"]
        nodes = max(1, gpus // per_node)
        shard = lay.get("shard_group") or gpus
        checkpointing = lay["activation_checkpointing"]
        ac = checkpointing not in ("none", None)
        every = lay.get("ac_every") or (2 if checkpointing.startswith("selective") else 1)
        grad_accum = max(1, global_batch // (gpus * r["micro_batch"]))
        layout = Layout("hsdp" if shard < gpus else "fsdp", gpus, nodes, r["micro_batch"], grad_accum, ac,
                        shard_group=shard, checkpoint_every=every if ac else 1,
                        reshard_after_forward=lay.get("reshard_after_forward") is not False)
        family = GPU_FAMILIES[r["gpu"]]
        inter, assumed = network(r.get("inter_node"), family, nodes)
        intra = LINKS["nvlink3" if family == "A100" else "nvlink4"]
        tps = measured.get("tokens_per_second_per_gpu") or (derived.get("tokens_per_second_per_gpu") or {}).get("value")
        from_mfu = False
        if tps is None and measured.get("mfu"):  # MFU only: tokens/s by the PaLM count it was computed with
            peak = GPUS[CATALOG_GPU[r["gpu"]]].bf16_flops
            tps = measured["mfu"] * peak / model.flops_per_token(seq_len, "full")
            from_mfu = True
        if tps is None:
            continue
        workload = Workload(model, "full", seq_len, global_batch, steps=1)
        out.append(Row(r["id"], r["source_url"], r["framework"], workload, layout, r["gpu"], family, intra, inter,
                       assumed, float(tps), from_mfu, bool(lay.get("compile"))))
    return out


RISING = 1.01  # a series whose published throughput per GPU rises more than this with its GPU count


@dataclass(frozen=True)
class ScaleConstants:
    efficiency: dict[str, float]  # per chip family: its compute efficiency over the H200's measured one
    sync_jitter: float
    comm_interference: float  # the share of the overlapped collectives' time they still cost the compute


def pool_for(row: Row, h200: GPU, constants: ScaleConstants) -> Pool:
    base = GPUS[CATALOG_GPU[row.gpu_name]]
    factor = constants.efficiency.get(row.family, 1.0)
    gpu = base.calibrated(matmul_efficiency=h200.matmul_efficiency * factor,
                          memory_efficiency=h200.memory_efficiency * factor)
    per_node = row.layout.gpus // row.layout.nodes
    return Pool("published", gpu, per_node, row.layout.nodes, row.intra, row.inter, 0.0)


def published_calibration(cal: Calibration, constants: ScaleConstants) -> Calibration:
    """The published frameworks fuse their blocks (flash attention, fused norms) whatever the MLP: every
    model takes the per-hidden rates of our fused Llama blocks, not those of the unfused GPT-2 ones."""
    return replace(cal, sync_jitter=constants.sync_jitter, comm_interference=constants.comm_interference,
                   act_bytes_per_hidden=dict.fromkeys(cal.act_bytes_per_hidden, cal.act_bytes_per_hidden["llama"]),
                   traffic_bytes_per_hidden=dict.fromkeys(cal.traffic_bytes_per_hidden,
                                                          cal.traffic_bytes_per_hidden["llama"]))


def predict(row: Row, cal: Calibration, h200: GPU, constants: ScaleConstants):
    e = estimate(row.workload, row.layout, pool_for(row, h200, constants), published_calibration(cal, constants))
    return row.workload.tokens_per_step / e.step_seconds / row.layout.gpus, e


def errors(data: list[Row], cal: Calibration, h200: GPU, constants: ScaleConstants) -> list[dict]:
    out = []
    for row in data:
        tps, e = predict(row, cal, h200, constants)
        out.append({"id": row.id, "held_out": row.held_out, "gpu": row.gpu_name, "gpus": row.layout.gpus,
                    "model": row.workload.model.name, "seq_len": row.workload.seq_len,
                    "micro_batch": row.layout.micro_batch,
                    "checkpointing": row.layout.checkpointed_share(row.workload.model.layers),
                    "measured": row.tokens_per_second_per_gpu, "predicted": tps,
                    "error": tps / row.tokens_per_second_per_gpu - 1, "exposed_comm_share": e.exposed_comm_share,
                    "assumed_network": row.assumed_network, "derived_from_mfu": row.derived_from_mfu,
                    "compiled": row.compiled})
    return out


def _loss(found: list[dict]) -> float:
    return statistics.fmean(math.log1p(r["error"]) ** 2 for r in found)


def _scaling_loss(found: list[dict]) -> float:
    """The squared log error of each series' weak scaling, where published throughput does not rise with
    the GPU count (a rise is the tables' other settings, no communication effect)."""
    series = [s for s in weak_scaling(found) if s["measured"] <= RISING]
    return statistics.fmean(math.log(s["predicted"] / s["measured"]) ** 2 for s in series) if series else 0.0


def _golden(loss, low: float, high: float, steps: int) -> float:
    for _ in range(steps):
        a, b = low + (high - low) * 0.382, low + (high - low) * 0.618
        if loss(a) < loss(b):
            high = b
        else:
            low = a
    return (low + high) / 2


def _efficiencies(fit_set: list[Row], cal: Calibration, h200: GPU, jitter: float, interference: float
                  ) -> ScaleConstants:
    """Per chip family, the efficiency factor that minimizes the squared log error of its rows."""
    efficiency = {}
    for family in sorted({r.family for r in fit_set}):
        rows_of = [r for r in fit_set if r.family == family]
        efficiency[family] = _golden(lambda f, rows_of=rows_of, family=family: _loss(errors(
            rows_of, cal, h200, ScaleConstants({family: f}, jitter, interference))), 0.2, 1.5, 30)
    return ScaleConstants(efficiency, jitter, interference)


def fit(data: list[Row], cal: Calibration, h200: GPU) -> ScaleConstants:
    """The constants that fit the fit set's rows and its weak scaling: per chip family the efficiency factor
    (the rows' level), the jitter and the interference of overlapped collectives (how throughput falls
    with the GPU count). A grid over the jitter; inside it, a golden-section search over the interference,
    each point with its own per-family efficiencies."""
    fit_set = [r for r in data if not r.held_out]

    def total(constants: ScaleConstants) -> float:
        found = errors(fit_set, cal, h200, constants)
        return _loss(found) + _scaling_loss(found)

    candidates = []
    for jitter in (0.0, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03):
        interference = _golden(lambda x, jitter=jitter: total(_efficiencies(fit_set, cal, h200, jitter, x)),
                               0.0, 0.6, 16)
        constants = _efficiencies(fit_set, cal, h200, jitter, interference)
        candidates.append((total(constants), constants))
    return min(candidates, key=lambda candidate: candidate[0])[1]


def weak_scaling(found: list[dict]) -> list[dict]:
    """Per series (one source and GPU; one model, sequence length, micro-batch and checkpointing: only the
    GPU count changes), tokens/s per GPU at its largest GPU count over its smallest, measured and predicted."""
    series: dict[tuple, list[dict]] = {}
    for r in found:
        series.setdefault((r["id"].split("-g")[0], r["gpu"], r["model"], r["seq_len"], r["micro_batch"],
                           r["checkpointing"]), []).append(r)
    out = []
    for key, members in series.items():
        counts = sorted({m["gpus"] for m in members})
        if len(counts) < 2:
            continue
        small = next(m for m in members if m["gpus"] == counts[0])
        large = next(m for m in members if m["gpus"] == counts[-1])
        out.append({"series": "/".join(map(str, key)), "from": counts[0], "to": counts[-1],
                    "held_out": small["held_out"], "measured": large["measured"] / small["measured"],
                    "predicted": large["predicted"] / small["predicted"],
                    "exposed_at_smallest": small["exposed_comm_share"],
                    "exposed_at_largest": large["exposed_comm_share"]})
    return out


def summary(found: list[dict]) -> dict:
    def stats(part: list[dict]) -> dict:
        errs = [r["error"] for r in part]
        return {"rows": len(part), "median_error": statistics.median(errs),
                "median_abs_error": statistics.median(abs(e) for e in errs), "max_abs_error": max(abs(e) for e in errs),
                "share_over_predicted": sum(e > 0 for e in errs) / len(errs),
                # measured over predicted tokens/s: above 1, faster than predicted
                "p10_ratio": _quantile([1 / (1 + e) for e in errs], 0.1),
                "p90_ratio": _quantile([1 / (1 + e) for e in errs], 0.9)}
    return {"fit": stats([r for r in found if not r["held_out"]]),
            "held_out": stats([r for r in found if r["held_out"] and not r["compiled"]]),
            # outside what the model knows: torch.compile's fusion in another framework (reported, not held to)
            "held_out_compiled": stats([r for r in found if r["held_out"] and r["compiled"]])}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def one_gpu_ratios() -> dict:
    """Measured over predicted tokens/s (predicted over measured step time) on the committed one-GPU H200
    runs held out of their fit: the band of a plan on one measured GPU."""
    from tunewright_fit import calibration_fit

    results = ROOT / "benchmarks" / "results"
    cal, h200 = load()
    found = calibration_fit.compare(calibration_fit.load_measurements(sorted(results.glob("gpu_*_h200.json"))),
                                    cal, h200)
    ratios = [1 + r["step_error"] for r in found if not r["fit_set"]]
    return {"rows": len(ratios), "p10_ratio": _quantile(ratios, 0.1), "p90_ratio": _quantile(ratios, 0.9)}


def save(path: Path, constants: ScaleConstants, data: list[Row], found: list[dict]) -> None:
    """The constants, with the error ratios (measured / predicted tokens/s) the band is made of."""
    s = summary(found)
    networks = [r.inter.bus_bytes_per_s for r in data if r.inter is not None]
    path.write_text(json.dumps({
        "source": "benchmarks/published/multi_gpu_runs.json", "fit_framework": FIT_FRAMEWORK,
        "efficiency_over_h200": constants.efficiency, "sync_jitter": constants.sync_jitter,
        "comm_interference": constants.comm_interference,
        "held_out": {k: s["held_out"][k] for k in ("rows", "median_error", "median_abs_error", "max_abs_error",
                                                    "p10_ratio", "p90_ratio")},
        "fit": {k: s["fit"][k] for k in ("rows", "median_abs_error", "max_abs_error")},
        "one_gpu_h200": one_gpu_ratios(),
        "largest_gpu_count": max(r["gpus"] for r in found),
        "longest_sequence": LONGEST_SEQUENCE,
        "network_bus_bytes_per_s": [min(networks), max(networks)],
    }, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fit", "report"])
    parser.add_argument("--published", type=Path, default=PUBLISHED)
    parser.add_argument("--out", type=Path, default=SCALE_FILE)
    args = parser.parse_args(argv)
    cal, h200 = load()
    data = rows(args.published)
    if args.command == "fit":
        constants = fit(data, cal, h200)
    else:
        committed = json.loads(SCALE_FILE.read_text())
        constants = ScaleConstants(committed["efficiency_over_h200"], committed["sync_jitter"],
                                   committed["comm_interference"])
    found = errors(data, cal, h200, constants)
    if args.command == "fit":
        save(args.out, constants, data, found)
    print(f"constants: {constants}")
    for r in sorted(found, key=lambda r: (r["held_out"], r["gpu"], r["gpus"])):
        flags = " ".join(flag for flag, on in (("assumed-network", r["assumed_network"]),
                                                ("from-MFU", r["derived_from_mfu"]), ("compiled", r["compiled"])) if on)
        print(f"{'held-out' if r['held_out'] else 'fit     '} {r['id'][:48]:48} {r['gpus']:4} measured "
              f"{r['measured']:8.0f} predicted {r['predicted']:8.0f} {r['error']:+6.1%} exposed "
              f"{r['exposed_comm_share']:5.1%} {flags}")
    for s in weak_scaling(found):
        print(f"weak scaling {s['series'][:60]:60} {s['from']:>3}->{s['to']:<3} measured {s['measured']:.3f} "
              f"predicted {s['predicted']:.3f} exposed {s['exposed_at_largest']:.1%}")
    print(json.dumps(summary(found), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
