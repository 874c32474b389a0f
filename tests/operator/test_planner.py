"""The planner: published formulas, model profiles, calibration against measured H200 runs, search."""

import json
import statistics
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tunewright_core.planner import calibration
from tunewright_core.planner.estimate import (
    END_OF_BACKWARD,
    GRADIENTS,
    LOSS_GRADIENTS,
    NF4_BASE,
    ROOT_GRADIENTS,
    START_OF_BACKWARD,
    Layout,
    Workload,
    activation_bytes,
    end_of_backward_bytes,
    estimate,
    gpu_state_bytes,
    host_state_bytes,
    sharded_states,
)
from tunewright_core.planner.formulas import (
    deepspeed_zero3_bytes,
    korthikanti_activation_bytes,
    zero_model_state_bytes,
)
from tunewright_core.planner.hardware import GIB, GPUS, LINKS, Pool
from tunewright_core.planner.jobs import workload
from tunewright_core.planner.models import CATALOG, from_hf_config, lookup
from tunewright_core.planner.search import (
    MEMORY_MARGIN,
    MEMORY_UNDER_PREDICTION_BOUND,
    USABLE_HOST_MEMORY,
    USABLE_MEMORY,
    NoPlan,
    batch_cap,
    break_near_tie,
    evaluate,
    plan,
)
from tunewright_core.spec import FineTuneJobSpec
from tunewright_fit import calibration_fit, chip_check, fp8_fit, offload_fit, qlora_fit

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MEASURED = sorted(RESULTS.glob("gpu_*_h200.json"))
QLORA_MEASURED = sorted(RESULTS.glob("qlora_check_*.json"))  # the H200's fitted, the H100's held out
# our runtime on one H100: nothing is fitted on them
H100_MEASURED = sorted([*RESULTS.glob("fp8_check_h100_*.json"), *RESULTS.glob("vs_*_h100_*.json")])
SINGLE_ON_MASTERS = RESULTS / "gpu_calibration_h200_single_masters.json"  # not in the fit: a later runtime's
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
    """FSDP2 full shard is ZeRO-3: our states per GPU (16Ψ/N, the blocks being computed and the gathered
    embeddings and head) sit just under DeepSpeed's 18Ψ/N + 4L (it also counts a bf16 copy of every weight;
    its largest layer L is the largest module's own parameters, here the embedding); offloaded, our host
    needs 16Ψ per node, DeepSpeed asks 18Ψ x 1.5 to be safe, and we keep 20% of the host free."""
    model = CATALOG["meta-llama/Llama-3.1-8B"]
    w = Workload(model, "full", 2048, 64, 1)
    sharded = Layout("fsdp", 8, 1, 1, 8, False, shard_group=8)
    ours = sum(gpu_state_bytes(w, sharded).values())
    largest_module = model.vocab * model.hidden
    deepspeed, _ = deepspeed_zero3_bytes(model.params, largest_module, 8, 1, False, False)
    assert 0.85 * deepspeed < ours < deepspeed
    offloaded = Layout("fsdp", 8, 1, 1, 8, False, shard_group=8, cpu_offload=True)
    _, deepspeed_host = deepspeed_zero3_bytes(model.params, largest_module, 8, 1, True, True)
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
    # the one-GPU matrix of the runtime since issue 12 (the two-GPU runs wait for a machine with two GPUs)
    assert len(rows) >= 14 and sum(not r["fit_set"] for r in rows) >= 6
    assert stats["median_abs_step_error_held_out"] <= 0.10
    assert stats["median_abs_memory_error_held_out"] <= 0.05
    # never promise memory that is not there (MEMORY_MARGIN, the fit check's, is derived from this bound)
    assert stats["worst_memory_under_prediction"] >= -MEMORY_UNDER_PREDICTION_BOUND


def test_the_calibration_predicts_single_on_fp32_masters_within_its_targets():
    """The fit set's one-GPU runs re-measured after `single` left FSDP2 for the plain module on fp32 masters
    (jobs' parallel.MasterWeights; six of them on a variant that kept the copies to the end of the step, the
    file says which): the calibration fitted on the runtime before still predicts them within the targets
    above (the steps of GPT-2's host-bound runs moved most: 1.09x and 1.25x faster)."""
    rows = calibration_fit.compare(calibration_fit.load_measurements([SINGLE_ON_MASTERS]), CAL, H200)
    assert len(rows) == 7
    assert statistics.median(abs(r["step_error"]) for r in rows) <= 0.10
    assert statistics.median(abs(r["memory_error"]) for r in rows) <= 0.05
    assert min(r["memory_error"] for r in rows) >= -MEMORY_UNDER_PREDICTION_BOUND


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
    assert checked >= 4  # gpt2 and llama-1b, LoRA and full, one GPU (the two-GPU groups wait for their re-measurement)


# --- memory at the end of backward, and the margin the fit check holds it to -------------------------

LLAMA_70B = CATALOG["meta-llama/Llama-3.1-70B"]


@pytest.mark.parametrize(("method", "layout", "gradient_bytes", "root_bytes"), [
    # no accumulation: every trainable parameter's fp32 gradient, sharded like its master, and the root unit's
    # reduction (its bf16 gradients unsharded and their fp32 copy for the reduce-scatter)
    ("full", Layout("fsdp", 16, 2, 1, 1, True, 16), 4 / 16, 2 + 4),
    ("full", Layout("ddp", 2, 1, 1, 1, False), 4, 2 + 4),  # DDP: whole gradients on every GPU
    ("full", Layout("fsdp", 16, 2, 1, 4, True, 16), None, 2 + 4),  # accumulated: states already, not again
    ("full", Layout("fsdp", 16, 2, 1, 1, True, 16, cpu_offload=True), None, 2 + 4),  # landed on the host
    ("lora", Layout("ddp", 2, 1, 1, 1, False), 4, None),  # adapters only: the embeddings and head are frozen
])
def test_the_end_of_backward_holds_every_gradient_and_the_root_units_reduction(method, layout, gradient_bytes,
                                                                                root_bytes):
    w = Workload(LLAMA_70B, method, 4096, 16, 1)
    end = end_of_backward_bytes(w, layout)
    expected = {GRADIENTS: gradient_bytes and gradient_bytes * w.trainable_params,
                ROOT_GRADIENTS: root_bytes and root_bytes * LLAMA_70B.params_outside_blocks}
    assert {k: end.get(k) for k in expected} == {k: v and pytest.approx(v) for k, v in expected.items()}
    states = {} if layout.cpu_offload else sharded_states(w, layout)
    assert {k: end[k] for k in states} == states  # the states stay


