"""Model and tokenizer loading (path or Hugging Face id), LoRA through PEFT, full fine-tuning."""

from __future__ import annotations

import logging

import torch

from tunewright_jobs.config import JobConfig

log = logging.getLogger(__name__)


def load_tokenizer(cfg: JobConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.resolved_source, revision=cfg.model.revision,
                                        trust_remote_code=cfg.model.trust_remote_code)
    if not tok.is_fast:
        raise ValueError(f"model.source: {cfg.model.source} has no fast tokenizer (needed for loss masks)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def weights_dtype(cfg: JobConfig) -> torch.dtype:
    """Frozen (LoRA base) weights: bf16 on GPU. Trained weights stay fp32 (mixed precision master copy)."""
    if cfg.method.type == "full":
        return torch.float32
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if cfg.strategy.use_gpu else torch.float32
    return getattr(torch, cfg.model.dtype)


def loaded_attention(cfg: JobConfig) -> str:
    """What the model is loaded with: ours (varlen) is switched on after loading, once it is registered."""
    return "sdpa" if cfg.model.attn_implementation in ("auto", "varlen") else cfg.model.attn_implementation


def load_model(cfg: JobConfig):
    """The causal LM, LoRA-wrapped when asked, on the CPU (sharding moves each rank's part to its device)."""
    from transformers import AutoModelForCausalLM

    source, revision = cfg.weights_source
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=weights_dtype(cfg), revision=revision,
        trust_remote_code=cfg.model.trust_remote_code, attn_implementation=loaded_attention(cfg),
    )
    model.config.use_cache = False
    if cfg.strategy.activation_checkpointing:
        checkpoint_blocks(model, every=cfg.strategy.activation_checkpointing_every)
    if cfg.method.type == "lora":
        model = apply_lora(cfg, model)
    return model


def checkpoint_blocks(model, every: int) -> None:
    """Activation checkpointing on one transformer block in every `every` (torchtitan's selective layer
    checkpointing): the 1st, (every + 1)-th, ... as transformers' `every_n_layers` picks them. The others
    keep their activations for backward instead of recomputing their forward. Counted from the first block,
    not from the `every`-th as torchtitan does: the last block's backward comes first, so recomputing it
    brings its activations back at the peak, and checkpointing it saves nearly nothing there. transformers
    checkpoints each block that carries its own flag (`GradientCheckpointingLayer`), inside the block's
    forward: FSDP2's hooks stay outside."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if every == 1:
        return
    for index, block in enumerate(transformer_blocks(model)):
        if not hasattr(block, "gradient_checkpointing"):
            raise ValueError(
                f"strategy.activation_checkpointing_every: {type(model).__name__} checkpoints all its blocks or "
                f"none ({type(block).__name__} has no gradient_checkpointing flag of its own): set it to 1")
        block.gradient_checkpointing = index % every == 0


def apply_lora(cfg: JobConfig, model):
    from peft import LoraConfig, get_peft_model

    lora = cfg.method.lora
    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             task_type="CAUSAL_LM", bias="none")
    try:
        model = get_peft_model(model, peft_config)
    except ValueError as err:  # PEFT names the modules it could not find
        raise ValueError(f"method.lora.target_modules: {err}") from None
    # Adapters train in fp32 whatever the base dtype: tiny, and bf16 updates would round away.
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def transformer_blocks(model) -> list[torch.nn.Module]:
    """The repeated decoder layers (FSDP's sharding unit), found without knowing the architecture."""
    no_split = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in no_split]
    if not blocks:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__} (no _no_split_modules)")
    return blocks


def parameter_counts(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
