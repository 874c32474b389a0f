import pytest
from pydantic import ValidationError

from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import GPUS, LINKS, Pool
from tunewright_core.planner.jobs import plan_job, workload
from tunewright_core.planner.models import CATALOG
from tunewright_core.spec import (
    DEFAULT_GLOBAL_BATCH,
    FineTuneJobSpec,
    GPUPoolSpec,
    JobPlan,
    error_message,
)

SPEC = {
    "model": {"source": "hf://meta-llama/Llama-3.1-8B"},
    "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "targetModules": ["all-linear"]}},
    "dataset": {"train": "file-abc", "format": "chat"},
    "hyperparameters": {"maxSteps": 500, "learningRate": 1e-4, "globalBatchTokens": 131072, "seqLen": 2048},
    "resources": {"maxGPUs": 8, "strategy": "auto", "budgetUSD": 500},
}


def test_camel_case_on_the_wire():
    spec = FineTuneJobSpec.model_validate(SPEC)
    assert spec.resources.max_gpus == 8 and spec.resources.budget_usd == 500
    assert spec.method.lora.target_modules == ["all-linear"]
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["resources"]["maxGPUs"] == 8 and dumped["hyperparameters"]["globalBatchTokens"] == 131072
    assert FineTuneJobSpec.model_validate(dumped) == spec
    assert spec.hyperparameters.sequences_per_step == 64
    unset = FineTuneJobSpec.model_validate({**SPEC, "hyperparameters": {"maxSteps": 5}})
    assert unset.hyperparameters.sequences_per_step == DEFAULT_GLOBAL_BATCH


@pytest.mark.parametrize(("patch", "field"), [
    ({"method": {"type": "qlora"}}, ("method", "type")),
    ({"resources": {"maxGPUs": 0}}, ("resources", "maxGPUs")),
    ({"hyperparameters": {"seqLen": -1}}, ("hyperparameters", "seqLen")),
    ({"surprise": True}, ("surprise",)),
    ({"hyperparameters": {"globalBatchTokens": 1000, "seqLen": 512}}, ("hyperparameters",)),
    ({"hyperparameters": {"globalBatchTokens": 4096, "globalBatchSize": 2}}, ("hyperparameters",)),
])
def test_rejections_name_the_camel_case_field(patch, field):
    with pytest.raises(ValidationError) as err:
        FineTuneJobSpec.model_validate(SPEC | patch)
    assert any(e["loc"][: len(field)] == field for e in err.value.errors())


def unknown_key_said(model, data: dict) -> str:
    (error,) = pytest.raises(ValidationError, model.model_validate, data).value.errors()
    return error_message(error, model)


@pytest.mark.parametrize(("section", "key", "says"), [
    ("hyperparameters", {"learningRte": 1e-4}, "unknown key; did you mean learningRate?"),
    ("hyperparameters", {"learning_rte": 1e-4}, "unknown key; did you mean learningRate?"),  # snake_case is read too
    ("hyperparameters", {"globalBatch": 64}, "unknown key; did you mean globalBatchSize or globalBatchTokens?"),
    ("resources", {"maxGPU": 8}, "unknown key; did you mean maxGPUs?"),
    ("method", {"lora": {"targetModule": ["q_proj"]}}, "unknown key; did you mean targetModules?"),
    ("method", {"lora": {"rank": 8}}, "unknown key; the keys here are: r, alpha, dropout, targetModules, quantization"),
])
def test_an_unknown_key_names_the_closest_known_ones(section, key, says):
    assert unknown_key_said(FineTuneJobSpec, {**SPEC, section: {**SPEC.get(section, {}), **key}}) == says


def test_an_unknown_key_is_found_through_lists_and_the_list_of_keys_is_bounded():
    pool = {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4", "pricePerGPUHour": 2.5,
            "workerImage": "w", "tolerations": [{"key": "gpu"}, {"keey": "gpu"}]}
    assert unknown_key_said(GPUPoolSpec, pool) == "unknown key; did you mean key?"
    said = unknown_key_said(JobPlan, {"pool": "p", "strategy": "ddp", "workers": 2, "gpus": 2, "microBatch": 1,
                                      "gradAccum": 1, "explanation": "x", "zzz": 1})
    assert said.startswith("unknown key; the keys here are: pool, device, strategy,") and said.endswith(", ...")
    assert said.count(",") == 12