@pytest.mark.parametrize(("method", "layout", "gathered"), [
    ("full", Layout("single", 1, 1, 1, 1, False), True),  # fp32 masters: computed on a bf16 copy, on one GPU too
    ("lora", Layout("single", 1, 1, 1, 1, False), False),  # a bf16 base on a one-GPU shard stays out of FSDP
    ("lora", Layout("ddp", 2, 1, 1, 1, False), False),
    ("lora", Layout("fsdp", 2, 1, 1, 1, False, 2), True),  # sharded: gathered for compute
    ("lora", Layout("single", 1, 1, 1, 1, False, cpu_offload=True), True),  # offloaded: FSDP copies it in
])
def test_the_embeddings_and_head_are_gathered_where_fsdp_holds_them(method, layout, gathered):
    """The runtime shards each block, then the rest as the root unit, which FSDP2 keeps gathered from the
    start of forward to the end of backward: 2 bytes per parameter outside the blocks, at both moments."""
    model = CATALOG["meta-llama/Llama-3.1-8B"]
    states = gpu_state_bytes(Workload(model, method, 2048, 16, 1), layout)
    assert states.get("embeddings and head, gathered (bf16)") == (2 * model.params_outside_blocks if gathered else None)


@pytest.mark.parametrize(("layout", "held"), [
    (Layout("single", 1, 1, 8, 1, False), 32),  # single computes on bf16 copies of every block
    (Layout("ddp", 2, 1, 8, 1, False), 32),  # parallel.shard_model keeps every copy on one-GPU shards
    (Layout("fsdp", 2, 1, 8, 1, False, 2), 2),  # sharded: the block computed and the one prefetched
    (Layout("single", 1, 1, 8, 1, False, cpu_offload=True), 2),  # offloaded: copied in per block
])
def test_block_copies_held_follow_the_runtimes_resharding(layout, held):
    model = CATALOG["meta-llama/Llama-3.1-8B"]
    states = gpu_state_bytes(Workload(model, "full", 2048, 16, 1), layout)
    block = model.layer_linear_params
    assert states["unsharded blocks"] == held * 2 * block + 4 * block


@pytest.mark.parametrize(("method", "head"), [("full", True), ("lora", False)])
def test_the_fused_loss_holds_its_hidden_state_gradient_and_the_heads(method, head):
    """jobs' fused head and loss computes d(loss)/d(hidden) and, in full fine-tuning, the head's gradient in
    forward; both are alive at the start of backward, beside one chunk's logits or the head gradient's
    scaled copy, whichever is larger."""
    model = CATALOG["meta-llama/Llama-3.2-1B"]
    w, layout = Workload(model, method, 2048, 16, 1), Layout("single", 1, 1, 8, 1, False)
    terms = activation_bytes(w, layout, CAL)
    head_bytes = 2 * model.vocab * model.hidden
    assert terms[LOSS_GRADIENTS] == 2 * 8 * 2048 * model.hidden + (head_bytes if head else 0)
    assert terms["logits and loss"] >= (head_bytes if head else 0)


@pytest.mark.parametrize(("model", "seq_len", "layout", "moment"), [
    # 70B on 16 GPUs at one sequence with checkpointing: its gradients outweigh its activations
    (LLAMA_70B, 4096, Layout("fsdp", 16, 2, 1, 1, True, 16), END_OF_BACKWARD),
    # the calibration's Llama-1B at micro-batch 8 on one GPU: its activations outweigh its gradients
    (CATALOG["meta-llama/Llama-3.2-1B"], 2048, Layout("single", 1, 1, 8, 1, False), START_OF_BACKWARD),
])
def test_the_peak_is_the_higher_of_the_start_and_the_end_of_backward(model, seq_len, layout, moment):
    w = Workload(model, "full", seq_len, 16, 1)
    e = estimate(w, layout, pool(nodes=2, inter="eth-100g"), CAL)
    start = sum({**gpu_state_bytes(w, layout), **activation_bytes(w, layout, CAL)}.values())
    end = sum(end_of_backward_bytes(w, layout).values())
    assert e.peak_moment == moment and (end > start) is (moment == END_OF_BACKWARD)
    assert e.peak_memory_bytes == pytest.approx(max(start, end))


def test_70b_full_with_the_default_batch_on_four_ethernet_nodes_claims_no_fit_it_cannot_have():
    """Issue 13: 16 sequences of 4096 tokens on 4 x 8 H100 over 100 GbE: FSDP over 16 GPUs (the most 16
    sequences allow) at micro-batch 1 was chosen at 68.8 GiB predicted, of 71 usable, while at the end of
    backward it holds its states (49.3 GiB), every fp32 gradient (16.4) and the embeddings' and head's
    reduction (2.1B parameters x 6 bytes: 11.7). It does not fit; the plan offloads the states instead."""
    w = Workload(LLAMA_70B, "full", 4096, 16, 100)
    p = pool(per_node=8, nodes=4, inter="eth-100g")
    on_gpu = estimate(w, Layout("fsdp", 16, 2, 1, 1, True, 16), p, CAL)
    parts = {k: v / GIB for k, v in on_gpu.memory_breakdown.items()}
    assert on_gpu.peak_moment == END_OF_BACKWARD
    assert parts["weights (fp32 master)"] + parts["optimizer (AdamW m, v)"] == pytest.approx(49.3, abs=0.05)
    assert (parts[GRADIENTS], parts[ROOT_GRADIENTS]) == (pytest.approx(16.4, abs=0.05), pytest.approx(11.7, abs=0.05))
    assert on_gpu.peak_memory_bytes / GIB > USABLE_MEMORY * p.gpu.memory_gib
    chosen = plan(w, p, CAL)
    assert (chosen.strategy, chosen.gpus, chosen.cpu_offload) == ("fsdp", 16, True)
    assert chosen.predicted.peak_memory_gib * (1 + MEMORY_MARGIN) <= USABLE_MEMORY * p.gpu.memory_gib
    assert chosen.predicted.memory_margin == MEMORY_MARGIN and f"with the {MEMORY_MARGIN:.0%} run-to-run margin" in chosen.explanation


