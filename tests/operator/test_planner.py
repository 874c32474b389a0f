"""The planner: published formulas, model profiles, calibration against measured H200 runs, search."""

from pathlib import Path

import pytest

from tunewright_operator.planner import calibration, calibration_fit
from tunewright_operator.planner.estimate import (
    Layout,
    Workload,
    estimate,
    gpu_state_bytes,
    host_state_bytes,
    sharded_states,
)
from tunewright_operator.planner.formulas import (
    deepspeed_zero3_bytes,
    korthikanti_activation_bytes,
    zero_model_state_bytes,
)
from tunewright_operator.planner.hardware import GIB, GPUS, LINKS, Pool
from tunewright_operator.planner.models import CATALOG, from_hf_config, lookup
from tunewright_operator.planner.search import USABLE_HOST_MEMORY, NoPlan, plan

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED = sorted(RESULTS.glob("gpu_*_h200.json"))
CAL, H200 = calibration.load()


def pool(gpu="H100", per_node=8, nodes=1, inter=None, price=4.0, host_gib=None):
    measured = GPUS[gpu].calibrated(matmul_efficiency=H200.matmul_efficiency,
                                    memory_efficiency=H200.memory_efficiency)
    return Pool(f"{gpu}x{per_node}x{nodes}", measured, per_node, nodes, LINKS["nvlink4"],
                LINKS[inter] if inter else None, price, host_gib)


# --- formulas and profiles ---------------------------------------------------------------------------