def test_a_spec_is_planned_within_its_budget_and_gpu_cap():
    spec = FineTuneJobSpec.model_validate(SPEC)
    cal, h200 = calibration.load()
    gpu = GPUS["H100"].calibrated(matmul_efficiency=h200.matmul_efficiency, memory_efficiency=h200.memory_efficiency)
    pool = Pool("h100", gpu, 8, 2, LINKS["nvlink4"], LINKS["ib-8x400g"], 4.0)
    chosen = plan_job(spec, pool, cal, CATALOG["meta-llama/Llama-3.1-8B"])
    assert chosen.gpus <= 8 and chosen.predicted.cost_usd <= 500
    assert chosen.global_batch_size == 64 and chosen.pool == "h100" and chosen.workers == chosen.gpus


def test_the_plan_is_camel_case_on_the_wire_and_round_trips():
    spec = FineTuneJobSpec.model_validate(SPEC)
    cal, h200 = calibration.load()
    pool = Pool("h200", h200, 8, 1, LINKS["nvlink4"], None, 3.5)
    chosen = plan_job(spec, pool, cal, CATALOG["meta-llama/Llama-3.1-8B"])
    wire = chosen.model_dump(by_alias=True)
    assert {"microBatch", "gradAccum", "activationCheckpointing", "shardGroup", "cpuOffload"} <= wire.keys()
    assert {"peakMemoryGiB", "stepSeconds", "costUSD", "commShare", "memoryBreakdownGiB"} <= wire["predicted"].keys()
    assert JobPlan.model_validate(wire) == chosen


def test_steps_come_from_epochs_and_dataset_size():
    spec = FineTuneJobSpec.model_validate(SPEC | {"hyperparameters": {"epochs": 2, "globalBatchSize": 8, "seqLen": 1024}})
    assert workload(spec, CATALOG["gpt2"], dataset_tokens=8 * 1024 * 10 + 1).steps == 22
    with pytest.raises(ValueError, match="maxSteps: needed"):
        workload(spec, CATALOG["gpt2"], dataset_tokens=None)


def test_a_deadline_without_a_budget_asks_for_the_cheapest_plan_that_meets_it():
    """Full fine-tuning, whose sharding costs more per GPU added (a LoRA job's DDP scales at the same cost,
    so its cheapest plan is also its fastest)."""
    cal, h200 = calibration.load()
    pool = Pool("h200", h200, 8, 1, LINKS["nvlink4"], None, 3.5)
    base = {**SPEC, "method": {"type": "full"}, "resources": {"maxGPUs": 8},
            "hyperparameters": {"maxSteps": 2000, "globalBatchSize": 64}}
    cheapest = plan_job(FineTuneJobSpec.model_validate(base), pool, cal, CATALOG["meta-llama/Llama-3.2-3B"])
    deadline = int(cheapest.predicted.duration_seconds * 0.6)  # the cheapest is too slow for it
    rushed = plan_job(FineTuneJobSpec.model_validate({**base, "resources": {"maxGPUs": 8, "deadlineSeconds": deadline}}),
                      pool, cal, CATALOG["meta-llama/Llama-3.2-3B"])
    assert rushed.predicted.duration_seconds <= deadline < cheapest.predicted.duration_seconds
    assert rushed.predicted.cost_usd >= cheapest.predicted.cost_usd and "cheapest-within-deadline" in rushed.explanation


def test_the_plan_carries_selective_checkpointing_and_kept_weights_to_the_runtime():
    from tunewright_core.jobconfig import runtime_config
    from tunewright_jobs.config import JobConfig

    wire = {"pool": "h200", "strategy": "fsdp", "workers": 8, "gpus": 8, "microBatch": 1, "gradAccum": 8,
            "activationCheckpointing": True, "activationCheckpointingEvery": 2, "reshardAfterForward": False,
            "shardGroup": 8, "explanation": "test"}
    plan = JobPlan.model_validate(wire)
    assert (plan.activation_checkpointing_every, plan.reshard_after_forward) == (2, False)
    assert JobPlan.model_validate(plan.model_dump(by_alias=True)) == plan
    emitted = runtime_config(FineTuneJobSpec.model_validate(SPEC), plan, name="ftjob-a", output_dir="/out",
                             train="/data/train.jsonl", validation=None)
    strategy = JobConfig.from_dict(emitted).strategy
    assert (strategy.activation_checkpointing_every, strategy.reshard_after_forward) == (2, False)
    older = JobPlan.model_validate({k: v for k, v in wire.items()
                                    if k not in ("activationCheckpointingEvery", "reshardAfterForward")})
    assert (older.activation_checkpointing_every, older.reshard_after_forward) == (1, True)
    with pytest.raises(ValidationError) as err:
        JobPlan.model_validate(wire | {"activationCheckpointingEvery": 0})
    assert err.value.errors()[0]["loc"] == ("activationCheckpointingEvery",)