def test_the_memory_margin_covers_every_committed_run_and_its_rerun_spread():
    """Issue 13: Llama-1B full at micro-batch 8 on one H200 peaked at 68.6 GiB in one run and 71.0 GiB in a
    rerun of the same shapes on other data (+3.5%). Every committed run, that much above its measurement,
    is still within its prediction with the margin."""
    assert MEMORY_MARGIN >= (1 + 71.0 / 68.6 - 1) / (1 - MEMORY_UNDER_PREDICTION_BOUND) - 1 - 1e-9
    for m in calibration_fit.load_measurements(MEASURED):
        predicted = estimate(m.workload, m.layout, calibration_fit.measured_pool(H200, m.layout.gpus), CAL)
        assert m.peak_memory_bytes * 71.0 / 68.6 <= predicted.peak_memory_bytes * (1 + MEMORY_MARGIN), m.name


@pytest.mark.parametrize(("usable_over_peak", "fits"), [
    (1 + MEMORY_MARGIN + 1e-3, True),  # just inside the margin
    (1 + MEMORY_MARGIN - 1e-3, False),  # just outside it
    (1.01, False),  # the bare prediction fits; with the margin it does not
])
def test_a_layout_fits_when_its_peak_with_the_margin_is_within_the_usable_memory(usable_over_peak, fits):
    w = Workload(CATALOG["meta-llama/Llama-3.2-1B"], "full", 2048, 8, 1)
    layout = Layout("single", 1, 1, 8, 1, False)
    h200 = pool("H200", per_node=1)
    peak = estimate(w, layout, h200, CAL).peak_memory_bytes
    sized = replace(h200, gpu=replace(h200.gpu, memory_gib=peak * usable_over_peak / USABLE_MEMORY / GIB))
    assert evaluate(w, layout, sized, CAL).fits_gpu is fits


# --- the link that bounds communication, the batch that caps the GPUs, near ties ----------------------

@pytest.mark.parametrize(("intra", "inter", "nodes", "workload", "link", "all_on_it"), [
    # FSDP over 4 nodes: every gather crosses the Ethernet
    ("nvlink4", "eth-100g", 4, Workload(LLAMA_70B, "full", 2048, 64, 100), "eth-100g", True),
    # hybrid shard (4M tokens a step: micro-batches accumulate, FSDP would gather for each): gathers within a
    # node over NVLink, every micro-batch, and the once-a-step all-reduce across nodes over the Ethernet, whose
    # NIC the node's 8 replica groups share: what it exposes bounds the step
    ("nvlink4", "eth-100g", 4, Workload(LLAMA_70B, "full", 4096, 1024, 100), "eth-100g", False),
    # one node: NVLink carries everything
    ("nvlink4", None, 1, Workload(CATALOG["meta-llama/Llama-3.1-8B"], "lora", 2048, 64, 500), "nvlink4", True),
    # PCIe-only nodes
    ("pcie4", None, 1, Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 2048, 64, 500), "pcie4", True),
    # InfiniBand as fast as NVLink: rings across nodes cross it all the same, at its higher latency
    ("nvlink4", "ib-8x400g", 4, Workload(LLAMA_70B, "full", 2048, 64, 100), "ib-8x400g", True),
])
def test_explanations_name_the_link_that_bounds_communication(intra, inter, nodes, workload, link, all_on_it):
    p = replace(pool(per_node=8, nodes=nodes, inter=inter, host_gib=2048), intra_node=LINKS[intra])
    chosen = plan(workload, p, CAL, objective="fastest")
    e = estimate(workload, Layout(chosen.strategy, chosen.gpus, chosen.nodes, chosen.micro_batch, chosen.grad_accum,
                                  chosen.activation_checkpointing, chosen.shard_group, chosen.cpu_offload), p, CAL)
    # a link the node's replica groups cross at once is named with its share ("..., shared by 8 groups")
    assert e.bounding_link.name.startswith(LINKS[link].name) and e.bounding_link.latency_s == LINKS[link].latency_s
    named = f"{e.bounding_link.name} at {e.bounding_link.bus_bytes_per_s / 1e9:.3g} GB/s bus bandwidth"
    if all_on_it:
        assert f"all on {named}" in chosen.explanation
    else:
        share = f"{e.bounding_link_seconds / e.step_seconds:.0%} of the step"
        assert f"bound by {named}: {share}" in chosen.explanation


def test_a_communication_bound_plan_says_so_and_names_its_link():
    """Half a million tokens a step over 4 x 8 H100 on 100 GbE: the fastest layout still spends two thirds of
    its step waiting on the Ethernet, and the plan says which link and how much."""
    w = Workload(LLAMA_70B, "full", 4096, 128, 100)
    chosen = plan(w, pool(per_node=8, nodes=4, inter="eth-100g", host_gib=2048), CAL, objective="fastest")
    assert chosen.predicted.exposed_comm_share > 0.5 and "communication-bound" in chosen.explanation
    assert "exposed, all on Ethernet 100 Gb/s per node at 11.2 GB/s bus bandwidth" in chosen.explanation


def test_one_gpu_names_no_link():
    w = Workload(CATALOG["gpt2"], "full", 1024, 8, 10)
    assert "bus bandwidth" not in plan(w, pool(per_node=1), CAL).explanation