@pytest.mark.parametrize(("stage", "gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_figures(stage, gb):
    """ZeRO paper, section 5.1: a 7.5B model on 64 GPUs."""
    assert zero_model_state_bytes(7.5e9, 64, stage) / 1e9 == pytest.approx(gb, rel=0.01)


def test_sixteen_bytes_per_parameter_and_our_accounting():
    """The runtime keeps fp32 master weights and AdamW states (12Ψ) and, across accumulated micro-batches,
    fp32 gradients (4Ψ): 16Ψ alone, 16Ψ/N sharded, as ZeRO-3's total."""
    model = CATALOG["meta-llama/Llama-3.1-8B"]
    w = Workload(model, "full", 2048, 64, 1)
    single = sharded_states(w, Layout("single", 1, 1, 1, 8, False))
    assert sum(single.values()) == zero_model_state_bytes(model.params, 1, 0)
    sharded = sharded_states(w, Layout("fsdp", 8, 1, 1, 8, False, shard_group=8))
    assert sum(sharded.values()) == pytest.approx(zero_model_state_bytes(model.params, 8, 3))


@pytest.mark.parametrize(("offload_optimizer", "offload_params", "host_gib", "gpu_gib"), [
    (True, True, 70.00, 0.25), (True, False, 62.23, 5.43), (False, False, 0.37, 46.91),
])
def test_deepspeed_estimator_figures(offload_optimizer, offload_params, host_gib, gpu_gib):
    """DeepSpeed's published ZeRO-3 table for bigscience/T0_3B (2783M parameters, 65M largest layer) on 1 GPU."""
    gpu, host = deepspeed_zero3_bytes(2783e6, 65e6, 1, 1, offload_optimizer, offload_params)
    # the table prints the parameter count rounded to 1M (±0.5M x 24 bytes = ±0.01 GiB), figures to 0.01 GiB
    assert (host / GIB, gpu / GIB) == (pytest.approx(host_gib, abs=0.03), pytest.approx(gpu_gib, abs=0.03))


def test_our_states_against_deepspeed_zero3():
    """FSDP2 full shard is ZeRO-3: our states per GPU (16Ψ/N and the blocks being computed) sit just under
    DeepSpeed's 18Ψ/N + 4L (it also counts a bf16 copy of every weight); offloaded, our host needs 16Ψ
    per node, DeepSpeed asks 18Ψ x 1.5 to be safe, and we keep 20% of the host free."""
    model = CATALOG["meta-llama/Llama-3.1-8B"]
    w = Workload(model, "full", 2048, 64, 1)
    sharded = Layout("fsdp", 8, 1, 1, 8, False, shard_group=8)
    ours = sum(gpu_state_bytes(w, sharded).values())
    deepspeed, _ = deepspeed_zero3_bytes(model.params, model.layer_linear_params, 8, 1, False, False)
    assert 0.85 * deepspeed < ours < deepspeed
    offloaded = Layout("fsdp", 8, 1, 1, 8, False, shard_group=8, cpu_offload=True)
    _, deepspeed_host = deepspeed_zero3_bytes(model.params, model.layer_linear_params, 8, 1, True, True)
    assert host_state_bytes(w, offloaded) * 8 == pytest.approx(16 * model.params)
    assert host_state_bytes(w, offloaded) * 8 / USABLE_HOST_MEMORY < deepspeed_host


def test_korthikanti_activation_formula():
    # GPT-3 175B layer (h=12288, a=96) at s=2048, b=1: 34 + 5·96·2048/12288 = 114 bytes per s·b·h
    assert korthikanti_activation_bytes(2048, 1, 12288, 96, 1) == 2048 * 12288 * 114
    assert korthikanti_activation_bytes(2048, 1, 12288, 96, 1, flash_attention=True) == 2048 * 12288 * 34


@pytest.mark.parametrize(("name", "billions"), [
    ("gpt2", 0.124), ("meta-llama/Llama-3.2-1B", 1.236), ("meta-llama/Llama-3.2-3B", 3.213),
    ("meta-llama/Llama-3.1-8B", 8.03), ("meta-llama/Llama-3.1-70B", 70.55), ("Qwen/Qwen2.5-0.5B", 0.494),
    ("Qwen/Qwen2.5-7B", 7.62), ("Qwen/Qwen2.5-72B", 72.7), ("mistralai/Mistral-7B-v0.3", 7.25),
    ("google/gemma-2-9b", 9.24), ("microsoft/Phi-3-mini-4k-instruct", 3.82),
])
def test_catalog_parameter_counts_match_published(name, billions):
    assert CATALOG[name].params / 1e9 == pytest.approx(billions, rel=0.01)


def test_profiles_from_config_json_and_lookup():
    llama = from_hf_config("x", {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                 "vocab_size": 128256, "tie_word_embeddings": False})
    assert llama.params == CATALOG["meta-llama/Llama-3.1-8B"].params
    gpt2 = from_hf_config("y", {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                "vocab_size": 50257, "n_positions": 1024})
    assert gpt2.params == CATALOG["gpt2"].params
    assert lookup("hf://meta-llama/Llama-3.1-8B") is CATALOG["meta-llama/Llama-3.1-8B"]
    assert lookup("Llama-3.1-8B") is CATALOG["meta-llama/Llama-3.1-8B"]
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        from_hf_config("z", {"num_attention_heads": 4})


# --- calibration against measurement -----------------------------------------------------------------

def test_committed_calibration_is_the_fit_of_the_committed_measurements():
    fitted, gpu = calibration_fit.fit(calibration_fit.load_measurements(MEASURED), GPUS["H200"])
    for field in ("logits_bytes_per_vocab", "lora_traffic_bytes_per_hidden", "seconds_per_layer",
                  "cpu_adam_seconds_per_param", "host_seconds_per_lora_module_recompute"):
        assert getattr(fitted, field) == pytest.approx(getattr(CAL, field), rel=1e-6)
    assert fitted.act_bytes_per_hidden == pytest.approx(CAL.act_bytes_per_hidden, rel=1e-6)
    assert gpu.matmul_efficiency == pytest.approx(H200.matmul_efficiency, rel=1e-6)


def test_prediction_error_on_measured_runs_within_targets():
    rows = calibration_fit.compare(calibration_fit.load_measurements(MEASURED), CAL, H200)
    stats = calibration_fit.summary(rows)
    assert len(rows) >= 12 and sum(not r["fit_set"] for r in rows) >= 8
    assert stats["median_abs_step_error_held_out"] <= 0.10
    assert stats["median_abs_memory_error_held_out"] <= 0.05
    assert stats["worst_memory_under_prediction"] >= -0.03  # never promise memory that is not there


def test_choosing_among_measured_layouts_costs_at_most_five_percent():
    """Regret: for each workload measured in several layouts, the layout the model ranks fastest is within
    5% of the fastest measured."""
    groups: dict[tuple, list] = {}
    for m in calibration_fit.load_measurements(MEASURED):
        groups.setdefault((m.workload.model.name, m.workload.method, m.layout.gpus), []).append(m)
    checked = 0
    for runs in groups.values():
        if len(runs) < 2:
            continue
        def predicted(m):
            e = estimate(m.workload, m.layout, calibration_fit.measured_pool(H200, m.layout.gpus), CAL)
            return m.workload.tokens_per_step / e.step_seconds
        chosen = max(runs, key=predicted)
        best = max(r.tokens_per_second for r in runs)
        assert best / chosen.tokens_per_second - 1 <= 0.05, chosen.name
        checked += 1
    assert checked >= 5


# --- search and explanation --------------------------------------------------------------------------

def test_full_fine_tuning_of_8b_cannot_run_on_one_a100_40gb():
    """Neither on the GPU nor with the states offloaded to the 85 GB host such a node has."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 2048, 8, 100)
    with pytest.raises(NoPlan, match=r"single: does not fit: \d+ GiB > 35 GiB usable per A100-40GB .*; "
                                     r"with CPU offload: \d+ GiB of host memory > 68 GiB usable per node"):
        plan(w, pool("A100-40GB", per_node=1, host_gib=85), CAL)


def test_full_fine_tuning_of_8b_on_one_h200_needs_offload_and_says_so():
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 2048, 16, 100)
    chosen = plan(w, pool("H200", per_node=1, host_gib=1024), CAL)
    assert chosen.cpu_offload and chosen.predicted.host_memory_gib_per_node > 100
    assert "in host memory" in chosen.explanation
    assert chosen.predicted.optimizer_seconds > chosen.predicted.matmul_seconds / 10  # the host's AdamW is slow


def test_lora_of_8b_over_nvlink_is_ddp_when_the_base_leaves_room_for_the_batch():
    """REFERENCE's LoRA rule: adapters' gradients are tiny, so DDP, when the frozen base fits. On 141 GB
    H200s it does, at the same micro-batch as sharding; on 80 GB H100s the replicated base (15 GiB)
    halves DDP's micro-batch and the per-micro-batch costs (measured) make sharding a few percent faster."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "lora", 2048, 64, 500)
    eight = plan(w, pool("H200", per_node=8), CAL, objective="fastest")
    assert (eight.strategy, eight.gpus, eight.cpu_offload) == ("ddp", 8, False)
    assert eight.predicted.exposed_comm_share < 0.01
    one = plan(w, pool("H200", per_node=8), CAL, max_gpus=1)
    assert eight.predicted.duration_seconds < one.predicted.duration_seconds / 7
    h100 = plan(w, pool("H100", per_node=8), CAL, objective="fastest")
    ddp = next(r for r in h100.rejected if r.strategy == "ddp")
    assert h100.gpus == 8 and "micro-batch 2 x 4" in ddp.reason and "% slower" in ddp.reason
    assert h100.predicted.exposed_comm_share < 0.01


def test_70b_full_on_four_ethernet_nodes_is_hybrid_shard_within_nodes():
    """A realistic batch (1M tokens per step) on 4 x 8 H100 with 2 TB hosts over 100 GbE: sharding within a
    node (NVLink) with the states offloaded, replicated across nodes, all-reducing once per step, beats
    sharding over all 32 GPUs, whose gathers cross the Ethernet every micro-batch."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-70B"], "full", 4096, 256, 100)
    chosen = plan(w, pool(per_node=8, nodes=4, inter="eth-100g", host_gib=2048), CAL, objective="fastest")
    assert (chosen.strategy, chosen.gpus, chosen.shard_group, chosen.cpu_offload) == ("hsdp", 32, 8, True)
    assert chosen.predicted.exposed_comm_share < 0.05
    reasons = {r.strategy: r.reason for r in chosen.rejected}
    assert "communication-bound" in reasons["fsdp"]
    assert reasons["ddp"].startswith("does not fit")


def test_70b_full_with_a_small_batch_over_ethernet_is_called_communication_bound():
    w = Workload(CATALOG["meta-llama/Llama-3.1-70B"], "full", 2048, 64, 100)
    chosen = plan(w, pool(per_node=8, nodes=4, inter="eth-100g", host_gib=2048), CAL, objective="fastest")
    assert chosen.strategy in ("fsdp", "hsdp") and chosen.gpus == 32
    assert chosen.predicted.exposed_comm_share > 0.5
    assert "communication-bound" in chosen.explanation
    fast_network = plan(w, pool(per_node=8, nodes=4, inter="ib-8x400g", host_gib=2048), CAL, objective="fastest")
    assert fast_network.predicted.step_seconds < chosen.predicted.step_seconds / 3


def test_a_forced_strategy_is_honoured_and_still_predicted():
    w = Workload(CATALOG["meta-llama/Llama-3.2-1B"], "full", 2048, 16, 100)
    forced = plan(w, pool(per_node=8), CAL, strategy="ddp")
    assert forced.strategy == "ddp" and forced.predicted.step_seconds > 0 and forced.predicted.cost_usd > 0
    assert {r.strategy for r in forced.rejected} == set()  # only ddp was considered


def test_objectives_budget_and_deadline():
    w = Workload(CATALOG["meta-llama/Llama-3.2-3B"], "full", 2048, 32, 2000)
    p = pool(per_node=8)
    cheapest, fastest = plan(w, p, CAL, "cheapest"), plan(w, p, CAL, "fastest")
    assert cheapest.predicted.cost_usd <= fastest.predicted.cost_usd
    assert fastest.predicted.duration_seconds <= cheapest.predicted.duration_seconds
    budget = (cheapest.predicted.cost_usd + fastest.predicted.cost_usd) / 2
    within = plan(w, p, CAL, "fastest-within-budget", budget_usd=budget)
    assert within.predicted.cost_usd <= budget
    with pytest.raises(NoPlan, match="budget"):
        plan(w, p, CAL, "fastest-within-budget", budget_usd=cheapest.predicted.cost_usd / 10)
    deadline = plan(w, p, CAL, "cheapest-within-deadline", deadline_seconds=fastest.predicted.duration_seconds * 1.5)
    assert deadline.predicted.duration_seconds <= fastest.predicted.duration_seconds * 1.5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"objective": "quickest"}, "objective: must be one of"),
    ({"strategy": "zero3"}, "strategy: must be auto or one of"),
    ({"objective": "fastest-within-budget"}, "budget_usd: needed"),
    ({"objective": "cheapest-within-deadline"}, "deadline_seconds: needed"),
])
def test_bad_requests_name_the_field(kwargs, message):
    w = Workload(CATALOG["gpt2"], "full", 1024, 8, 10)
    with pytest.raises(ValueError, match=message):
        plan(w, pool(), CAL, **kwargs)


def test_sharding_and_checkpointing_trade_memory_for_time():
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 4096, 64, 1)
    p = pool(per_node=8)
    two = estimate(w, Layout("fsdp", 2, 1, 2, 16, False, 2), p, CAL)
    eight = estimate(w, Layout("fsdp", 8, 1, 2, 4, False, 8), p, CAL)
    assert eight.peak_memory_bytes < two.peak_memory_bytes
    recompute = estimate(w, Layout("fsdp", 8, 1, 2, 4, True, 8), p, CAL)
    assert recompute.peak_memory_bytes < eight.peak_memory_bytes / 2
    assert recompute.step_seconds > eight.step_seconds * 1.2
    assert two.peak_memory_bytes / GIB > 100


def test_qlora_memory_follows_the_paper_and_is_refused_until_the_runtime_has_it():
    """QLoRA: ~0.52 bytes per block weight (NF4 + double-quantized constants); the paper fine-tunes a 65B model
    on one 48 GB GPU. The runtime has no 4-bit base yet, so no plan is made, and the answer says so."""
    model = CATALOG["meta-llama/Llama-3.1-70B"]
    w = Workload(model, "qlora", 2048, 16, 100)
    base = sharded_states(w, Layout("single", 1, 1, 1, 1, True))["frozen base (NF4 blocks, bf16 rest)"]
    assert 0.5 * model.params < base < 0.6 * model.params  # bytes: about half a byte per parameter
    assert estimate(w, Layout("single", 1, 1, 1, 16, True), pool("H100", per_node=1), CAL).peak_memory_bytes < 60 * GIB
    with pytest.raises(NoPlan, match="method qlora: the runtime does not train 4-bit bases yet"):
        plan(w, pool("H100", per_node=1), CAL)


def test_a_layout_that_fits_only_offloaded_but_over_budget_is_rejected_for_the_budget():
    """Not as "does not fit": with offload it fits, and the reason says what the cheapest would cost."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-70B"], "full", 2048, 64, 500)
    p = pool(per_node=8, host_gib=2048)
    cheapest = plan(w, p, CAL, "cheapest", max_gpus=1)
    assert cheapest.cpu_offload
    with pytest.raises(NoPlan) as refused:
        plan(w, p, CAL, "fastest-within-budget", max_gpus=8, budget_usd=5)
    single = str(refused.value).split("single: ")[1].split(";")[0]
    assert single.startswith("no layout within the $5.00 budget (the cheapest, single on 1 GPU")
    assert "CPU offload" in single and "costs $" in single


