"""The planner's dpo: each example is a pair (chosen and rejected), both through the policy's forward and
backward and through the frozen reference's forward; full fine-tuning holds the reference as a bf16 copy of
the weights (sharded like them), LoRA's is its own base with the adapters off. sft is left as it was (the
committed errors of test_planner.py and test_scale.py hold that)."""

import pytest

from tunewright_core.planner import calibration
from tunewright_core.planner.band import band
from tunewright_core.planner.estimate import (
    BF16,
    DPO_LOGITS_BYTES,
    LOSS_GRADIENTS,
    REFERENCE_WEIGHTS,
    Layout,
    Workload,
    activation_bytes,
    attention_flops,
    estimate,
    matmul_flops,
    peak_memory,
)
from tunewright_core.planner.hardware import GIB, LINKS, Pool
from tunewright_core.planner.jobs import plan_job, workload
from tunewright_core.planner.models import CATALOG
from tunewright_core.planner.search import evaluate, plan
from tunewright_core.spec import FineTuneJobSpec

CAL, H200 = calibration.load()
POOL = Pool("h200", H200, 8, 2, LINKS["nvlink4"], LINKS["ib-8x400g"], 3.5)
LLAMA_8B, QWEN_7B, GPT2 = CATALOG["meta-llama/Llama-3.1-8B"], CATALOG["Qwen/Qwen2.5-7B"], CATALOG["gpt2"]
SINGLE = Layout("single", 1, 1, 2, 8, False)
LOGITS = "logits and loss"
SINGLE_CHECKPOINTED = Layout("single", 1, 1, 2, 8, True)
FSDP = Layout("fsdp", 8, 1, 1, 2, False, shard_group=8)
FSDP_OFFLOADED = Layout("fsdp", 8, 1, 1, 2, True, shard_group=8, cpu_offload=True)


def pair(model, method, seq_len=2048, batch=16) -> tuple[Workload, Workload]:
    return (Workload(model, method, seq_len, batch, 100),
            Workload(model, method, seq_len, batch, 100, objective="dpo"))


# FLOPs in units of a forward: sft is forward (1) + backward (2) = 3; dpo, per example, twice that (chosen and
# rejected) and the reference's forward of both (2): 8, so 8/3 of sft. Under activation checkpointing the
# policy's forward runs again in backward (4 per sequence), the reference's does not: (2·4 + 2) / 4 = 2.5.
@pytest.mark.parametrize(("model", "layout", "ratio"), [
    (LLAMA_8B, SINGLE, 8 / 3),
    (LLAMA_8B, FSDP, 8 / 3),
    (GPT2, SINGLE, 8 / 3),
    (QWEN_7B, FSDP, 8 / 3),
    (LLAMA_8B, SINGLE_CHECKPOINTED, 2.5),
])
def test_full_dpo_does_eight_thirds_of_sfts_matmul_work(model, layout, ratio):
    sft, dpo = pair(model, "full")
    assert matmul_flops(dpo, layout) / matmul_flops(sft, layout) == pytest.approx(ratio, rel=1e-12)
    assert ratio == pytest.approx((2 * 3 + 2 * 1) / 3) or layout.activation_checkpointing


@pytest.mark.parametrize("model", [LLAMA_8B, QWEN_7B, GPT2])
def test_lora_dpo_adds_the_same_two_forwards_to_a_cheaper_backward(model):
    """LoRA's backward computes no weight gradients of the base: the reference's forward is a larger share."""
    sft, dpo = pair(model, "lora")
    forward = 2 * model.matmul_params + attention_flops(sft)
    tokens = SINGLE.micro_batch * sft.seq_len
    per_sequence = matmul_flops(sft, SINGLE) / tokens
    assert matmul_flops(dpo, SINGLE) == pytest.approx(tokens * (2 * per_sequence + 2 * forward), rel=1e-12)
    assert 8 / 3 < matmul_flops(dpo, SINGLE) / matmul_flops(sft, SINGLE) < 3