@pytest.mark.parametrize(("batch", "per_node", "nodes", "max_gpus", "cap"), [
    (16, 8, 4, None, (16, 32, 32)),  # the issue's: 16 sequences on 4 x 8
    (32, 8, 4, None, None),
    (16, 8, 4, 16, None),  # maxGPUs 16: the batch allows all of them
    (24, 8, 2, None, (8, 16, 32)),  # 24 does not split over 16
    (12, 8, 1, None, (4, 8, 16)),  # nor over 8
])
def test_the_global_batch_caps_the_gpus_a_plan_can_use(batch, per_node, nodes, max_gpus, cap):
    w = Workload(CATALOG["gpt2"], "full", 1024, batch, 1)
    found = batch_cap(w, pool(per_node=per_node, nodes=nodes, inter="eth-100g"), max_gpus or per_node * nodes)
    assert (found and (found.gpus, found.pool_gpus, found.batch_for_pool)) == cap


def test_a_plan_held_to_fewer_gpus_by_its_batch_says_so_and_offers_the_batch_for_the_pool():
    """Issue 13: the 70B job of 16 sequences used 2 of the 4 nodes, and nothing said why."""
    p = pool(per_node=8, nodes=4, inter="eth-100g")
    capped = plan(Workload(LLAMA_70B, "full", 4096, 16, 100), p, CAL)
    note = "globalBatchSize 16 allows at most 16 data-parallel ranks at micro-batch 1; 32 would let it use all 32 GPUs"
    assert capped.gpus == 16 and f"The global batch holds it to 16 GPUs: {note}." in capped.explanation
    at_cap = [r for r in capped.rejected if r.gpus == 16]
    assert at_cap and all(r.reason.endswith(f"; {note}") for r in at_cap)
    assert all(note not in r.reason for r in capped.rejected if r.gpus != 16)
    uncapped = plan(Workload(LLAMA_70B, "full", 4096, 32, 100), p, CAL, objective="fastest")
    assert uncapped.gpus == 32 and "globalBatchSize" not in uncapped.explanation + str(uncapped.rejected)


@pytest.mark.parametrize(("objective", "options", "chosen"), [
    # (cost, duration): the best on the objective's measure, or one within 1% of it that is better on the other
    ("cheapest", [(10.0, 100.0), (10.05, 50.0)], 1),
    ("cheapest", [(10.0, 100.0), (10.2, 50.0)], 0),  # 2% dearer: no tie
    ("cheapest", [(10.0, 100.0), (10.05, 50.0), (10.09, 25.0)], 2),  # the fastest of those near the cheapest
    ("fastest", [(10.0, 100.5), (20.0, 100.0)], 0),  # 0.5% slower at half the cost
    ("fastest", [(10.0, 102.0), (20.0, 100.0)], 1),
])
def test_near_ties_go_to_the_better_on_the_other_measure(objective, options, chosen):
    candidates = [SimpleNamespace(cost_usd=cost, duration_seconds=duration) for cost, duration in options]
    own = (lambda c: c.cost_usd) if objective == "cheapest" else (lambda c: c.duration_seconds)
    assert break_near_tie(objective, min(candidates, key=own), candidates) is candidates[chosen]


def test_cheapest_takes_two_gpus_at_half_the_time_for_the_same_cost_and_says_why():
    """Issue 13: LoRA with two H100s at hand: one GPU was chosen, while DDP on two is 2x faster for 0.06%
    more. Within 1% of the cheapest cost the faster layout is chosen, and the cheaper one shown. (Llama-3B:
    the issue's Llama-1B now runs micro-batch 16 on one GPU and 8 on each of two, which costs 8% more.)"""
    w = Workload(CATALOG["meta-llama/Llama-3.2-3B"], "lora", 2048, 16, 1000)
    chosen = plan(w, pool(per_node=8), CAL, max_gpus=2)
    one = plan(w, pool(per_node=8), CAL, max_gpus=1)
    assert (chosen.strategy, chosen.gpus, one.gpus) == ("ddp", 2, 1)
    assert one.predicted.cost_usd < chosen.predicted.cost_usd <= one.predicted.cost_usd * 1.01
    assert chosen.predicted.duration_seconds < one.predicted.duration_seconds / 1.9
    why = "cheaper but takes 2.00x as long: within 1% of the cheapest cost the fastest layout is chosen"
    single = next(r for r in chosen.rejected if r.strategy == "single")
    assert why in single.reason and f"Near tie: {one.explanation.split(' (cheapest)')[0]} is " in chosen.explanation


def test_a_near_tie_within_the_chosen_strategy_shows_the_layout_it_passed_over():
    w = Workload(CATALOG["meta-llama/Llama-3.2-3B"], "full", 2048, 64, 2000)
    chosen = plan(w, pool("H200", per_node=8), CAL)
    passed = [r for r in chosen.rejected if r.strategy == chosen.strategy]
    assert len(passed) == 1 and passed[0].gpus < chosen.gpus
    assert "cheaper but takes" in passed[0].reason and "within 1% of the cheapest cost" in passed[0].reason


# --- search and explanation --------------------------------------------------------------------------