@pytest.mark.parametrize(("source", "entry"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("hf://meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-1B"),
    ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ("google/gemma-2-9b-it", "google/gemma-2-9b"),
    ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3-mini-4k-instruct"),
])
def test_instruct_variants_and_common_hub_ids_resolve(source, entry):
    assert lookup(source) is CATALOG[entry]


@pytest.mark.parametrize("source", ["meta-llama/Llama-3.1-9B", "/models/Llama-3.1-8B-Instruct", "someone/it"])
def test_what_is_not_a_catalog_model_is_not_taken_for_one(source):
    assert lookup(source) is None


def _spec(**hyper):
    from tunewright_operator.spec import FineTuneJobSpec

    return FineTuneJobSpec.model_validate({"model": {"source": "gpt2"}, "dataset": {"train": "file-x"},
                                           "hyperparameters": hyper})


@pytest.mark.parametrize(("hyper", "data", "positions", "expected", "chosen"), [
    # 150 short chats (the newcomer's): 2048 would pack them into ~6 sequences, fewer than a batch of 16
    ({}, (150, 150 * 240, 400), 0, (128, 16), "seqLen 128"),
    ({}, (150, 150 * 240, 4000), 0, (1024, 8), "globalBatchSize 8"),  # one long example: no example cut off
    ({}, (10, 10 * 200, 200), 0, (128, 4), "globalBatchSize 4"),  # ~5 sequences: the power of two below
    ({}, (100_000, 10**9, 30_000), 0, (2048, 16), None),  # a large dataset: the defaults stand
    ({}, (100_000, 10**9, 30_000), 512, (512, 16), "seqLen 512"),  # learned positions cap it
    ({"seqLen": 64}, (150, 150 * 240, 400), 0, (64, 16), None),  # what the spec sets is kept
    ({"globalBatchSize": 4}, (150, 150 * 240, 400), 0, (128, 4), "seqLen 128"),
])
def test_sizes_follow_from_the_data(hyper, data, positions, expected, chosen):
    from tunewright_operator.planner.jobs import sized_for_data

    examples, characters, longest = data
    sized, why = sized_for_data(_spec(**hyper), examples=examples, characters=characters,
                                longest_characters=longest, max_positions=positions)
    assert (sized.hyperparameters.seq_len, sized.hyperparameters.sequences_per_step) == expected
    assert (why is None) if chosen is None else (chosen in why)


@pytest.mark.parametrize(("hyper", "field"), [
    ({"globalBatchSize": 4096}, "hyperparameters.globalBatchSize"),
    ({"globalBatchTokens": 2048 * 4096, "seqLen": 2048}, "hyperparameters.globalBatchTokens"),
])
def test_sizes_the_data_cannot_fill_are_refused_naming_the_field(hyper, field):
    from tunewright_operator.planner.jobs import sized_for_data

    with pytest.raises(ValueError, match=rf"^{field}: the dataset is too small .* 150 examples make at most"):
        sized_for_data(_spec(**hyper), examples=150, characters=150 * 240, longest_characters=400)
