"""FP8 in the spec and the plan: resources.precision (bf16, fp8) through the planner, which runs the blocks' linear
products at the GPU's FP8 rate, adds their casts, refuses a GPU without FP8 tensor cores and says whether FP8
pays; the runtime's job config; the plan of record; the rule against a 4-bit base (model and CEL)."""

import pytest
from pydantic import ValidationError

from tunewright_core.crds import finetunejob_crd
from tunewright_core.jobconfig import runtime_config
from tunewright_core.plan_of_record import spec_hash
from tunewright_core.planner import calibration
from tunewright_core.planner.estimate import (
    FP8_BASE,
    PLACEMENT,
    Layout,
    Workload,
    estimate,
    fp8_cast_bytes,
    fp8_linear_flops,
    matmul_flops,
)
from tunewright_core.planner.hardware import GPUS, LINKS, Pool
from tunewright_core.planner.jobs import plan_job
from tunewright_core.planner.models import CATALOG
from tunewright_core.planner.search import NoPlan
from tunewright_core.spec import FineTuneJobSpec
from tunewright_jobs.config import JobConfig

CAL, H200 = calibration.load()
LLAMA_8B = CATALOG["meta-llama/Llama-3.1-8B"]
ONE_H200 = Pool("h200", H200, 1, 1, LINKS["nvlink4"], None, 3.5, host_memory_gib=2048)


def spec(precision: str | None = None, method_type: str = "lora", quantization: str = "none",
         seq_len: int = 1024, dropout: float = 0.05) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate({
        "model": {"source": "m"},
        "method": {"type": method_type, "lora": {"quantization": quantization, "dropout": dropout}},
        "dataset": {"train": "file-1"}, "hyperparameters": {"maxSteps": 100, "seqLen": seq_len, "globalBatchSize": 8},
        "resources": {"precision": precision} if precision else {}})


def test_fp8_runs_the_blocks_linear_products_and_counts_their_casts():
    layout = Layout("single", 1, 1, 8, 1, False)
    bf16, fp8 = (Workload(LLAMA_8B, "lora", 1024, 8, 1, precision=p) for p in ("bf16", "fp8"))
    linear = fp8_linear_flops(fp8, layout)
    # forward and the input's gradient of every block weight, for 8 x 1024 tokens: the bulk of the products
    assert linear == 8 * 1024 * 2 * LLAMA_8B.layers * LLAMA_8B.layer_linear_params * 2
    assert 0.8 < linear / matmul_flops(fp8, layout) < 1 and fp8_linear_flops(bf16, layout) == 0
    e_bf16, e_fp8 = estimate(bf16, layout, ONE_H200, CAL), estimate(fp8, layout, ONE_H200, CAL)
    rate = H200.matmul_efficiency
    assert e_bf16.matmul_seconds - e_fp8.matmul_seconds == pytest.approx(
        linear / (H200.bf16_flops * rate) - linear / (H200.fp8_flops * rate), rel=1e-9)
    assert fp8_cast_bytes(fp8, layout, CAL) > 0 and e_fp8.memory_bound_seconds > e_bf16.memory_bound_seconds
    # LoRA on one GPU keeps its frozen blocks as their FP8 casts only: a byte a block weight where bf16 takes two,
    # and no weight cast per step
    blocks = LLAMA_8B.layers * LLAMA_8B.layer_linear_params
    assert e_fp8.memory_breakdown[FP8_BASE] == blocks + 2 * (LLAMA_8B.params - blocks)
    assert e_bf16.memory_breakdown["frozen base (bf16)"] - e_fp8.memory_breakdown[FP8_BASE] == blocks
    full = Workload(LLAMA_8B, "full", 1024, 8, 1, precision="fp8", optimizer_state="bf16")
    assert FP8_BASE not in estimate(full, layout, ONE_H200, CAL).memory_breakdown
    two = Pool("h200", H200, 2, 1, LINKS["nvlink4"], None, 3.5, host_memory_gib=2048)
    fsdp = estimate(fp8, Layout("fsdp", 2, 1, 8, 1, False, shard_group=2), two, CAL)
    assert FP8_BASE not in fsdp.memory_breakdown  # FSDP gathers the bf16 shards and casts them at each product
    assert FP8_BASE in estimate(fp8, Layout("ddp", 2, 1, 8, 1, False), two, CAL).memory_breakdown


def test_a_base_kept_in_fp8_is_placed_whole_in_bf16_first():
    """The runtime places the bf16 model, then casts its blocks: an 8B's peak is training's; a 70B's bf16 base
    does not fit one H200 at placement, so its FP8 base on one GPU is not planned however small its blocks get."""
    fp8 = Workload(LLAMA_8B, "lora", 1024, 4, 1, precision="fp8")  # fp8_check's case: 27 GiB at training's peak
    assert estimate(fp8, Layout("single", 1, 1, 4, 1, False), ONE_H200, CAL).peak_moment != PLACEMENT
    seventy = CATALOG["meta-llama/Llama-3.1-70B"]
    e = estimate(Workload(seventy, "lora", 1024, 1, 1, precision="fp8"), Layout("single", 1, 1, 1, 1, True),
                 ONE_H200, CAL)
    assert e.peak_moment == PLACEMENT and e.peak_memory_bytes > seventy.params * 2
    plan = plan_job(spec("fp8"), ONE_H200, CAL, seventy)
    assert plan.cpu_offload or plan.gpus > 1