def test_full_fine_tuning_of_8b_cannot_run_on_one_a100_40gb():
    """Neither on the GPU nor with the states offloaded to the 85 GB host such a node has."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 2048, 8, 100)
    with pytest.raises(NoPlan, match=r"single: does not fit: \d+ GiB at the (start|end) of backward \(\d+ with the "
                                     rf"{MEMORY_MARGIN:.0%} run-to-run margin\) > 35 GiB usable per A100-40GB .*; "
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
    H200s it does, at the same micro-batch as sharding; on 80 GB H100s too, at the same micro-batch 4 (the
    runtime since issue 12 keeps few activations and no whole logits), and sharding the base only adds its
    gathers."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "lora", 2048, 64, 500)
    eight = plan(w, pool("H200", per_node=8), CAL, objective="fastest")
    assert (eight.strategy, eight.gpus, eight.cpu_offload) == ("ddp", 8, False)
    assert eight.predicted.exposed_comm_share < 0.01
    one = plan(w, pool("H200", per_node=8), CAL, max_gpus=1)
    assert eight.predicted.duration_seconds < one.predicted.duration_seconds / 7
    h100 = plan(w, pool("H100", per_node=8), CAL, objective="fastest")
    assert (h100.strategy, h100.gpus, h100.micro_batch, h100.cpu_offload) == ("ddp", 8, 4, False)
    fsdp = next(r for r in h100.rejected if r.strategy == "fsdp")
    assert "micro-batch 4 x 2" in fsdp.reason and "% slower" in fsdp.reason
    assert h100.predicted.exposed_comm_share < 0.01


def test_70b_full_on_four_ethernet_nodes_is_hybrid_shard_within_nodes():
    """4M tokens a step on 4 x 8 H100 with 2 TB hosts over 100 GbE: each rank accumulates 4 micro-batches
    of 8, so sharding over all 32 GPUs gathers across the Ethernet for every one of them, while sharding
    within a node (NVLink) with the states offloaded, replicated across nodes, all-reduces once a step.
    At 1M tokens (one micro-batch a rank) FSDP's one gather a step costs less than that all-reduce."""
    p = pool(per_node=8, nodes=4, inter="eth-100g", host_gib=2048)
    chosen = plan(Workload(LLAMA_70B, "full", 4096, 1024, 100), p, CAL, objective="fastest")
    assert (chosen.strategy, chosen.gpus, chosen.shard_group, chosen.cpu_offload) == ("hsdp", 32, 8, True)
    # the all-reduce runs per block under the last micro-batch's backward only, and the node's one 100 GbE
    # NIC carries all 8 replica groups at once: what outlasts that backward is exposed
    assert 0.02 < chosen.predicted.exposed_comm_share < 0.15
    reasons = {r.strategy: r.reason for r in chosen.rejected}
    assert "% slower" in reasons["fsdp"]
    assert reasons["ddp"].startswith("does not fit")
    smaller = plan(Workload(LLAMA_70B, "full", 4096, 256, 100), p, CAL, objective="fastest")
    assert (smaller.strategy, smaller.gpus, smaller.grad_accum) == ("fsdp", 32, 1)
    assert "hsdp" in {r.strategy for r in smaller.rejected}


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
    assert two.peak_memory_bytes / GIB > 80  # 8B full over two GPUs at 8K tokens a micro-batch: no H100 holds it


def test_qlora_memory_follows_the_paper():
    """QLoRA: ~0.52 bytes per block weight (NF4 + double-quantized constants); the paper fine-tunes a 65B model
    on one 48 GB GPU."""
    model = CATALOG["meta-llama/Llama-3.1-70B"]
    w = Workload(model, "qlora", 2048, 16, 100)
    base = sharded_states(w, Layout("single", 1, 1, 1, 1, True))[NF4_BASE]
    assert 0.5 * model.params < base < 0.6 * model.params  # bytes: about half a byte per parameter
    assert estimate(w, Layout("single", 1, 1, 1, 16, True), pool("H100", per_node=1), CAL).peak_memory_bytes < 60 * GIB


def test_qlora_pays_for_dequantizing_every_pass_per_micro_batch():
    """Each micro-batch dequantizes every block weight in forward, in backward and in the recompute: the same
    tokens in more micro-batches cost more, and checkpointing adds a pass."""
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "qlora", 1024, 8, 1)
    p = pool("H200", per_node=1)
    bf16 = estimate(replace(w, method="lora"), Layout("single", 1, 1, 8, 1, False), p, CAL)
    one = estimate(w, Layout("single", 1, 1, 8, 1, False), p, CAL)
    split = estimate(w, Layout("single", 1, 1, 1, 8, False), p, CAL)
    blocks = w.model.layers * w.model.layer_linear_params
    per_pass = blocks * CAL.nf4_dequant_bytes_per_param / (H200.hbm_bytes_per_s * H200.memory_efficiency)
    assert one.step_seconds - bf16.step_seconds == pytest.approx(2 * per_pass, rel=1e-6)
    assert split.memory_bound_seconds - estimate(replace(w, method="lora"), Layout("single", 1, 1, 1, 8, False), p,
                                                 CAL).memory_bound_seconds == pytest.approx(16 * per_pass, rel=1e-6)
    recompute = estimate(w, Layout("single", 1, 1, 8, 1, True), p, CAL)
    bf16_recompute = estimate(replace(w, method="lora"), Layout("single", 1, 1, 8, 1, True), p, CAL)
    assert recompute.step_seconds - bf16_recompute.step_seconds == pytest.approx(3 * per_pass, rel=1e-6)
    # the blocks' weights shrink from 2 bytes to ~0.52; one module at a time is dequantized for its product
    saved = blocks * (2 - 0.52) - 2 * w.model.hidden * w.model.ffn
    assert bf16.peak_memory_bytes - one.peak_memory_bytes == pytest.approx(saved, rel=1e-6)


@pytest.mark.parametrize(("method", "objective", "layout", "copied"), [
    # the bf16 blocks in for forward and again for backward, the root (embeddings, head) once; the adapters'
    # gradients out, fewer bytes the other way
    ("lora", "sft", Layout("single", 1, 1, 4, 1, False, cpu_offload=True), lambda p, root: 2 * (2 * p - root)),
    # fp32 masters in (8 bytes a block weight); their fp32 gradients out (4) at the same time
    ("full", "sft", Layout("single", 1, 1, 4, 1, False, cpu_offload=True), lambda p, root: 4 * (2 * p - root)),
    # dpo's reference forward copies the bf16 weights in once more: a full fine-tune's copy whole, LoRA's base its
    # blocks (the root still gathered from the policy's forward)
    ("full", "dpo", Layout("single", 1, 1, 4, 1, False, cpu_offload=True),
     lambda p, root: 4 * (2 * p - root) + 2 * p),
    ("lora", "dpo", Layout("single", 1, 1, 4, 1, False, cpu_offload=True),
     lambda p, root: 2 * (2 * p - root) + 2 * (p - root)),
    # per micro-batch, and each rank its shard
    ("full", "sft", Layout("fsdp", 8, 1, 1, 4, False, shard_group=8, cpu_offload=True),
     lambda p, root: 4 * 4 * (2 * p - root) / 8),
    ("full", "sft", Layout("single", 1, 1, 4, 1, False), lambda p, root: 0),
])
@pytest.mark.parametrize(("model", "root"), [
    ("meta-llama/Llama-3.1-8B", lambda m: 2 * m.vocab * m.hidden + m.hidden),  # embeddings, head, final norm
    ("meta-llama/Llama-3.2-1B", lambda m: m.vocab * m.hidden + m.hidden),  # the head tied to the embeddings
])
def test_offloaded_states_cross_the_host_link_each_micro_batch_in_the_busier_direction(method, objective, layout,
                                                                                       copied, model, root):
    m = CATALOG[model]
    w = Workload(m, method, 1024, 4 * layout.gpus, 1, objective=objective)
    e = estimate(w, layout, pool(per_node=layout.gpus), CAL)
    rate = GPUS["H100"].host_bytes_per_s / CAL.host_copy_slowdown
    assert e.offload_seconds == pytest.approx(copied(m.params, root(m)) / rate, rel=1e-6)
    assert e.exposed_offload_seconds == e.offload_seconds  # measured: none hidden under the compute


