"""Job configs pointing at the tiny models (tests/conftest.py builds them once per session)."""

import copy
import os
from pathlib import Path

from tunewright_core.records import TelemetryRecord, read_records
from tunewright_jobs.config import JobConfig
from tunewright_jobs.tiny import DATA_DIR


def base_config(model_dir: Path, output_dir: Path, **overrides) -> dict:
    """A small, fast job: LoRA on the tiny task, single CPU worker, no dropout (deterministic)."""
    config = {
        "name": "test-job",
        "output_dir": str(output_dir),
        "model": {"source": str(model_dir)},
        "method": {"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "dataset": {"train": str(DATA_DIR / "train.jsonl"), "validation": str(DATA_DIR / "validation.jsonl"),
                    "format": "chat"},
        "hyperparameters": {"max_steps": 20, "learning_rate": 5e-3, "global_batch_size": 4, "seq_len": 128,
                            "warmup_ratio": 0.0, "seed": 0},
        "strategy": {"type": "single", "num_workers": 1, "micro_batch_size": 4},
        "eval": {"max_batches": 4},
    }
    return merge(config, overrides)


def merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def make_config(model_dir: Path, output_dir: Path, **overrides) -> JobConfig:
    return JobConfig.from_dict(base_config(model_dir, output_dir, **overrides))


def write_config(path: Path, cfg: JobConfig) -> Path:
    path.write_text(cfg.to_json())
    return path


def metrics(cfg: JobConfig, event: str = "step") -> list[TelemetryRecord]:
    """The run's records of one kind (reading parses every record, so each run checks the contract)."""
    return [r for r in read_records(cfg.metrics_path) if r.event == event]


def python_path() -> str:
    """PYTHONPATH for a child process running the runtime from this checkout (installed or not)."""
    root = Path(__file__).resolve().parents[2]  # the runtime, and core's records it imports
    return os.pathsep.join(filter(None, [str(root / "jobs"), str(root / "core"), os.environ.get("PYTHONPATH")]))