def test_the_plan_says_whether_fp8_pays_and_widens_its_band():
    plan = plan_job(spec("fp8"), ONE_H200, CAL, LLAMA_8B)
    assert plan.precision == "fp8"
    assert "fp8: step" in plan.explanation and "with bf16 products on this layout, so it pays" in plan.explanation
    assert "fp8 products (their casts fitted on one Llama-8B LoRA run on one H100; no full fine-tune measured)" \
        in plan.explanation
    assert plan.predicted.step_seconds < plan_job(spec(), ONE_H200, CAL, LLAMA_8B).predicted.step_seconds


def test_fp8_is_weighed_against_the_plan_bf16_products_would_have_had():
    """On four L4s, Gemma-2-9B LoRA at seq 1024 without dropout: FP8 and bf16 products are each best on a layout of
    their own (FP8's FSDP over two, checkpointed; bf16's over all four); FP8 beats bf16 on FP8's layout but not
    bf16's own plan (5% dearer), and the explanation says so and what to set."""
    l4 = Pool("l4", GPUS["L4"], 4, 1, LINKS["pcie4"], None, 0.8)
    gemma = CATALOG["google/gemma-2-9b"]
    fp8, bf16 = (plan_job(spec(precision, seq_len=1024, dropout=0.0), l4, CAL, gemma) for precision in ("fp8", "bf16"))
    assert (fp8.gpus, bf16.gpus) == (2, 4) and not (fp8.cpu_offload or bf16.cpu_offload)
    assert "with bf16 products on this layout, so it pays" in fp8.explanation
    assert (f"bf16 products' own plan ({bf16.strategy} on {bf16.gpus} GPU(s), micro-batch {bf16.micro_batch}, step "
            f"{bf16.predicted.step_seconds:.3f} s): fp8 is no better by cost") in fp8.explanation
    assert fp8.explanation.endswith("set resources.precision bf16.")
    # where both choose one layout, the layout's comparison is the whole answer
    assert "own plan" not in plan_job(spec("fp8"), ONE_H200, CAL, LLAMA_8B).explanation


def test_a_gpu_without_fp8_tensor_cores_is_refused():
    a100 = Pool("a100", GPUS["A100-80GB"], 8, 1, LINKS["nvlink3"], None, 2.0)
    with pytest.raises(NoPlan, match="the A100-80GB has no FP8 tensor cores"):
        plan_job(spec("fp8"), a100, CAL, LLAMA_8B)


def test_fp8_casts_bf16_weights_not_a_four_bit_base():
    with pytest.raises(ValidationError, match="fp8 products cast bf16 weights, not a 4-bit base"):
        spec("fp8", quantization="nf4")
    rules = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]
    assert any("fp8 products cast bf16 weights" in r["message"] for r in rules)


def test_the_plan_carries_fp8_into_the_runtime_config_and_bf16_leaves_it_as_it_was():
    plan = plan_job(spec("fp8"), ONE_H200, CAL, LLAMA_8B)
    emitted = runtime_config(spec("fp8"), plan, name="f", output_dir="/o", train="/t", validation=None)
    assert JobConfig.from_dict(emitted).strategy.precision == "fp8"
    bf16 = plan_job(spec(), ONE_H200, CAL, LLAMA_8B)
    assert "precision" not in runtime_config(spec(), bf16, name="f", output_dir="/o", train="/t",
                                             validation=None)["strategy"]
    assert spec_hash(spec()) == spec_hash(FineTuneJobSpec.model_validate(spec().model_dump(by_alias=True)))
    assert spec_hash(spec("fp8")) != spec_hash(spec())


def test_fp8_keeps_a_bf16_base_where_quantization_is_auto():
    """FP8 products cast bf16 weights: auto never trades them for a 4-bit base, even where bf16 needs offload."""
    plan = plan_job(spec("fp8", quantization="auto"), ONE_H200, CAL, CATALOG["meta-llama/Llama-3.1-70B"])
    assert (plan.quantization, plan.precision) == ("none", "fp8")


def test_gpt2s_conv1d_blocks_are_refused_fp8():
    with pytest.raises(NoPlan, match="GPT-2's Conv1D layers, which the FP8 products do not replace"):
        plan_job(spec("fp8"), ONE_H200, CAL, CATALOG["gpt2"])


def test_an_fp8_jobs_windows_teach_the_pool_nothing():
    """The pool's one efficiency factor scales bf16 products; FP8's run at another rate."""
    from tunewright_core.pools import learns_efficiency

    plan = plan_job(spec("fp8"), ONE_H200, CAL, LLAMA_8B)
    assert not learns_efficiency(plan)
    assert learns_efficiency(plan.model_copy(update={"precision": "bf16"}))
