"""The training step's fast paths compute what the plain ones do, and each run says which it takes and why."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tunewright_jobs.config import JobConfig
from tunewright_jobs.data import IGNORE_INDEX
from tunewright_jobs.kernels import (
    VARLEN,
    copy_to_device,
    document_offsets,
    fused_linear_cross_entropy,
    one_document_rows,
    plain_cross_entropy,
    resolve,
)


@pytest.mark.parametrize("weight_trains", [True, False])  # full fine-tuning; LoRA (the head is frozen)
@pytest.mark.parametrize("chunk", [7, 64, None])  # chunks that do not divide the tokens, one chunk, the default
@pytest.mark.parametrize("vocab", [97, 128])  # padded to the matmuls' alignment (as GPT-2's 50257); aligned
def test_the_fused_loss_and_its_gradients_equal_the_plain_ones(weight_trains, chunk, vocab):
    torch.manual_seed(0)
    tokens, hidden_size = 50, 16
    hidden = torch.randn(tokens, hidden_size, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64, requires_grad=weight_trains)
    labels = torch.randint(0, vocab, (tokens,))
    labels[::3] = IGNORE_INDEX  # prompts and padding

    fused = fused_linear_cross_entropy(hidden, weight, labels, chunk)
    (fused * 0.37).backward()  # the step scales the summed loss
    fused_grads = hidden.grad.clone(), weight.grad.clone() if weight_trains else None
    hidden.grad = None
    weight.grad = None

    plain = plain_cross_entropy((hidden @ weight.t())[None], labels[None]).double()
    (plain * 0.37).backward()
    close = dict(rtol=1e-5, atol=1e-6)  # both in fp32 arithmetic, summed in other orders
    torch.testing.assert_close(fused.double(), plain, **close)
    torch.testing.assert_close(fused_grads[0], hidden.grad, **close)
    if weight_trains:
        torch.testing.assert_close(fused_grads[1], weight.grad, **close)
    else:
        assert weight.grad is None


def test_nothing_to_learn_costs_nothing():
    hidden = torch.randn(4, 8, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, torch.randn(11, 8), torch.full((4,), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0 and torch.count_nonzero(hidden.grad) == 0


def test_document_offsets_bound_each_packed_document_and_padded_tail():
    positions = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])  # row 0: 3 + 2 + a tail of 1
    assert document_offsets(positions).tolist() == [0, 3, 5, 6, 10, 12]
    assert document_offsets(np.tile(np.arange(4), (2, 1))).tolist() == [0, 4, 8]  # fixed-length rows


@pytest.mark.parametrize(("positions", "real", "expected"), [
    ([[0, 1, 2, 3], [0, 1, 2, 3]], [4, 4], True),  # rows filled by one document
    ([[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 5]], [5, 6], True),  # one document each, then a padded tail
    ([[0, 1, 2, 0], [0, 1, 0, 1]], [3, 2], False),  # so much padding that attending over whole rows is slower
    ([[0, 1, 0, 1], [0, 1, 2, 3]], [4, 4], False),  # a second document in row 0
    ([[0, 1, 2, 0], [0, 1, 2, 3]], [4, 4], False),  # a one-token second document at the row's end
    ([[0, 0, 1, 2], [0, 1, 2, 3]], [3, 4], False),  # real tokens not from the row's start (padding before them)
])
def test_one_document_rows_holds_only_where_every_real_token_is_in_its_rows_first_document(positions, real, expected):
    assert one_document_rows(np.array(positions), np.array(real)) is expected


def job(**sections) -> JobConfig:
    return JobConfig.from_dict({"output_dir": "/tmp/x", "model": {"source": "m", **sections.pop("model", {})},
                                "dataset": {"train": "t.jsonl"}, **sections})


class FakeLM:
    """What resolve reads of a causal LM: its config, its head, whether it uses the attention interface."""

    _supports_attention_backend = True

    def __init__(self, head=None, **config):
        self.config, self.head = SimpleNamespace(**config), head or torch.nn.Linear(8, 16, bias=False)

    def get_output_embeddings(self):
        return self.head


class OwnAttention(FakeLM):
    _supports_attention_backend = False  # e.g. Falcon, remote code: builds its own masks


LLAMA = FakeLM(attention_dropout=0.0)
GPT2_WITH_DROPOUT = FakeLM(attn_pdrop=0.1)
GEMMA2 = FakeLM(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
PHI = FakeLM(head=torch.nn.Linear(8, 16, bias=True))
LORA_ON_HEAD = FakeLM(head=torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False)))
CUDA, CPU, BF16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16


@pytest.fixture
def hopper(monkeypatch):
    """resolve sees varlen attention available on a Hopper GPU (this machine has none)."""
    monkeypatch.setattr("tunewright_jobs.kernels.varlen_attention_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize(("sections", "device", "lm", "dtype", "expected", "why"), [
    ({}, CUDA, LLAMA, BF16, (VARLEN, True, True), "attention: varlen over each packed document"),
    ({}, CPU, LLAMA, torch.float32, ("sdpa", True, False), "varlen attention needs CUDA"),
    ({}, CUDA, LLAMA, torch.float32, ("sdpa", True, True), "needs bf16 or fp16 compute (this run computes in float32)"),
    ({}, CUDA, GPT2_WITH_DROPOUT, BF16, ("sdpa", True, True), "does not do attention dropout (attn_pdrop=0.1)"),
    ({}, CUDA, OwnAttention(), BF16, ("sdpa", True, True), "attention interface (OwnAttention does not)"),
    ({}, CUDA, GEMMA2, BF16, ("sdpa", False, True), "loss: plain (the model's final_logit_softcapping)"),
    ({}, CUDA, PHI, BF16, (VARLEN, False, True), "loss: plain (the output head has a bias)"),
    ({}, CUDA, LORA_ON_HEAD, BF16, (VARLEN, False, True), "the output head is a Sequential, not a plain Linear"),
    ({"kernels": {"fused_loss": "off", "compile": "off"}, "model": {"attn_implementation": "eager"}}, CUDA, LLAMA,
     BF16, ("eager", False, False), "attention: eager (asked for)"),
    ({"kernels": {"compile": "on"}}, CPU, LLAMA, torch.float32, ("sdpa", True, True),
     "compile: decoder blocks (asked for)"),
    ({"strategy": {"precision": "fp8", "use_gpu": True}}, CUDA, LLAMA, BF16, (VARLEN, True, True),
     "compile: decoder blocks"),  # the FP8 products trace whole, casts and all
])
def test_each_run_takes_the_paths_its_device_and_model_allow(sections, device, lm, dtype, expected, why, hopper):
    kernels = resolve(job(**sections), device, lm, dtype)
    assert (kernels.attention, kernels.fused_loss, kernels.compile_blocks) == expected
    assert why in kernels.describe()


@pytest.mark.parametrize(("sections", "dtype", "on"), [
    ({}, BF16, True),  # precision auto, as every job config the API writes has it: bf16 on a GPU
    ({"strategy": {"precision": "bf16", "use_gpu": True}}, BF16, True),
    ({"strategy": {"precision": "fp8", "use_gpu": True}}, BF16, False),  # not yet measured
    ({}, torch.float32, False),
    ({"method": {"type": "full"}}, BF16, False),
])
def test_recompute_auto_is_on_where_a_gpu_measured_it(hopper, sections, dtype, on):
    """A measurement found it off for every job config the API writes (precision auto): the default is read from
    the precision the run computes in, not the word in its config."""
    kernels = resolve(job(**sections), CUDA, LLAMA, dtype)
    assert kernels.recompute is on, kernels.describe()


def test_recompute_is_asked_for_on_compiled_blocks_only(hopper):
    asked = resolve(job(kernels={"compile": "on", "recompute": "on"}), CPU, LLAMA, torch.float32)
    assert asked.recompute and "recompute: elementwise work in backward (asked for)" in asked.describe()
    assert not resolve(job(), CPU, LLAMA, torch.float32).recompute
    with pytest.raises(ValueError, match="kernels.recompute: .* does not compile them .*set kernels.compile on"):
        resolve(job(kernels={"recompute": "on"}), CPU, LLAMA, torch.float32)


@pytest.mark.parametrize(("method", "precision", "on", "why"), [
    ({"type": "lora"}, "bf16", True, "recompute: elementwise work in backward"),
    ({"type": "full"}, "bf16", False, "recompute: off (not yet measured for full sft in bf16)"),
    ({"type": "lora", "lora": {"quantization": "nf4"}}, "bf16", False, "not yet measured for qlora sft"),
    ({"type": "lora", "objective": "dpo"}, "bf16", False, "not yet measured for lora dpo"),
])
def test_recompute_auto_is_on_where_a_gpu_measured_it_as_the_planner_counts(method, precision, on, why, hopper):
    data = {"dataset": {"train": "t.jsonl", "format": "preference"}} if method.get("objective") == "dpo" else {}
    kernels = resolve(job(method=method, strategy={"precision": precision}, **data), CUDA, LLAMA, BF16)
    assert kernels.recompute is on and why in kernels.describe()
    assert resolve(job(method=method, kernels={"recompute": "off"}, **data), CUDA, LLAMA, BF16).recompute is False


def test_an_older_gpu_gets_sdpa(hopper, monkeypatch):
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda device=None: (7, 0))  # V100
    assert "attention: sdpa (varlen attention needs an Ampere or newer GPU)" in resolve(job(), CUDA, LLAMA,
                                                                                      BF16).describe()


@pytest.mark.parametrize(("sections", "device", "lm", "field"), [
    ({"model": {"attn_implementation": "varlen"}}, CPU, LLAMA, "model.attn_implementation: varlen attention needs CUDA"),
    ({"model": {"attn_implementation": "varlen"}}, CUDA, GPT2_WITH_DROPOUT, "varlen attention does not do attention dropout"),
    ({"kernels": {"fused_loss": "on"}}, CUDA, GEMMA2, "kernels.fused_loss: the model's final_logit_softcapping"),
    ({"kernels": {"fused_loss": "on"}}, CUDA, PHI, "kernels.fused_loss: the output head has a bias"),
])
def test_a_forced_path_that_cannot_run_is_refused_naming_the_field(sections, device, lm, field, hopper):
    with pytest.raises(ValueError, match=field):
        resolve(job(**sections), device, lm, BF16)


@pytest.mark.slow  # trains four short runs
@pytest.mark.parametrize(("kind", "method"), [("gpt2", "lora"), ("llama", "full")])  # tied head; a head that trains
def test_a_run_with_the_fused_loss_follows_the_plain_runs_curve(tiny_models, tmp_path, kind, method):
    """The same data, seed and steps with the fused loss on and off: the same losses, step by step (the
    fast path changes where the work happens, not what is learned)."""
    from tests.jobs.conftest import make_config, metrics
    from tunewright_jobs.run import train_without_ray

    curves = {}
    for fused in ("on", "off"):
        cfg = make_config(tiny_models[kind], tmp_path / fused, method={"type": method},
                          hyperparameters={"max_steps": 6, "learning_rate": 2e-3}, kernels={"fused_loss": fused},
                          checkpoint={"final": False}, dataset={"validation": None}, eval={})
        train_without_ray(cfg)
        curves[fused] = [r.loss for r in metrics(cfg)]
    assert len(curves["on"]) == 6 and curves["on"][-1] < curves["on"][0]
    np.testing.assert_allclose(curves["on"], curves["off"], rtol=1e-4)


def reference_varlen(q, k, v, offsets, longest, scale):
    """What FlashAttention's varlen kernel computes, one document at a time (the CPU has no such kernel)."""
    out = torch.empty_like(q)
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    for start, end in itertools.pairwise(offsets.tolist()):
        doc = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(*doc, is_causal=True, scale=scale
                                                                          ).transpose(0, 1)
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # learned positions; RoPE and grouped KV heads
def test_varlen_attention_inside_the_model_equals_sdpa_with_the_block_mask(tiny_models, kind, monkeypatch):
    """Packed rows through a real model: our attention (offsets passed down through the decoder's kwargs)
    gives the logits transformers' SDPA gives with the dense block mask it builds from restarting positions."""
    from transformers import AutoModelForCausalLM

    from tunewright_jobs import kernels

    monkeypatch.setattr(kernels, "_VARLEN_CALL", [reference_varlen])
    kernels.register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_models[kind], attn_implementation="sdpa").eval()
    positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    ids = torch.randint(0, 300, positions.shape)
    with torch.no_grad():
        masked = model(input_ids=ids, position_ids=torch.as_tensor(positions), use_cache=False).logits
        model.config._attn_implementation = kernels.VARLEN
        varlen = model(input_ids=ids, position_ids=torch.as_tensor(positions), use_cache=False,
                       **kernels.varlen_inputs(positions, np.full(2, 10), torch.device("cpu"))).logits
        with kernels.for_evaluation(model):  # no offsets: the plain path
            assert model.config._attn_implementation == "sdpa"
            torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert model.config._attn_implementation == kernels.VARLEN
    torch.testing.assert_close(varlen, masked, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="without the packing's offsets"):
        model(input_ids=ids)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_rows_of_one_document_take_causal_sdpa_and_equal_attention_per_document(tiny_models, kind, monkeypatch):
    """Rows holding one document each (row 1 then a token of padding) go through causal SDPA over the whole row, not the
    varlen kernel: every real token's logits equal those of attention bounded per document."""
    from transformers import AutoModelForCausalLM

    from tunewright_jobs import kernels

    calls = []
    monkeypatch.setattr(kernels, "_VARLEN_CALL", [lambda *args: calls.append(args) or reference_varlen(*args)])
    kernels.register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_models[kind], attn_implementation="sdpa").eval()
    model.config._attn_implementation = kernels.VARLEN
    positions = np.array([list(range(10)), [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]])
    real = np.array([10, 9])
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 300, positions.shape))
    inputs = kernels.varlen_inputs(positions, real, torch.device("cpu"))
    assert inputs[kernels.ONE_DOCUMENT_ROWS]
    with torch.no_grad():
        rows = model(input_ids=ids, position_ids=torch.as_tensor(positions), use_cache=False, **inputs).logits
        assert not calls
        bounded = model(input_ids=ids, position_ids=torch.as_tensor(positions), use_cache=False,
                        **inputs | {kernels.ONE_DOCUMENT_ROWS: False}).logits
        assert calls
    torch.testing.assert_close(rows[0], bounded[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[1, :9], bounded[1, :9], rtol=1e-4, atol=1e-4)


def test_frozen_weights_leave_fsdp_only_where_nothing_needs_them_there():
    """One-GPU shards: a frozen weight already in the compute dtype is left out of FSDP (nothing to gather,
    cast or reduce); one in another dtype stays (FSDP casts it: a bf16 base under fp32 compute); sharded or
    offloaded runs keep everything in FSDP."""
    from tunewright_jobs.parallel import one_gpu_shards

    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4))
    model[0].requires_grad_(False)
    frozen_bf16 = set(model[0].parameters())
    assert one_gpu_shards(model, shard_size=1, offload=False, dtype=torch.bfloat16) == {"ignored_params": frozen_bf16}
    assert one_gpu_shards(model, shard_size=1, offload=False, dtype=torch.float32) == {}
    assert one_gpu_shards(model, shard_size=2, offload=False, dtype=torch.bfloat16) == {}
    assert one_gpu_shards(model, shard_size=1, offload=True, dtype=torch.bfloat16) == {}


@pytest.mark.parametrize(("shard_size", "offload", "frozen_in_fsdp", "kept"), [
    (1, False, False, True),  # single, DDP: the whole model is the shard (full, or a LoRA base outside FSDP)
    (1, False, True, False),  # a LoRA base FSDP casts (not in the compute dtype): its copies are not counted
    (1, True, False, False),  # offloaded: the copy comes from the host, held only while computed
    (2, False, False, False),  # FSDP, HSDP: freeing the gathered copy is what sharding saves
])
def test_blocks_stay_gathered_from_forward_to_backward_only_on_one_gpu_shards(shard_size, offload, frozen_in_fsdp,
                                                                              kept):
    from tunewright_jobs.parallel import keeps_blocks_gathered

    assert keeps_blocks_gathered(shard_size=shard_size, offload=offload, frozen_in_fsdp=frozen_in_fsdp) is kept


def test_host_arrays_reach_the_device_equal():
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    tensor = copy_to_device(array, torch.device("cpu"))
    assert tensor.dtype == torch.int64 and tensor.tolist() == array.tolist()
