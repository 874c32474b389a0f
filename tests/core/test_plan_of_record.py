"""The plan of record: adopted only for the spec and pool it was made for, and only as a valid plan that
fits the pool (plan_of_record.py)."""

import json

import pytest

from tunewright_core.plan_of_record import (
    MAX_PLAN_CHARACTERS,
    adopted_plan,
    fingerprint,
    plan_annotation,
    within_bounds,
)
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan

SPEC = FineTuneJobSpec.model_validate({
    "model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "lora"},
    "dataset": {"train": "pvc://datasets/train.jsonl"}, "hyperparameters": {"maxSteps": 10, "globalBatchSize": 16},
    "checkpoint": {"storage": "pvc://checkpoints/x"}})
POOL = GPUPoolSpec.model_validate({"gpu": "H100", "gpusPerNode": 8, "maxNodes": 2, "intraNode": "nvlink4",
                                   "interNode": "ib-8x400g", "pricePerGPUHour": 2.5, "workerImage": "w:1"})
PLAN = JobPlan(pool="h100", strategy="fsdp", workers=16, gpus=16, nodes=2, micro_batch=1, grad_accum=1,
               explanation="fsdp over two nodes")


def edited(model, **fields):
    return model.model_copy(update=fields)


def with_plan(**fields) -> str:
    written = json.loads(plan_annotation(SPEC, "h100", POOL, PLAN))
    written["plan"].update(fields)
    return json.dumps(written)


@pytest.mark.parametrize(("annotation", "spec", "pool_name", "pool", "adopted"), [
    (plan_annotation(SPEC, "h100", POOL, PLAN), SPEC, "h100", POOL, True),
    # suspend is not part of what a run is made from: a job suspended and resumed keeps its plan
    (plan_annotation(SPEC, "h100", POOL, PLAN), edited(SPEC, suspend=True), "h100", POOL, True),
    (plan_annotation(SPEC, "h100", POOL, PLAN),
     edited(SPEC, hyperparameters=edited(SPEC.hyperparameters, max_steps=11)), "h100", POOL, False),
    (plan_annotation(SPEC, "h100", POOL, PLAN), SPEC, "h100", edited(POOL, price_per_gpu_hour=3.0), False),
    (plan_annotation(SPEC, "h100", POOL, PLAN), SPEC, "other", POOL, False),
    (None, SPEC, "h100", POOL, False),
    ("", SPEC, "h100", POOL, False),
    ("not json", SPEC, "h100", POOL, False),
    ("[1, 2]", SPEC, "h100", POOL, False),
    (json.dumps({"for": fingerprint(SPEC, "h100", POOL), "plan": {"pool": "h100"}}), SPEC, "h100", POOL, False),
    (with_plan(gpus=24, workers=24, nodes=3), SPEC, "h100", POOL, False),  # more nodes than the pool has
    (with_plan(gpus=32), SPEC, "h100", POOL, False),  # more GPUs than its nodes hold
    (with_plan(pool="elsewhere"), SPEC, "h100", POOL, False),
    (with_plan(device="cpu", gpus=0), SPEC, "h100", POOL, False),
    (with_plan(explanation="x" * MAX_PLAN_CHARACTERS), SPEC, "h100", POOL, False),
])
def test_adopted_only_as_made(annotation, spec, pool_name, pool, adopted):
    found = adopted_plan(annotation, spec, pool_name, pool)
    assert (found == PLAN) if adopted else found is None


def real_plan() -> JobPlan:
    from tunewright_core.planner import calibration
    from tunewright_core.planner.jobs import plan_job
    from tunewright_core.planner.models import lookup
    from tunewright_core.pools import planner_pool

    cal, _ = calibration.load()
    return plan_job(SPEC, planner_pool("h100", POOL), cal, lookup(SPEC.model.source), None)


@pytest.mark.parametrize(("change", "spec"), [
    ({"workers": 8}, SPEC),  # fewer workers than GPUs: Ray Train would wait for the rest forever
    ({"gpus": 0, "workers": 0}, SPEC),
    ({"gpus": 10, "workers": 10, "nodes": 3}, SPEC),  # not spread evenly over its nodes
    ({"shard_group": 5}, SPEC),
    ({}, SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"max_gpus": 8})})),
    ({}, SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"strategy": "ddp"})})),
])
def test_a_plan_the_spec_or_pool_would_not_allow_is_not_adopted(change, spec):
    """The fingerprint says what a plan was made for, not who made it: the plan is held to the spec and pool."""
    plan = PLAN.model_copy(update=change)
    assert adopted_plan(plan_annotation(spec, "h100", POOL, plan), spec, "h100", POOL) is None


def test_host_memory_beyond_a_node_s_or_not_a_number_is_not_adopted():
    plan = real_plan()
    assert adopted_plan(plan_annotation(SPEC, "h100", POOL, plan), SPEC, "h100", POOL) == plan  # as planned
    greedy = plan.model_copy(update={"cpu_offload": True, "predicted": plan.predicted.model_copy(
        update={"host_memory_gib_per_node": 1900.0})})
    assert adopted_plan(plan_annotation(SPEC, "h100", POOL, greedy), SPEC, "h100", POOL) is None
    not_a_number = plan_annotation(SPEC, "h100", POOL, plan).replace('"stepSeconds": ', '"stepSeconds": NaN, "x": ', 1)
    assert "NaN" in not_a_number and adopted_plan(not_a_number, SPEC, "h100", POOL) is None


# (spec field, its value, the plan's field, its value, adopted): each setting a plan must follow, auto either way
FOLLOWED = [
    ({"method": {"lora": {"quantization": q}}}, "quantization", planned, ok)
    for q, planned, ok in [("none", "none", True), ("none", "nf4", False), ("nf4", "nf4", True),
                           ("nf4", "none", False), ("auto", "nf4", True), ("auto", "none", True)]
] + [
    ({"method": {"type": "full"}, "hyperparameters": {"optimizerState": s}}, "optimizer_state", planned, ok)
    for s, planned, ok in [("fp32", "fp32", True), ("fp32", "bf16", False), ("bf16", "bf16", True),
                           ("bf16", "fp32", False), ("auto", "bf16", True), ("auto", "fp32", True)]
] + [
    ({"resources": {"precision": p}}, "precision", planned, ok)
    for p, planned, ok in [("bf16", "bf16", True), ("bf16", "fp8", False), ("fp8", "fp8", True),
                           ("fp8", "bf16", False)]
]


@pytest.mark.parametrize(("spec_part", "field", "planned", "adopted"), FOLLOWED)
def test_a_plan_of_record_follows_the_specs_base_state_and_precision(spec_part, field, planned, adopted):
    spec = FineTuneJobSpec.model_validate({"model": {"source": "m"}, "dataset": {"train": "file-1"}, **spec_part})
    one_gpu = GPUPoolSpec.model_validate({"gpu": "H200", "gpusPerNode": 1, "maxNodes": 1, "intraNode": "nvlink4",
                                          "pricePerGPUHour": 3.5, "workerImage": "w:1"})
    plan = JobPlan(pool="p", strategy="single", workers=1, gpus=1, micro_batch=1, grad_accum=8,
                   explanation="test", **{field: planned})
    assert within_bounds(plan, spec, "p", one_gpu) is adopted