@pytest.mark.parametrize(("method", "layout", "reference_gib"), [
    ("full", SINGLE, BF16 * LLAMA_8B.params / GIB),  # a whole bf16 copy on one GPU
    ("full", FSDP, BF16 * LLAMA_8B.params / 8 / GIB),  # sharded like the policy
    ("lora", SINGLE, None),  # the base, adapters off: nothing more
    ("lora", FSDP, None),
])
def test_full_dpo_holds_a_frozen_bf16_reference_and_lora_holds_none(method, layout, reference_gib):
    sft, dpo = pair(LLAMA_8B, method)
    _, terms = peak_memory(dpo, layout, CAL)
    if reference_gib is None:
        assert REFERENCE_WEIGHTS not in terms
    else:
        assert terms[REFERENCE_WEIGHTS] / GIB == pytest.approx(reference_gib)
    # both sequences' activations, as an sft micro-batch of twice the sequences keeps them; but the logits: the
    # policy's whole logits (DPO_LOGITS_BYTES a token and vocabulary entry), not the fused loss's one chunk
    doubled = Layout(layout.strategy, layout.gpus, layout.nodes, 2 * layout.micro_batch, layout.grad_accum,
                     layout.activation_checkpointing, layout.shard_group)
    # (through the plain head, which makes no gradient in forward)
    held, sft_held = activation_bytes(dpo, layout, CAL), activation_bytes(sft, doubled, CAL)
    assert held.pop(LOGITS) == 2 * layout.micro_batch * dpo.seq_len * LLAMA_8B.vocab * DPO_LOGITS_BYTES
    assert held.pop(LOSS_GRADIENTS) == 0 < sft_held.pop(LOSS_GRADIENTS)
    sft_held.pop(LOGITS)
    assert held == sft_held
    states = {k: v for k, v in terms.items() if k not in (REFERENCE_WEIGHTS, LOGITS, LOSS_GRADIENTS)}
    sft_doubled = {k: v for k, v in peak_memory(sft, doubled, CAL)[1].items() if k not in (LOGITS, LOSS_GRADIENTS)}
    assert states == pytest.approx(sft_doubled)


def test_an_offloaded_reference_is_in_host_memory_with_the_other_states():
    sft, dpo = pair(LLAMA_8B, "full")
    extra = estimate(dpo, FSDP_OFFLOADED, POOL, CAL).host_memory_bytes - estimate(sft, FSDP_OFFLOADED, POOL,
                                                                                  CAL).host_memory_bytes
    assert extra == pytest.approx(BF16 * LLAMA_8B.params / 8)
    assert REFERENCE_WEIGHTS not in estimate(dpo, FSDP_OFFLOADED, POOL, CAL).memory_breakdown
    assert estimate(dpo, FSDP_OFFLOADED, POOL, CAL).offload_seconds > estimate(sft, FSDP_OFFLOADED, POOL,
                                                                                CAL).offload_seconds


@pytest.mark.parametrize("method", ["full", "lora"])
def test_tokens_per_second_count_both_sequences_and_the_step_takes_longer(method):
    sft, dpo = pair(LLAMA_8B, method)
    assert dpo.tokens_per_step == 2 * sft.tokens_per_step
    before, after = evaluate(sft, FSDP, POOL, CAL), evaluate(dpo, FSDP, POOL, CAL)
    assert after.tokens_per_second == pytest.approx(dpo.tokens_per_step / after.estimate.step_seconds)
    assert after.estimate.matmul_seconds / before.estimate.matmul_seconds == pytest.approx(
        matmul_flops(dpo, FSDP) / matmul_flops(sft, FSDP))
    assert after.estimate.step_seconds > 2 * before.estimate.step_seconds
    # FSDP gathers every block again for the reference's forward
    assert after.estimate.comm_seconds > before.estimate.comm_seconds
    single_sft, single_dpo = evaluate(sft, SINGLE, POOL, CAL), evaluate(dpo, SINGLE, POOL, CAL)
    assert single_sft.estimate.comm_seconds == single_dpo.estimate.comm_seconds == 0


def test_the_sft_workload_is_the_default_one():
    sft = Workload(LLAMA_8B, "full", 2048, 16, 100)
    assert sft == Workload(LLAMA_8B, "full", 2048, 16, 100, objective="sft")
    assert (sft.sequences_per_example, sft.forward_passes, sft.reference_copy) == (1, 1, False)
    assert LLAMA_8B.flops_per_token(2048, "full") == LLAMA_8B.flops_per_token(2048, "full", "sft")
    assert LLAMA_8B.flops_per_token(2048, "full", "dpo") == pytest.approx(
        8 * LLAMA_8B.params + 16 * LLAMA_8B.layers * LLAMA_8B.hidden * 2048)


