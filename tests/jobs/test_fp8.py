"""FP8 products (`strategy.precision: fp8`): tensor-wise scaled E4M3 forward and E5M2 gradients, on the CPU's
`_scaled_mm` (an emulation: the numbers are the GPU's, not the speed); the frozen weight's cast kept, a trained
one's redone; the tiny Llama converted, adapted by PEFT; the refusals (the CPU, a 4-bit base)."""

import copy
import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.jobs.conftest import make_config
from tunewright_jobs import fp8
from tunewright_jobs.config import ConfigError
from tunewright_jobs.fp8 import Float8Linear, convert_blocks_to_fp8, keep_frozen_casts
from tunewright_jobs.model import transformer_blocks, use_fp8

# E4M3 keeps 3 mantissa bits (E5M2: 2): an element rounds by up to 1/16 (1/8) of itself, and a product's
# relative error over many terms is about a third of that; measured 3.7% (forward) and 6.0% (gradients) here
FORWARD_TOLERANCE, GRADIENT_TOLERANCE = 0.06, 0.1
CPU = torch.device("cpu")
BF16_COMPILE_DRIFT = 0.005  # a compiled bf16 Llama block's output against eager's, relative: 0.003 measured


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def pair(trains: bool = True, keep: bool = True) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 96).to(torch.bfloat16)
    converted = torch.nn.Linear(64, 96).to(torch.bfloat16)
    converted.load_state_dict(reference.state_dict())
    convert_blocks_to_fp8([converted])
    for module in (reference, converted):
        module.weight.requires_grad_(trains)
    if keep:
        keep_frozen_casts([converted], CPU)
    return converted, reference


def test_products_and_gradients_are_the_bf16_ones_to_fp8s_rounding():
    converted, reference = pair()
    assert isinstance(converted, Float8Linear)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    out, want = converted(x), reference(x_reference)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert relative(out, want) < FORWARD_TOLERANCE
    gradient = torch.randn_like(out)
    out.backward(gradient)
    want.backward(gradient)
    assert relative(x.grad, x_reference.grad) < GRADIENT_TOLERANCE
    assert relative(converted.weight.grad, reference.weight.grad) < GRADIENT_TOLERANCE
    torch.testing.assert_close(converted.bias.grad, reference.bias.grad)  # the bias adds in bf16


def test_a_number_of_tokens_off_the_16_row_tiles_is_padded_and_cut():
    """One generated token, an evaluation batch of odd length: the product takes whole tiles of 16 rows."""
    converted, reference = pair()
    for tokens in (1, 15, 17):
        x = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
        out = converted(x)
        assert out.shape == (tokens, 96) and relative(out, reference(x)) < FORWARD_TOLERANCE
        out.sum().backward()
        assert x.grad.shape == (tokens, 64)


