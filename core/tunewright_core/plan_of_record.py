"""One plan per job. The API plans a job when it is submitted and writes that plan onto its FineTuneJob
(`plan_annotation`); the operator adopts it (`adopted_plan`) while the spec and the GPUPool it was made for
are unchanged, and plans itself only for a job made with kubectl, or after a change to either.

The annotation is a claim, checked before it is used: the fingerprint must match the spec and pool as the
operator reads them, and the plan must be a valid `JobPlan` on that pool, within its size. A user who can
write the annotation could as well have asked for those GPUs in the spec.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

from tunewright_core.pools import planner_pool
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan

MAX_PLAN_CHARACTERS = 65536  # a plan with its rejected options is a few kB; annotations total 256 kB


def spec_hash(spec: FineTuneJobSpec) -> str:
    """What a run is made from: everything in the spec but `suspend` (which may change while it runs). An sft
    spec's hash leaves out the fields dpo added (method.objective, method.dpo), and at their defaults those QLoRA
    added and the lighter optimizer state's (method.lora.quantization, checkpoint.exportMerged,
    hyperparameters.optimizerState, resources.precision), so that it is what it was before them: a job that ran then is not taken
    for a changed one (nor its plan of record for another spec's)."""
    exclude: dict = {"suspend": True}
    method: dict = {}
    if spec.method.objective == "sft":
        method.update(objective=True, dpo=True)
    if spec.method.lora.quantization == "none":
        method["lora"] = {"quantization": True}
    if method:
        exclude["method"] = method
    if not spec.checkpoint.export_merged:
        exclude["checkpoint"] = {"export_merged": True}
    if spec.hyperparameters.optimizer_state == "fp32":
        exclude["hyperparameters"] = {"optimizer_state": True}
    if spec.resources.precision == "bf16":
        exclude["resources"] = {"precision": True}
    return hashlib.sha256(spec.model_dump_json(by_alias=True, exclude=exclude).encode()).hexdigest()


def fingerprint(spec: FineTuneJobSpec, pool_name: str, pool: GPUPoolSpec) -> str:
    """The spec and the pool a plan was made for (not what the pool has learned since: that refines the
    next job's plan, it does not invalidate this one)."""
    made_of = json.dumps([spec_hash(spec), pool_name, pool.model_dump(by_alias=True, mode="json")], sort_keys=True)
    return hashlib.sha256(made_of.encode()).hexdigest()


def plan_annotation(spec: FineTuneJobSpec, pool_name: str, pool: GPUPoolSpec, plan: JobPlan) -> str:
    return json.dumps({"for": fingerprint(spec, pool_name, pool),
                       "plan": plan.model_dump(by_alias=True, mode="json", exclude_none=True)}, sort_keys=True)


def _not_finite(constant: str) -> float:
    raise ValueError(f"{constant} is not a number a plan holds")


def adopted_plan(annotation: str | None, spec: FineTuneJobSpec, pool_name: str, pool: GPUPoolSpec) -> JobPlan | None:
    """The plan the annotation holds, when it was made for this spec on this pool and is one the planner
    could have made there; None (plan again) otherwise. The fingerprint proves only what it was made for,
    not who made it: whoever can write the job's annotations can write one, so the plan is held to
    everything the spec and the pool allow (its size, strategy, workers and host memory)."""
    if not annotation or len(annotation) > MAX_PLAN_CHARACTERS:
        return None
    try:
        written = json.loads(annotation, parse_constant=_not_finite)  # no NaN or Infinity in a plan
        if not isinstance(written, dict) or written.get("for") != fingerprint(spec, pool_name, pool):
            return None
        plan = JobPlan.model_validate(written.get("plan"))
    except (ValueError, ValidationError):
        return None
    return plan if within_bounds(plan, spec, pool_name, pool) else None


def within_bounds(plan: JobPlan, spec: FineTuneJobSpec, pool_name: str, pool: GPUPoolSpec) -> bool:
    """Whether the planner could have made `plan` for `spec` on `pool`: one worker a GPU, whole nodes of the
    pool, no more GPUs than the spec allows, its strategy where it forces one, the base's quantization and the
    optimizer state where it sets them, its precision, host memory within a node's."""
    resources = spec.resources
    host = plan.predicted.host_memory_gib_per_node if plan.predicted else 0.0
    return (plan.pool == pool_name and plan.device == "gpu" and plan.workers == plan.gpus >= 1
            and plan.gpus % plan.nodes == 0 and plan.nodes <= pool.max_nodes
            and plan.gpus // plan.nodes <= pool.gpus_per_node
            and (resources.max_gpus is None or plan.gpus <= resources.max_gpus)
            and resources.strategy in ("auto", plan.strategy)
            and plan.quantization in allowed_quantizations(spec)
            and (plan.quantization == "none" or (plan.strategy in ("single", "ddp") and not plan.cpu_offload))
            and plan.optimizer_state in allowed_optimizer_states(spec)
            and plan.precision == spec.resources.precision
            and plan.shard_group >= 1 and plan.gpus % plan.shard_group == 0
            and host <= planner_pool(pool_name, pool).host_memory_per_node_gib)


def allowed_quantizations(spec: FineTuneJobSpec) -> tuple[str, ...]:
    """The LoRA base quantizations a plan for `spec` may load: the one it asks for, either for auto."""
    asked = spec.method.lora.quantization if spec.method.type == "lora" else "none"
    return ("none", "nf4") if asked == "auto" else (asked,)


def allowed_optimizer_states(spec: FineTuneJobSpec) -> tuple[str, ...]:
    """The optimizer states a plan for `spec` may hold: the one it asks for, either for auto (full only)."""
    asked = spec.hyperparameters.optimizer_state if spec.method.type == "full" else "fp32"
    return ("fp32", "bf16") if asked == "auto" else (asked,)