def test_committed_offload_constant_is_the_fit_of_the_offload_run_and_holds_on_the_one_left_out():
    """offload_fit: the copies' rate fitted on Llama-8B LoRA offloaded on one H100 (the copies two thirds of its
    step; the planner had it 45% fast in tokens/s with the copies hidden under compute, 17% with them counted whole
    at the catalog's link rate). Held out: Llama-1B full fine-tuning offloaded on one H200, its step within 5% (the
    host's AdamW, fitted on it, is most of it) and its forward and backward, where the copies are, within 20%."""
    runs = offload_fit.load_runs([*QLORA_MEASURED, *MEASURED])
    assert offload_fit.fit(runs, CAL, H200) == pytest.approx(CAL.host_copy_slowdown, rel=1e-6)
    rows = {r["run"]: r for r in offload_fit.compare(runs, CAL, H200)}
    fitted, held_out = rows["8b-lora-bf16-offload"], rows["llama-1b-full-single-1gpu-mb8-offload"]
    assert fitted["fit_set"] and not held_out["fit_set"]
    assert abs(held_out["step_error"]) <= 0.05 and abs(held_out["forward_backward_error"]) <= 0.20
    assert 1.0 < CAL.host_copy_slowdown < 1.5  # FSDP2's per-block copies reach less than a large pinned copy


def test_committed_qlora_constant_is_the_fit_of_the_committed_qlora_runs_and_predicts_them():
    runs = qlora_fit.load_runs(QLORA_MEASURED)
    assert qlora_fit.fit(runs, CAL, H200) == pytest.approx(CAL.nf4_dequant_bytes_per_param, rel=1e-6)
    compiled = [r for r in qlora_fit.compare(runs, CAL, H200) if r["compiled"]]
    assert compiled and all(abs(r["step_error"]) <= 0.10 for r in compiled)
    assert all(r["memory_error"] >= -MEMORY_UNDER_PREDICTION_BOUND for r in compiled)
    # held out: a 70B-shaped model and an 8B at twice the micro-batch, checkpointed, on one H100 (2026-12-07)
    held_out = {r["run"]: r for r in qlora_fit.compare(runs, CAL, H200) if r["chip"] == "H100"}
    assert set(held_out) == {"70b-qlora-mb4-ac", "8b-qlora-mb8-ac"}
    assert all(abs(r["step_error"]) <= 0.05 and abs(r["memory_error"]) <= 0.05 for r in held_out.values())


def test_one_h100_runs_at_the_h200s_efficiencies_as_our_runs_there_measured():
    """Our runtime on one H100 (2026-12-05: Llama-8B LoRA and 3B full through Ray Train, Llama-1B LoRA without;
    bf16 and FP8), predicted with the H200's efficiencies at the H100's datasheet bandwidth, fitted on none of
    them (but fp8_fit's cast bytes, fitted on the 8B FP8 run): within the one-GPU targets. With the factor published
    runs on H100s reached (what one H100 ran at before), every run was 24-30% faster than predicted, its cost that
    much dearer."""
    runs, skipped = chip_check.load_runs(H100_MEASURED)
    rows = chip_check.compare(runs)
    assert {r["chip"] for r in rows} == {"H100"} and len(rows) >= 5 and not skipped
    bf16, fp8 = ([r for r in rows if r["precision"] == p] for p in ("bf16", "fp8"))
    assert len(bf16) >= 3 and all(abs(r["error"]) <= 0.06 for r in bf16)
    assert fp8 and all(abs(r["error"]) <= 0.05 for r in fp8)  # the 8B run is fp8_fit's, the 1B one held out
    assert all(abs(r["memory_error"]) <= MEMORY_UNDER_PREDICTION_BOUND for r in rows)
    assert all(r["error_before"] < -0.2 for r in rows)


def test_the_committed_fp8_cast_bytes_are_the_fit_of_the_fp8_runs_and_hold_on_the_one_left_out():
    """fp8_fit: the activations' cast bytes fitted on the fp8_check runs (Llama-8B LoRA on one H100, through Ray),
    the vs_hf one (Llama-1B LoRA, without Ray) held out: within 5% where the count (5 bytes) was 7.5% slow."""
    runs = fp8_fit.fp8_runs(H100_MEASURED)
    assert fp8_fit.fit(runs, CAL) == pytest.approx(CAL.fp8_activation_cast_bytes, rel=1e-6)
    assert 1.0 < CAL.fp8_activation_cast_bytes < 5.0  # compiled blocks fuse some of the count's traffic
    held_out = [r for r in fp8_fit.compare(runs, CAL) if not r["fit_set"]]
    assert held_out and all(abs(r["error"]) <= 0.05 for r in held_out)
    counted = fp8_fit.compare(runs, replace(CAL, fp8_activation_cast_bytes=5.0))
    assert all(r["error"] < -0.07 for r in counted)


