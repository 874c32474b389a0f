"""The planner: model profile + method + batch + GPU pool → layout, predictions and the reasons.

Pure functions, no Kubernetes: `search.plan(workload, pool, calibration)` returns a `JobPlan` (spec.py); the memory
and time model is `estimate.py`, its constants are fitted to measured runs in `calibration_fit.py` (offline,
numpy) and read by `calibration.load`.
"""
