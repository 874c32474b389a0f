"""Plan a FineTuneJob: spec → workload → plan → the layout the runtime config is built from."""

from __future__ import annotations

import math

from tunewright_operator.jobconfig import global_batch
from tunewright_operator.planner.estimate import Calibration, Layout, Workload
from tunewright_operator.planner.hardware import Pool
from tunewright_operator.planner.models import ModelProfile
from tunewright_operator.planner.search import Plan, plan
from tunewright_operator.spec import FineTuneJobSpec


def workload(spec: FineTuneJobSpec, profile: ModelProfile, dataset_tokens: int | None) -> Workload:
    hp = spec.hyperparameters
    batch = global_batch(spec)
    if hp.max_steps is not None:
        steps = hp.max_steps
    elif dataset_tokens is None:
        raise ValueError("hyperparameters.maxSteps: needed when the dataset's size is unknown")
    else:
        steps = max(1, (hp.epochs or 1) * math.ceil(dataset_tokens / (batch * hp.seq_len)))
    return Workload(profile, spec.method.type, hp.seq_len, batch, steps, lora_rank=spec.method.lora.r)


def plan_job(spec: FineTuneJobSpec, pool: Pool, calibration: Calibration, profile: ModelProfile,
             dataset_tokens: int | None = None) -> Plan:
    res = spec.resources
    objective = "fastest-within-budget" if res.budget_usd is not None else "cheapest"
    return plan(workload(spec, profile, dataset_tokens), pool, calibration, objective=objective,
                strategy=res.strategy, max_gpus=res.max_gpus, budget_usd=res.budget_usd)


def layout_of(chosen: Plan) -> Layout:
    return Layout(chosen.strategy, chosen.gpus, chosen.nodes, chosen.micro_batch, chosen.grad_accum,
                  chosen.activation_checkpointing, chosen.shard_group, chosen.cpu_offload)