def test_several_h100s_keep_the_factor_published_runs_on_them_reached():
    """No run of ours has crossed GPUs: a plan over several H100s runs at the published factor over the H200's
    efficiencies (scale_fit's held-out check is of those), one H100 at ours."""
    h100, factor = calibration.for_gpu("H100"), calibration.published_factor("H100")
    assert factor < 0.8
    assert h100.on(1).matmul_efficiency == pytest.approx(H200.matmul_efficiency)
    assert h100.on(8).matmul_efficiency == pytest.approx(H200.matmul_efficiency * factor)
    assert h100.on(8).memory_efficiency == pytest.approx(H200.memory_efficiency * factor)
    a100 = calibration.for_gpu("A100-80GB")  # another die: the published factor, one GPU or several
    assert a100.on(1) == a100.on(8) and a100.matmul_efficiency < H200.matmul_efficiency
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 2048, 2, steps=1)
    p = Pool("h100", h100, 8, 1, LINKS["nvlink4"], None, 4.0)
    published = replace(p, gpu=GPUS["H100"].calibrated(matmul_efficiency=H200.matmul_efficiency * factor,
                                                        memory_efficiency=H200.memory_efficiency * factor))
    layout = Layout("fsdp", 8, 1, 2, 1, True)
    assert estimate(w, layout, p, CAL).step_seconds == pytest.approx(estimate(w, layout, published, CAL).step_seconds)


def test_recompute_as_the_runtime_resolves_it_predicts_the_measured_lora_peaks():
    """kernels.recompute on one H200 (vs_recompute_h200_2026-12-05.json): Llama-1B LoRA, seq 2048, mb 8, 22.8 GiB
    without, 16.9 GiB with; a job's workload takes the runtime's auto, on for bf16 LoRA sft alone."""
    runs = json.loads((RESULTS / "vs_recompute_h200_2026-12-05.json").read_text())["runs"]["llama1b-lora"]
    w = Workload(calibration_fit.MEASURED_MODELS["llama-1b"], "lora", 2048, 8, 1)
    layout, p = Layout("single", 1, 1, 8, 1, False), calibration_fit.measured_pool(H200, 1)
    for system, recompute in (("tunewright", "off"), ("tw-recompute", "on"), ("tw-recompute", "auto")):
        predicted = estimate(replace(w, recompute=recompute), layout, p, CAL).peak_memory_bytes / GIB
        assert predicted == pytest.approx(runs[system]["peak_memory_gib"], rel=0.01)
    for method, objective, precision in (("full", "sft", "bf16"), ("qlora", "sft", "bf16"), ("lora", "dpo", "bf16"),
                                         ("lora", "sft", "fp8")):
        assert not replace(w, method=method, objective=objective, precision=precision, recompute="auto").recomputes


def test_lora_dropout_and_dpos_logits_as_one_h200_run_of_each_measured_them():
    """dpo_check_h200_2026-12-04.json, Llama-1B at seq 1024 with the spec's defaults, blocks compiled (no recompute
    then). sft LoRA kept its adapters' dropped inputs (dropout 0.05): 17.9 GiB where the planner, fitted on runs
    without dropout, counted 13.1 (-26%). DPO runs without dropout but takes the policy's whole logits, not the
    fused chunk: 16.2 GiB (LoRA) and 32.3 (full) against 13.1 and 29.8 (-19%, -7.6%). LORA_DROPOUT_BYTES is fitted
    on the sft LoRA run and DPO_LOGITS_BYTES on the DPO LoRA run; the full DPO run is held out."""
    rows = {r["run"]: r for r in json.loads((RESULTS / "dpo_check_h200_2026-12-04.json").read_text())["rows"]}
    p, llama = calibration_fit.measured_pool(H200, 1), calibration_fit.MEASURED_MODELS["llama-1b"]
    for run, method, objective, micro, dropout, bounds in (
            ("sft-lora", "lora", "sft", 8, True, (-0.01, 0.01)), ("dpo-lora", "lora", "dpo", 4, False, (-0.01, 0.01)),
            ("dpo-full", "full", "dpo", 4, False, (-0.01, 0.02)), ("sft-full", "full", "sft", 8, False, (-0.01, 0.01))):
        w = Workload(llama, method, 1024, micro, 1, objective=objective, lora_dropout=dropout)
        predicted = estimate(w, Layout("single", 1, 1, micro, 1, False), p, CAL).peak_memory_bytes / GIB
        assert bounds[0] <= predicted / rows[run]["peak_memory_gib"] - 1 <= bounds[1], (run, predicted)
    # a job's workload carries the spec's dropout for sft; dpo turns dropout off, full fine-tuning has no adapters
    base = {"model": {"source": "m"}, "dataset": {"train": "f"}, "hyperparameters": {"maxSteps": 1, "seqLen": 1024}}
    one_b = CATALOG["meta-llama/Llama-3.2-1B"]
    lora = FineTuneJobSpec.model_validate({**base, "method": {"type": "lora"}})
    assert lora.method.lora.dropout > 0 and workload(lora, one_b, None).lora_dropout
    for method in ({"type": "lora", "lora": {"dropout": 0}}, {"type": "lora", "objective": "dpo"}, {"type": "full"}):
        spec = FineTuneJobSpec.model_validate({**base, "method": method,
                                               "dataset": {"train": "f", "format": "preference"}
                                               if method.get("objective") else base["dataset"]})
        assert not workload(spec, one_b, None).lora_dropout, method


def test_lora_dropout_under_recompute_and_dpos_logits_hold_on_an_h100_run_fitted_on_neither():
    """dpo_check_h100_2026-12-07-lora.json, the same model and data on one H100 through Ray, blocks compiled and
    (sft LoRA's default since) recomputing: the dropout term where the blocks recompute (1.07 bytes an element, the
    CPU compiler's count scaled, never fitted) and DPO's logits term, each within 1% of the peak; the steps within
    10% (DPO's 8.5% fast, as on the H200)."""
    rows = {r["run"]: r for r in json.loads((RESULTS / "dpo_check_h100_2026-12-07-lora.json").read_text())["rows"]}
    p, llama = calibration_fit.measured_pool(calibration.for_gpu("H100"), 1), calibration_fit.MEASURED_MODELS["llama-1b"]
    for run, objective, micro, dropout in (("sft-lora", "sft", 8, True), ("dpo-lora", "dpo", 4, False)):
        w = Workload(llama, "lora", 1024, micro, 1, objective=objective, lora_dropout=dropout, recompute="auto")
        e = estimate(w, Layout("single", 1, 1, micro, 1, False), p, CAL)
        assert abs(e.peak_memory_bytes / GIB / rows[run]["peak_memory_gib"] - 1) <= 0.01, run
        assert abs(e.step_seconds / rows[run]["step_seconds_median"] - 1) <= 0.10, run
        assert e.step_seconds == pytest.approx(rows[run]["predicted_step_seconds"], rel=1e-6)  # as the check said
    assert w.recomputes is False and replace(w, objective="sft", lora_dropout=True).recomputes


