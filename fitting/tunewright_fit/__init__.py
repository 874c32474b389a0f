"""The offline fitters: the planner's constants from measured runs (calibration_fit: one-GPU runs; scale_fit:
published multi-GPU runs). Run by hand (numpy), never on the runtime path; they write core's planner/*.json."""
