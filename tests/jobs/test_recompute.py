"""kernels.recompute: the compiled decoder blocks keep about a third fewer activations (the compiler recomputes
their elementwise work in backward) and compute the same gradients. Measured here with the CPU's compiler on a
LoRA Llama block, by what autograd keeps for backward."""

import pytest
import torch
import torch._dynamo
import torch._functorch.config
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from tunewright_core.planner.estimate import RECOMPUTE_ACTIVATION_SHARE
from tunewright_jobs.kernels import compile_blocks

TOKENS = 128


def lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
                         attn_implementation="sdpa")
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.to(torch.bfloat16)


def kept_and_gradients(recompute: bool) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd keeps through the first block (its weights aside), and the adapters' gradients."""
    torch._dynamo.reset()  # each variant compiled afresh, under its own budget
    model = lora_llama()
    base = model.get_base_model().model
    block = base.layers[0]
    compile_blocks([block], recompute=recompute)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    hidden = base.embed_tokens(ids).detach().requires_grad_(True)
    positions = torch.arange(TOKENS)[None]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = block(hidden, position_embeddings=base.rotary_emb(hidden, positions), position_ids=positions)
    (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    return sum(kept.values()), [p.grad.float() for p in block.parameters() if p.requires_grad]


@pytest.mark.slow  # compiles a block twice on the CPU
def test_recompute_keeps_a_third_fewer_activations_for_the_same_gradients(monkeypatch):
    monkeypatch.setattr(torch._functorch.config, "activation_memory_budget",
                        torch._functorch.config.activation_memory_budget)  # restored after: it is process-wide
    default_kept, default_grads = kept_and_gradients(recompute=False)
    lean_kept, lean_grads = kept_and_gradients(recompute=True)
    assert lean_kept <= 0.75 * default_kept, (lean_kept, default_kept)
    # the planner's share, fitted on one H200 run's peak, against this count by the CPU's compiler (0.68): an
    # independent check of the constant the planner's memory model uses
    assert lean_kept / default_kept == pytest.approx(RECOMPUTE_ACTIVATION_SHARE, abs=0.05)
    assert len(lean_grads) == len(default_grads) == 14  # seven adapted linears, A and B each
    for lean, default in zip(lean_grads, default_grads, strict=True):
        torch.testing.assert_close(lean, default, rtol=2e-2, atol=1e-4)
    torch._dynamo.reset()
