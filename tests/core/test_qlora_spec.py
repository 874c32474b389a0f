"""QLoRA in the spec and the plan: method.lora.quantization (none, nf4, auto) from the spec (and, as CEL, the
CRD) through the planner's choice to the runtime's job config, and the plan of record held to it."""

import pytest
from pydantic import ValidationError

from tunewright_core.crds import finetunejob_crd
from tunewright_core.jobconfig import runtime_config
from tunewright_core.plan_of_record import spec_hash, within_bounds
from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import LINKS, Pool
from tunewright_core.planner.jobs import plan_job
from tunewright_core.planner.models import CATALOG
from tunewright_core.planner.search import NoPlan
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan, error_message
from tunewright_jobs.config import JobConfig

CAL, H200 = calibration.load()
LLAMA_70B, LLAMA_8B = CATALOG["meta-llama/Llama-3.1-70B"], CATALOG["meta-llama/Llama-3.1-8B"]


def spec(quantization: str | None = None, method_type: str = "lora", **resources) -> FineTuneJobSpec:
    lora = {"quantization": quantization} if quantization else {}
    return FineTuneJobSpec.model_validate({
        "model": {"source": "hf://meta-llama/Llama-3.1-70B"}, "method": {"type": method_type, "lora": lora},
        "dataset": {"train": "file-1"}, "hyperparameters": {"maxSteps": 100, "seqLen": 1024, "globalBatchSize": 16},
        "resources": resources})


def one_h200(host_gib: float = 2048) -> Pool:
    return Pool("h200", H200, 1, 1, LINKS["nvlink4"], None, 3.5, host_memory_gib=host_gib)


def test_a_bf16_base_is_the_default_and_leaves_the_hash_as_it_was():
    plain = spec()
    assert plain.method.lora.quantization == "none"
    wire = plain.model_dump(by_alias=True)
    assert wire["method"]["lora"]["quantization"] == "none"
    assert spec_hash(plain) == spec_hash(FineTuneJobSpec.model_validate(wire))
    assert spec_hash(spec("nf4")) != spec_hash(plain) != spec_hash(spec("auto"))


def test_nf4_is_for_a_lora_base():
    with pytest.raises(ValidationError) as refused:
        spec("nf4", method_type="full")
    (error,) = refused.value.errors()
    assert error["loc"] == ("method",)
    assert "lora.quantization: nf4 loads a frozen LoRA base in 4 bits" in error_message(error, FineTuneJobSpec)
    finetunejob = finetunejob_crd()
    method = finetunejob["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["method"]
    assert "type full trains every weight" in method["x-kubernetes-validations"][0]["message"]
    assert method["properties"]["lora"]["properties"]["quantization"]["enum"] == ["none", "nf4", "auto"]


def test_auto_keeps_bf16_where_it_fits_without_offload():
    """Llama-8B LoRA fits one H200 in bf16: auto does not pay QLoRA's quality cost for nothing."""
    plan = plan_job(spec("auto"), one_h200(), CAL, LLAMA_8B)
    assert plan.quantization == "none" and not plan.cpu_offload


def test_auto_prefers_a_four_bit_base_over_offload_and_says_what_it_trades():
    """Llama-70B LoRA on one H200: a bf16 base (141 GB) fits only offloaded; NF4 (~38 GB) fits on the GPU."""
    asked_none = plan_job(spec("none"), one_h200(), CAL, LLAMA_70B)
    assert asked_none.quantization == "none" and asked_none.cpu_offload
    copies = asked_none.predicted.exposed_offload_seconds  # the bf16 base crosses the host link in every pass
    assert copies > asked_none.predicted.step_seconds / 3 and f"+ {copies:.3f} exposed host copies" in \
        asked_none.explanation
    plan = plan_job(spec("auto"), one_h200(), CAL, LLAMA_70B)
    assert plan.quantization == "nf4" and not plan.cpu_offload and plan.strategy == "single"
    assert plan.predicted.step_seconds < asked_none.predicted.step_seconds
    assert "quantization auto chose nf4 (QLoRA): a bf16 base fits only with CPU offload" in plan.explanation
    assert "costs a little quality" in plan.explanation and "set method.lora.quantization none" in plan.explanation
    assert plan == plan_job(spec("nf4"), one_h200(), CAL, LLAMA_70B).model_copy(
        update={"explanation": plan.explanation})


def test_auto_says_so_when_neither_base_fits():
    """A host too small for the offloaded bf16 base, and a GPU count too small for NF4 (8 GiB GPUs)."""
    small = Pool("tiny", H200.calibrated(memory_gib=8), 1, 1, LINKS["nvlink4"], None, 1.0, host_memory_gib=64)
    with pytest.raises(NoPlan, match="with a 4-bit .nf4. base: no layout works"):
        plan_job(spec("auto"), small, CAL, LLAMA_70B)


def test_a_forced_sharded_strategy_cannot_hold_a_four_bit_base():
    with pytest.raises(NoPlan, match="strategy fsdp: the runtime does not shard a 4-bit"):
        plan_job(spec("nf4", strategy="fsdp"), one_h200(), CAL, LLAMA_70B)


def test_the_plan_carries_the_base_into_the_runtime_config():
    plan = plan_job(spec("auto"), one_h200(), CAL, LLAMA_70B)
    emitted = runtime_config(spec("auto"), plan, name="q", output_dir="/o", train="/t", validation=None)
    assert emitted["method"]["lora"]["quantization"] == "nf4"
    assert JobConfig.from_dict(emitted).method.lora.quantization == "nf4"
    bf16 = plan_job(spec(), one_h200(), CAL, LLAMA_70B)
    assert "quantization" not in runtime_config(spec(), bf16, name="q", output_dir="/o", train="/t",
                                                validation=None)["method"]["lora"]


@pytest.mark.parametrize(("strategy", "offload", "adopted"), [
    ("single", False, True), ("ddp", False, True), ("fsdp", False, False), ("single", True, False)])
def test_a_plan_of_record_never_shards_nor_offloads_a_four_bit_base(strategy, offload, adopted):
    pool = GPUPoolSpec.model_validate({"gpu": "H200", "gpusPerNode": 2, "maxNodes": 1, "intraNode": "nvlink4",
                                       "pricePerGPUHour": 3.5, "workerImage": "w:1"})
    gpus = 1 if strategy == "single" else 2
    plan = JobPlan(pool="p", strategy=strategy, workers=gpus, gpus=gpus, micro_batch=1, grad_accum=16 // gpus,
                   shard_group=gpus if strategy == "fsdp" else 1, cpu_offload=offload, quantization="nf4",
                   explanation="test")
    assert within_bounds(plan, spec("auto"), "p", pool) is adopted