SPEC = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"},
        "dataset": {"train": "pvc://d/pairs.jsonl", "format": "preference"},
        "hyperparameters": {"maxSteps": 200, "globalBatchSize": 64, "seqLen": 2048}}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_plan_says_what_dpo_adds_and_where_the_reference_is(method):
    spec = FineTuneJobSpec.model_validate({**SPEC, "method": {"type": method, "objective": "dpo"}})
    chosen = plan_job(spec, POOL, CAL, LLAMA_8B)
    assert "dpo: chosen and rejected per example, plus the reference forward" in chosen.explanation
    assert f"a micro-batch of {chosen.micro_batch} pair" in chosen.explanation
    assert ("frozen bf16 copy of the weights" if method == "full" else "adapters off (no copy held)") in \
        chosen.explanation
    assert "objective dpo (sft's terms for the work it adds; two runs on one H200 checked them, within 8.5%)" \
        in chosen.predicted.band.basis
    if method == "full" and chosen.shard_group > 1 and not chosen.cpu_offload:
        assert chosen.predicted.memory_breakdown_gib[REFERENCE_WEIGHTS] == pytest.approx(
            BF16 * LLAMA_8B.params / chosen.shard_group / GIB)
    sft = plan_job(FineTuneJobSpec.model_validate({**SPEC, "method": {"type": method},
                                                   "dataset": {"train": "pvc://d/t.jsonl"}}), POOL, CAL, LLAMA_8B)
    assert "dpo" not in sft.explanation and "objective" not in sft.predicted.band.basis
    # each plan is the cheapest for its own work (their layouts may differ): dpo's costs more
    assert chosen.predicted.cost_usd > sft.predicted.cost_usd


def test_full_dpo_needs_more_memory_per_gpu_than_sft_at_the_same_layout():
    sft, dpo = pair(LLAMA_8B, "full", batch=64)
    layout = Layout("fsdp", 8, 1, 1, 8, True, shard_group=8)
    gap = estimate(dpo, layout, POOL, CAL).peak_memory_bytes - estimate(sft, layout, POOL, CAL).peak_memory_bytes
    assert gap >= BF16 * LLAMA_8B.params / 8


def test_a_dpo_workload_from_the_spec_counts_two_sequences_a_pair():
    spec = FineTuneJobSpec.model_validate({**SPEC, "method": {"objective": "dpo"},
                                           "hyperparameters": {"epochs": 1, "globalBatchSize": 8, "seqLen": 1024}})
    w = workload(spec, LLAMA_8B, dataset_tokens=2 * 8 * 1024 * 10)
    assert (w.objective, w.steps, w.tokens_per_step) == ("dpo", 10, 2 * 8 * 1024)


def test_the_band_widens_for_an_objective_no_run_measured():
    evidence = calibration.evidence()
    sft = band(evidence, "H200", 8, None, 2048, "full")
    dpo = band(evidence, "H200", 8, None, 2048, "full", objective="dpo")
    assert dpo.low < sft.low and dpo.high > sft.high and "objective dpo" in dpo.basis


def test_dpo_plans_where_sft_does_on_a_small_model():
    w = Workload(GPT2, "lora", 1024, 16, 50, objective="dpo")
    chosen = plan(w, POOL, CAL)
    assert chosen.predicted.tokens_per_second > 0 and "dpo:" in chosen.explanation


def test_a_dpo_batch_sized_from_the_data_counts_its_pairs():
    from tunewright_core.planner.jobs import sized_for_data

    spec = FineTuneJobSpec.model_validate({**SPEC, "method": {"objective": "dpo"}, "hyperparameters": {"maxSteps": 5}})
    sized, said = sized_for_data(spec, examples=12, characters=1200, longest_characters=150)
    assert sized.hyperparameters.global_batch_size == 8 and "one epoch holds 12 preference pairs" in said
    assert sized.hyperparameters.seq_len == 128
    many = FineTuneJobSpec.model_validate({**SPEC, "method": {"objective": "dpo"},
                                           "hyperparameters": {"maxSteps": 5, "globalBatchSize": 64}})
    assert sized_for_data(many, examples=200, characters=20_000, longest_characters=150)[0].hyperparameters \
        .global_batch_size == 64  # 200 short pairs fill it, however few tokens they pack into
    with pytest.raises(ValueError, match=r"hyperparameters.globalBatchSize: at most 50 preference pairs a step"):
        sized_for_data(many, examples=50, characters=5_000, longest_characters=150)
