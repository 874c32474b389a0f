"""A job's measured telemetry, beside the plan's predictions (DESIGN.md, telemetry): pure functions.

Communication share comes from the runtime's profiler windows (`comm` records). MFU and cost are derived
with the plan's own definitions, so that measured and predicted compare exactly: MFU scales with tokens/s
(same model FLOPs, same GPUs, same peak), and cost is the time the GPUs have been held at the plan's
price per second (GPUs x price per GPU-hour).
"""

from __future__ import annotations

from datetime import datetime


def measured(plan: dict | None, comm: dict | None, tokens_per_second: float | None, started_at: datetime | None,
             finished_at: datetime | None, now: datetime) -> dict:
    comm = comm or {}
    out = {"commShare": comm.get("comm_share"), "commShareExposed": comm.get("comm_share_exposed"),
           "commShareMaxRank": comm.get("comm_share_max_rank"), "commMeasuredAtStep": comm.get("step"),
           "mfu": None, "costUSD": None}
    predicted = (plan or {}).get("predicted")
    if not predicted:
        return out  # CPU runs: no plan, no peak FLOP/s, no price
    if tokens_per_second and predicted.get("tokens_per_second"):
        out["mfu"] = predicted["mfu"] * tokens_per_second / predicted["tokens_per_second"]
    if started_at is not None and predicted.get("duration_seconds"):
        held = ((finished_at or now) - started_at).total_seconds()
        out["costUSD"] = max(0.0, held) * predicted["cost_usd"] / predicted["duration_seconds"]
    return out
