"""Plan a FineTuneJob: spec → workload → the JobPlan its runtime config is built from."""

from __future__ import annotations

import math

from tunewright_operator.planner.estimate import Calibration, Workload
from tunewright_operator.planner.hardware import Pool
from tunewright_operator.planner.models import ModelProfile
from tunewright_operator.planner.search import plan
from tunewright_operator.spec import FineTuneJobSpec, JobPlan

JSONL_BYTES_PER_TOKEN = 4


def dataset_tokens_of(jsonl_bytes: int) -> int:
    """Tokens in a JSONL dataset, estimated from its size until a run counts them."""
    return max(1, jsonl_bytes // JSONL_BYTES_PER_TOKEN)


def check_fits_model(spec: FineTuneJobSpec, profile: ModelProfile) -> None:
    """Sizes that follow from the model: ValueError naming the field when the spec asks for more."""
    hp = spec.hyperparameters
    if profile.max_positions and hp.seq_len > profile.max_positions:
        raise ValueError(f"hyperparameters.seqLen: {hp.seq_len} is more than the {profile.max_positions} positions "
                         f"{profile.name} has (learned position embeddings)")
    if spec.method.type == "lora" and spec.method.lora.r > profile.hidden:
        raise ValueError(f"method.lora.r: a rank of {spec.method.lora.r} is more than {profile.name}'s hidden size "
                         f"({profile.hidden}): the adapters would be larger than the weights they adapt")
    if spec.method.type == "lora" and (names := profile.linear_module_names):
        # a dotted target is a path PEFT matches by suffix: only the runtime, holding the model, can check it
        unmatched = [t for t in spec.method.lora.target_modules if t != "all-linear" and "." not in t
                     and t not in names]
        if unmatched:
            raise ValueError(f"method.lora.targetModules: {', '.join(unmatched)} match no module of {profile.name} "
                             f"({profile.model_type}); its linear modules are {', '.join(sorted(names))}, "
                             "or all-linear for every one")


def workload(spec: FineTuneJobSpec, profile: ModelProfile, dataset_tokens: int | None) -> Workload:
    check_fits_model(spec, profile)
    hp = spec.hyperparameters
    batch = hp.sequences_per_step
    if hp.max_steps is not None:
        steps = hp.max_steps
    elif dataset_tokens is None:
        raise ValueError("hyperparameters.maxSteps: needed when the dataset's size is unknown")
    else:
        steps = max(1, hp.epochs * math.ceil(dataset_tokens / (batch * hp.seq_len)))
    return Workload(profile, spec.method.type, hp.seq_len, batch, steps, lora_rank=spec.method.lora.r)


def plan_job(spec: FineTuneJobSpec, pool: Pool, calibration: Calibration, profile: ModelProfile,
             dataset_tokens: int | None = None) -> JobPlan:
    res = spec.resources
    objective = ("fastest-within-budget" if res.budget_usd is not None
                 else "cheapest-within-deadline" if res.deadline_seconds is not None else "cheapest")
    return plan(workload(spec, profile, dataset_tokens), pool, calibration, objective=objective,
                strategy=res.strategy, max_gpus=res.max_gpus, budget_usd=res.budget_usd,
                deadline_seconds=res.deadline_seconds)
