"""Our runtime's runs on one GPU of another chip against the planner's one-GPU prediction there: a check on
runs nothing was fitted on.

The planner runs an H100 at the H200's measured efficiencies (the same die, GH100, at its own datasheet memory
bandwidth: `calibration.for_gpu`); before 2026-12-07 it took the factor published FSDP runs on H100s reached over
our H200 (0.70) for one GPU too. Each row prints both. Reads `fp8_check.py` result files (rows of one case and
precision) and `vs_hf.py` ones (tunewright's rows: `tunewright` in bf16, `tw-fp8`; run without Ray, which the
product path measured within 1% of).

  PYTHONPATH=core:fitting python -m tunewright_fit.chip_check benchmarks/results/{fp8_check,vs_}*_h100_*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from tunewright_core.planner import calibration
from tunewright_core.planner.estimate import Layout, Workload, estimate
from tunewright_core.planner.hardware import GIB, GPU, GPUS, gpu_from_product_name
from tunewright_fit.calibration_fit import MEASURED_MODELS, measured_pool

VS_HF_SYSTEMS = {"tunewright": "bf16", "tw-fp8": "fp8"}  # vs_hf.py's systems that are our runtime
RECOMPUTED = "recompute: elementwise work in backward"  # the runtime's kernels line, recompute on


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    chip: str  # the catalog key
    workload: Workload
    layout: Layout
    tokens_per_second: float
    peak_memory_gib: float


def _run(name: str, source: str, chip: str, case: dict, precision: str, recompute: str, row: dict) -> Run:
    workload = Workload(MEASURED_MODELS[case["model"]], case["method"], case["seq_len"], case["micro_batch"], steps=1,
                        precision=precision, recompute=recompute)
    layout = Layout("single", 1, 1, case["micro_batch"], 1, case.get("activation_checkpointing", False))
    return Run(name, source, chip, workload, layout, row["tokens_per_second"], row["peak_memory_gib"])


def _skipped(row: dict, case: dict) -> str | None:
    """Why a finished-or-not row is no check of the planner's one-GPU prediction, if it is none."""
    if not row.get("tokens_per_second"):
        return f"did not finish ({(row.get('error') or row.get('skipped') or 'no tokens/s')[:80]!r})"
    if case.get("compile") == "off":
        return "blocks eager (the planner models the runtime's default: compiled)"
    if case.get("data", "fixed") != "fixed" or case.get("gpus", 1) != 1:
        return "variable-length data or several GPUs (the check is of fixed rows on one GPU)"
    return None


def load_runs(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Our runtime's runs in `fp8_check.py` and `vs_hf.py` result files, on whichever chip each file names, and
    a line for each row left out (why). A file of another script, or of a card the catalog lacks, is refused."""
    runs, skipped = [], []
    for path in map(Path, paths):
        data = json.loads(path.read_text())
        if path.name.startswith("fp8_check"):
            card, rows = data["gpu"], [(f"{r['case']['name']}-{r['precision']}", r["case"], r["precision"], r)
                                       for r in data["runs"]]
        elif path.name.startswith("vs_"):
            card, rows = data["environment"]["gpu"], [
                (f"{case}-{system} (no Ray)", by_system[system].get("case", {}), precision, by_system[system])
                for case, by_system in data["runs"].items() for system, precision in VS_HF_SYSTEMS.items()
                if system in by_system]
        else:
            raise ValueError(f"{path.name}: chip_check reads fp8_check.py and vs_hf.py results only")
        chip = gpu_from_product_name(card)
        if chip is None:
            raise ValueError(f"{path.name}: a run on {card}, a card the planner's catalog does not know")
        for name, case, precision, row in rows:
            why = _skipped(row, case)
            if why:
                skipped.append(f"{path.name}: {name}: {why}")
                continue
            # as the run did it, by the runtime's kernels line (kernels.kernel_choices' words)
            recompute = case.get("recompute") or ("on" if RECOMPUTED in row.get("kernels", "") else "off")
            runs.append(_run(name, path.name, chip, case, precision, recompute, row))
    return runs, skipped


def published_factor_gpu(chip: str) -> GPU:
    """The chip as the planner ran one of it before: the H200's efficiencies times the published factor."""
    _, h200 = calibration.load()
    factor = calibration.published_factor(chip)
    return GPUS[chip].calibrated(matmul_efficiency=h200.matmul_efficiency * factor,
                                 memory_efficiency=h200.memory_efficiency * factor)


def compare(runs: list[Run]) -> list[dict]:
    cal, _ = calibration.load()
    rows = []
    for r in runs:
        now = estimate(r.workload, r.layout, measured_pool(calibration.for_gpu(r.chip), 1), cal)
        before = estimate(r.workload, r.layout, measured_pool(published_factor_gpu(r.chip), 1), cal)
        predicted = r.workload.tokens_per_step / now.step_seconds
        rows.append({"name": r.name, "source": r.source, "chip": r.chip, "precision": r.workload.precision,
                     "measured": r.tokens_per_second, "predicted": predicted,
                     "error": predicted / r.tokens_per_second - 1,
                     "error_before": r.workload.tokens_per_step / before.step_seconds / r.tokens_per_second - 1,
                     "memory_measured_gib": r.peak_memory_gib, "memory_predicted_gib": now.peak_memory_bytes / GIB,
                     "memory_error": now.peak_memory_bytes / GIB / r.peak_memory_gib - 1})
    return rows


def report(rows: list[dict], skipped: list[str]) -> str:
    lines = ["| run | chip | measured tok/s | predicted | error | with the published factor | peak GiB measured "
             "| predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['chip']} | {r['measured']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | "
                     f"{r['error_before']:+.1%} | {r['memory_measured_gib']:.1f} | {r['memory_predicted_gib']:.1f} | "
                     f"{r['memory_error']:+.1%} |")
    for precision in sorted({r["precision"] for r in rows}):
        errors = [abs(r["error"]) for r in rows if r["precision"] == precision]
        lines.append(f"- {precision}: {len(errors)} runs, median abs tokens/s error {statistics.median(errors):.1%}, "
                     f"max {max(errors):.1%}")
    lines.append(f"- peak memory: max abs error {max(abs(r['memory_error']) for r in rows):.1%}")
    lines += [f"- left out: {line}" for line in skipped]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="fp8_check.py or vs_hf.py result files")
    runs, skipped = load_runs(parser.parse_args().results)
    print(report(compare(runs), skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
