"""Measured telemetry beside the plan's predictions: the derivations are the plan's own definitions."""

from datetime import UTC, datetime, timedelta

import pytest

from tunewright_api.telemetry import measured

START = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PLAN = {"predicted": {"mfu": 0.40, "tokens_per_second": 100_000.0, "duration_seconds": 3600.0, "cost_usd": 32.0}}
COMM = {"step": 200, "comm_share": 0.12, "comm_share_exposed": 0.03, "comm_share_max_rank": 0.15}


@pytest.mark.parametrize(("plan", "comm", "tokens_per_second", "finished", "expected"), [
    # on plan: the measured MFU is the predicted one, the cost so far is the hour's share of the prediction
    (PLAN, COMM, 100_000.0, None, {"mfu": 0.40, "costUSD": 16.0, "commShare": 0.12, "commShareExposed": 0.03}),
    # 20% slower than predicted: 20% less MFU; a finished job's cost stops at its end
    (PLAN, COMM, 80_000.0, START + timedelta(minutes=15), {"mfu": 0.32, "costUSD": 8.0}),
    # nothing measured yet
    (PLAN, None, None, None, {"mfu": None, "costUSD": 16.0, "commShare": None}),
    # a CPU job has no plan predictions: no MFU or cost, communication still measured
    (None, COMM, 5_000.0, None, {"mfu": None, "costUSD": None, "commShare": 0.12, "commMeasuredAtStep": 200}),
])
def test_measured_beside_predicted(plan, comm, tokens_per_second, finished, expected):
    got = measured(plan, comm, tokens_per_second, START, finished, now=START + timedelta(minutes=30))
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value) if value is not None else None), key