def matmul_node(out: torch.Tensor):
    """The FP8 product's node in the autograd graph under `out` (a view and the bias's sum above it)."""
    nodes = [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if type(node).__name__ == "_Float8MatmulBackward":
            return node
        nodes += [n for n, _ in node.next_functions if n is not None]
    raise AssertionError("no FP8 product under this output")


def test_backward_holds_the_input_only_for_a_trained_weight_and_no_fp8_copy_of_an_uncached_one():
    """A frozen weight's gradient is not made: its input is not saved. An uncached weight is saved as itself (FSDP
    gathers it again for backward) and cast there, not held in FP8 from forward to backward."""
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    frozen, _ = pair(trains=False)
    saved = matmul_node(frozen(x)).saved_tensors
    assert [t.dtype for t in saved] == [fp8.E4M3, torch.float32]  # the kept cast and its scale
    uncached, _ = pair(trains=False, keep=False)  # as under FSDP, which gathers it anew
    saved = matmul_node(uncached(x)).saved_tensors
    assert [t.dtype for t in saved] == [torch.bfloat16] and saved[0].data_ptr() == uncached.weight.data_ptr()
    trained, _ = pair(trains=True)
    saved = matmul_node(trained(x)).saved_tensors
    assert [t.dtype for t in saved] == [fp8.E4M3, torch.float32, torch.bfloat16]  # the input in FP8, the weight
    assert saved[2] is trained.weight or saved[2].data_ptr() == trained.weight.data_ptr()


def test_a_frozen_weight_is_cast_once_and_kept_as_that_cast_alone_and_a_trained_one_at_each_product(monkeypatch):
    casts = []
    original = fp8.to_fp8
    monkeypatch.setattr(fp8, "to_fp8", lambda t, dtype: casts.append(tuple(t.shape)) or original(t, dtype))
    frozen, reference = pair(trains=False, keep=False)
    bf16_weight = frozen.weight
    assert keep_frozen_casts([frozen], CPU) == 1 and casts == [(96, 64)]
    # the bf16 weight is gone (a meta parameter of its shape and dtype stands in): a byte a weight where bf16 took
    # two, and no value of it left to read
    assert bf16_weight.untyped_storage().size() == 0
    assert frozen.weight.is_meta and (frozen.weight.shape, frozen.weight.dtype) == ((96, 64), torch.bfloat16)
    assert frozen.weight_fp8.dtype == fp8.E4M3 and frozen.weight_fp8.untyped_storage().size() == 96 * 64
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        frozen(x).sum().backward()
    assert casts.count((96, 64)) == 1 and casts.count((16, 64)) == 3  # the weight once, each input each time
    assert relative(frozen(x), reference(x)) < FORWARD_TOLERANCE
    casts.clear()
    trained, _ = pair(trains=True)
    assert not casts and trained.weight_fp8 is None  # a trained weight is never kept
    for _ in range(2):
        trained(x).sum().backward()
    assert casts.count((96, 64)) == 4  # in each forward and again in each backward


@pytest.mark.slow  # compiles a block twice on the CPU
@pytest.mark.parametrize("trains", [False, True], ids=["frozen-base", "trained"])
def test_a_compiled_block_traces_its_fp8_products_whole_and_computes_what_bf16_does(trains):
    """torch.compile traces a block's FP8 products (kept copies or casts) without a break, so the casts fuse with
    the work around them; the block's output and its input's gradient are bf16's to FP8's rounding."""
    import torch._dynamo

    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    block = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    reference = copy.deepcopy(block)
    convert_blocks_to_fp8([block])
    for module in (block, reference):
        module.requires_grad_(trains)
    assert keep_frozen_casts([block], CPU) == (0 if trains else 7)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(2, 32, config.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(32)[None]

    def run(layer, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x.clone().requires_grad_(True)
        forward = torch.compile(layer.forward, fullgraph=True) if compiled else layer.forward
        out = forward(hidden, position_embeddings=rotary(hidden, positions), position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        return out, hidden.grad

    torch._dynamo.reset()
    try:
        out, grad = run(block, compiled=True)  # fullgraph: any graph break is an error
    finally:
        torch._dynamo.reset()
    want, want_grad = run(reference, compiled=False)
    assert relative(out, want) < FORWARD_TOLERANCE and relative(grad, want_grad) < GRADIENT_TOLERANCE
    # and the products did run in FP8: their rounding shows (1% here; compiling the bf16 block alone moves 0.3%)
    assert relative(out, want) > BF16_COMPILE_DRIFT


def test_the_tiny_llama_computes_in_fp8_and_peft_adapts_the_converted_layers(tiny_models, tmp_path):
    """The tiny Llama's shape with weights drawn as a real model's are (std 0.02): the kit's own, 15 times wider,
    amplify each product's rounding through attention (30% on its logits, against 4% here)."""
    config = AutoConfig.from_pretrained(tiny_models["llama"])
    config.initializer_range = 0.02
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model = copy.deepcopy(reference)
    cfg = make_config(tiny_models["llama"], tmp_path, strategy={"use_gpu": True, "precision": "fp8"})
    use_fp8(cfg, model, torch.device("cpu"))
    converted = [m for b in transformer_blocks(model) for m in b.modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 7 * model.config.num_hidden_layers
    assert not isinstance(model.lm_head, Float8Linear)  # the head stays bf16
    ids = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        assert relative(model(ids).logits, reference(ids).logits) < FORWARD_TOLERANCE
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    bases = [m.base_layer for m in adapted.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert bases and all(isinstance(b, Float8Linear) for b in bases if b.in_features % 16 == 0)
    adapted(ids).logits.float().sum().backward()  # gradients reach the adapters through the FP8 products
    assert all(p.grad is not None for n, p in adapted.named_parameters() if "lora_" in n)


def _placed_and_kept(rank: int, store: str, model_dir: str, out: str) -> None:
    """One gloo rank: for each layout, the tiny Llama loaded with FP8 blocks and LoRA, placed as the runtime
    places it, its frozen casts kept; which were kept, the weights' kind, and a step's numbers."""
    from torch.distributed.tensor import DTensor

    from tunewright_jobs.checkpoint import read_checkpoint, write_checkpoint
    from tunewright_jobs.export import export_final
    from tunewright_jobs.model import load_model, load_tokenizer
    from tunewright_jobs.parallel import Dist, wrap_model

    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    seen = {}
    try:
        for name, (strategy, dtype) in KEEP_CASES.items():
            cfg = make_config(Path(model_dir), Path(out) / name, model={"dtype": dtype},
                              strategy={"use_gpu": True, "precision": "fp8", **strategy})
            torch.manual_seed(0)
            model = load_model(cfg)
            blocks = transformer_blocks(model)
            dist = Dist(0, 1, 0, CPU)
            model, masters = wrap_model(cfg, model, dist)
            kept = keep_frozen_casts(blocks, CPU)
            q = blocks[0].self_attn.q_proj.base_layer
            ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
            # at the start only the B matrices' gradients are nonzero (A's are multiplied by B = 0)
            learning = sum(1 for p in masters.trainable if p.grad is not None and p.grad.abs().sum() > 0)
            seen[name] = {"kept": kept, "dtensor": isinstance(q.weight, DTensor), "learning": learning}
            # what a run does with the model after that reads no frozen base weight: the reference forward (the
            # adapters off), a checkpoint written and read, the adapter exported
            with torch.no_grad(), model.disable_adapter():
                model(input_ids=ids)
            optimizer = torch.optim.AdamW(masters.trainable)
            optimizer.step()
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            Path(out, name, "ckpt").mkdir(parents=True)
            with masters.masters_installed():  # as the trainer saves, resumes and exports
                write_checkpoint(Path(out, name, "ckpt"), model, optimizer, scheduler, {"step": 1}, dist)
                read_checkpoint(Path(out, name, "ckpt"), model, optimizer, scheduler, dist)
                export_final(cfg, model, load_tokenizer(cfg), dist)
            seen[name]["exported"] = (Path(cfg.output_dir) / "final" / "adapter" / "adapter_model.safetensors").is_file()
        Path(out, "seen.json").write_text(json.dumps(seen))
    finally:
        torch_dist.destroy_process_group()


# layout -> (strategy, model.dtype): what the runtime's placement leaves a plain tensor on the device is kept
KEEP_CASES = {
    "single": ({"type": "single"}, "bfloat16"),
    "ddp": ({"type": "ddp"}, "bfloat16"),
    "fsdp-of-one": ({"type": "fsdp"}, "bfloat16"),  # one rank: a bf16 base stays outside FSDP, as in ddp
    # FSDP keeps it (and casts it): a DTensor, cast at each product, as an offloaded base is (offloading pins
    # host memory, which needs a GPU: not run here)
    "ddp-fp32-base": ({"type": "ddp"}, "float32"),
}
KEPT = {"single": True, "ddp": True, "fsdp-of-one": True, "ddp-fp32-base": False}


@pytest.mark.slow  # a process of its own, four models placed
def test_the_frozen_base_is_kept_as_casts_where_placement_leaves_it_a_plain_tensor(tiny_models, tmp_path):
    fd, store = tempfile.mkstemp(prefix="tunewright-test-pg-")
    os.close(fd)
    mp.spawn(_placed_and_kept, args=(store, str(tiny_models["llama"]), str(tmp_path)), nprocs=1)
    seen = json.loads((tmp_path / "seen.json").read_text())
    layers = AutoConfig.from_pretrained(tiny_models["llama"]).num_hidden_layers
    for name in KEEP_CASES:
        assert seen[name] == {"kept": 7 * layers if KEPT[name] else 0, "dtensor": not KEPT[name],
                              "learning": 7 * layers, "exported": True}, name


def test_a_weight_sharing_its_storage_is_kept_without_freeing_the_others():
    """A checkpoint's fused weight split into views (transformers' conversions) shares one storage: the kept one
    goes meta, the storage stays for the rest."""
    fused = torch.randn(192, 64, dtype=torch.bfloat16)
    first, second = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 96, bias=False)
    first.weight = torch.nn.Parameter(fused[:96], requires_grad=False)
    second.weight = torch.nn.Parameter(fused[96:], requires_grad=False)
    convert_blocks_to_fp8([first])
    assert keep_frozen_casts([first], CPU) == 1 and first.weight.is_meta
    torch.testing.assert_close(second.weight, fused[96:])


def test_a_weight_on_another_device_than_the_runs_is_not_kept():
    converted, _ = pair(trains=False, keep=False)
    assert keep_frozen_casts([converted], torch.device("cuda", 0)) == 0
    assert converted.weight_fp8 is None and not converted.weight.is_meta


@pytest.mark.parametrize(("overrides", "message"), [
    ({"strategy": {"precision": "fp8"}}, "precision: fp8 runs on FP8 tensor cores, which the CPU has not"),
    ({"strategy": {"precision": "fp8", "use_gpu": True}, "method": {"lora": {"quantization": "nf4"}}},
     "strategy.precision: fp8 products need bf16 weights to cast, not a 4-bit base"),
])
def test_fp8_refuses_where_it_cannot_run(tiny_models, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(tiny_models["llama"], tmp_path, **overrides)