def test_qlora_plans_one_gpu_or_ddp_and_never_offloads():
    w = Workload(CATALOG["meta-llama/Llama-3.1-70B"], "qlora", 1024, 16, 100)
    chosen = plan(w, pool("H200", per_node=8, host_gib=2048), CAL)
    assert chosen.strategy in ("single", "ddp") and not chosen.cpu_offload
    assert {r.strategy for r in chosen.rejected} <= {"single", "ddp"}
    with pytest.raises(NoPlan, match="strategy fsdp: the runtime does not shard a 4-bit"):
        plan(w, pool("H200", per_node=8), CAL, strategy="fsdp")


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
    from tunewright_core.spec import FineTuneJobSpec

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
    from tunewright_core.planner.jobs import sized_for_data

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
    from tunewright_core.planner.jobs import sized_for_data

    with pytest.raises(ValueError, match=rf"^{field}: at most \d+ (sequences|tokens) a step, not \d+; one epoch "
                                         r"\(150 examples\) holds about"):
        sized_for_data(_spec(**hyper), examples=150, characters=150 * 240, longest_characters=400)


def test_every_other_block_is_checkpointed_where_memory_allows_no_more_and_needs_no_less():
    """Llama-3.1-8B full at 4096 tokens on 8 A100-40GB: without checkpointing it does not fit at micro-batch
    1; every other block checkpointed does, and recomputes half of what full checkpointing would."""
    p = replace(pool("A100-40GB", per_node=8), intra_node=LINKS["nvlink3"])
    w = Workload(CATALOG["meta-llama/Llama-3.1-8B"], "full", 4096, 64, 100)
    chosen = plan(w, p, CAL, objective="fastest")
    assert (chosen.strategy, chosen.micro_batch, chosen.activation_checkpointing,
            chosen.activation_checkpointing_every) == ("fsdp", 1, True, 2)
    assert "activation checkpointing (every other block)" in chosen.explanation
    full, every_other = (estimate(w, Layout("fsdp", 8, 1, 1, 8, True, 8, checkpoint_every=k), p, CAL) for k in (1, 2))
    none = estimate(w, Layout("fsdp", 8, 1, 1, 8, False, 8), p, CAL)
    assert full.peak_memory_bytes < every_other.peak_memory_bytes < none.peak_memory_bytes
    assert none.matmul_seconds < every_other.matmul_seconds < full.matmul_seconds


def test_weights_stay_gathered_until_backward_where_the_network_is_slow_and_memory_allows():
    """Llama-3.2-3B full on 2 nodes over 25 GbE: one gather per block per micro-batch instead of two."""
    p = pool(per_node=8, nodes=2, inter="eth-25g")
    w = Workload(CATALOG["meta-llama/Llama-3.2-3B"], "full", 4096, 128, 100)
    chosen = plan(w, p, CAL, objective="fastest")
    assert chosen.reshard_after_forward is False and chosen.strategy in ("fsdp", "hsdp")
    assert "weights kept unsharded until backward" in chosen.explanation
    kept, resharded = (estimate(w, Layout(chosen.strategy, chosen.gpus, chosen.nodes, chosen.micro_batch,
                                          chosen.grad_accum, chosen.activation_checkpointing, chosen.shard_group,
                                          reshard_after_forward=r), p, CAL) for r in (False, True))
    assert kept.comm_seconds < resharded.comm_seconds and kept.peak_memory_bytes > resharded.peak_memory_bytes


@pytest.mark.parametrize(("layers", "every", "share"), [(32, 1, 1.0), (32, 2, 0.5), (27, 2, 14 / 27), (27, 4, 7 / 27),
                                                          (3, 5, 1 / 3)])
def test_the_checkpointed_blocks_are_those_the_runtime_wraps(layers, every, share):
    """The runtime checkpoints the 1st, (N+1)-th, ... block: ceil(layers / N) of them, not layers / N."""
    layout = Layout("single", 1, 1, 1, 1, True, checkpoint_every=every)
    assert layout.checkpointed_share(layers) == pytest.approx(share)
    assert Layout("single", 1, 1, 1, 1, False, checkpoint_every=every).checkpointed_share(layers) == 0.0


@pytest.mark.parametrize(("per_node", "max_gpus", "global_batch", "strategy", "reason"), [
    (1, None, 64, "ddp", "ddp spreads over 2 GPUs or more, and this pool offers 1 GPU"),
    (8, 1, 64, "fsdp", "fsdp spreads over 2 GPUs or more, and this pool offers 1 GPU (resources.maxGPUs)"),
    (2, None, 64, "hsdp", "hsdp shards within a group and replicates across 2 or more groups; this pool offers 2 "
                          "GPUs (2 a node): too few for two groups"),
    (8, None, 3, "ddp", "the global batch (3) divides over none of the GPU counts this pool offers for it (2, 4, "
                        "8): set hyperparameters.globalBatchSize to a multiple of one"),
    (8, None, 2, "hsdp", "the global batch (2) divides over none of the GPU counts this pool offers for it (4, 8)"),
    (1, 64, 64, "ddp", "ddp spreads over 2 GPUs or more, and this pool offers 1 GPU; "),  # maxGPUs is not why
])
def test_a_strategy_no_gpu_count_suits_says_why(per_node, max_gpus, global_batch, strategy, reason):
    w = Workload(CATALOG["meta-llama/Llama-3.2-1B"], "lora", 1024, global_batch, 100)
    with pytest.raises(NoPlan) as refused:
        plan(w, pool(per_node=per_node), CAL, strategy=strategy, max_gpus=max_gpus)
    assert f"{strategy}: {reason}" in f"{refused.value}; ", str(refused.value)
