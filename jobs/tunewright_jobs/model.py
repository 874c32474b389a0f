"""Model and tokenizer loading (path or Hugging Face id), LoRA through PEFT (on a 4-bit base: QLoRA), full
fine-tuning."""

from __future__ import annotations

import logging
import math

import torch

from tunewright_jobs.config import JobConfig
from tunewright_jobs.parallel import compute_dtype

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
    """Frozen (LoRA base) weights: bf16 on GPU. Trained weights stay fp32 (mixed precision master copy), unless
    the optimizer holds them in bf16 (`optimizer_state: bf16`)."""
    if cfg.method.type == "full":
        return torch.bfloat16 if cfg.hyperparameters.optimizer_state == "bf16" else torch.float32
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if cfg.strategy.use_gpu else torch.float32
    return getattr(torch, cfg.model.dtype)


def loaded_attention(cfg: JobConfig) -> str:
    """What the model is loaded with: ours (varlen) is switched on after loading, once it is registered."""
    return "sdpa" if cfg.model.attn_implementation in ("auto", "varlen") else cfg.model.attn_implementation


CPU = torch.device("cpu")


def load_model(cfg: JobConfig, device: torch.device = CPU):
    """The causal LM, LoRA-wrapped when asked, on the CPU (sharding moves each rank's part to its device); a
    4-bit base is quantized as it loads, on `device`, so that no bf16 copy of it is ever whole."""
    from transformers import AutoModelForCausalLM

    source, revision = cfg.weights_source
    config = source_config(cfg, source, revision)
    placement = {}
    if cfg.method.lora.quantization == "nf4":
        placement = {"quantization_config": nf4_config(compute_dtype(cfg, device)), "device_map": {"": device}}
    model = AutoModelForCausalLM.from_pretrained(
        source, config=config, dtype=weights_dtype(cfg), revision=revision,
        trust_remote_code=cfg.model.trust_remote_code, attn_implementation=loaded_attention(cfg), **placement,
    )
    model.config.use_cache = False
    if placement and device.type == "cpu":
        keep_codes_as_trained(model)
    if cfg.strategy.precision == "fp8":
        use_fp8(cfg, model, device)
    if cfg.strategy.activation_checkpointing:
        checkpoint_blocks(model, every=cfg.strategy.activation_checkpointing_every)
    if cfg.method.type == "lora":
        model = apply_lora(cfg, model)
    return model


def source_config(cfg: JobConfig, source: str, revision: str | None):
    """The model's config (read once: the model loads with it), refused where it was saved in 4 bits (a
    `*-bnb-4bit` model loads in 4 bits whatever is asked) and the job did not ask for a 4-bit base: its plan
    (memory, strategy, export) would not be the run's."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=cfg.model.trust_remote_code)
    quantized = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantized, dict):
        quantized = quantized.to_dict()
    if quantized.get("load_in_4bit") and cfg.method.lora.quantization != "nf4":
        raise ValueError(f"model.source: {source} is saved in 4 bits (bitsandbytes): train it as a 4-bit base with "
                         "method.type lora and method.lora.quantization nf4, or start from its bf16 checkpoint")
    return config


def nf4_config(compute: torch.dtype):
    """QLoRA's base as the paper has it: NF4 codes in blocks of 64, their scales double-quantized, products in
    the compute dtype. The output head stays in the weights dtype (transformers leaves it out)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError("method.lora.quantization: nf4 needs bitsandbytes in the training image "
                         "(pip install 'tunewright[jobs]'), or quantization: none") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


# FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
FP8_CAPABILITY = (8, 9)


def use_fp8(cfg: JobConfig, model, device: torch.device) -> None:
    """The decoder blocks' linear layers computed in FP8 (fp8.py), on a GPU that has FP8 tensor cores."""
    from tunewright_jobs.fp8 import convert_blocks_to_fp8

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"strategy.precision: fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                         f"Hopper, Blackwell); this {torch.cuda.get_device_name(device)} is {major}.{minor}: set "
                         "resources.precision bf16 in the spec (strategy.precision auto in a job config), or run on "
                         "H100, H200, L40S or L4 GPUs")
    converted = convert_blocks_to_fp8(transformer_blocks(model))
    if not converted:
        raise ValueError(f"strategy.precision: fp8 replaces nn.Linear layers whose sizes are multiples of 16, and "
                         f"{type(model).__name__}'s blocks have none (GPT-2's are Conv1D): set resources.precision "
                         "bf16 in the spec (strategy.precision auto in a job config)")
    log.info("fp8: %d linear layers of the decoder blocks compute in FP8", converted)


def keep_codes_as_trained(model) -> None:
    """On a CPU with AVX-512 BF16, bitsandbytes repacks a 4-bit weight in place the first time it runs in eval
    mode without gradients (a faster inference layout, and only for widths divisible by 32): training moves
    between evaluation and steps, so the codes stay in the one layout every pass reads."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


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
    """Parameters (a 4-bit weight counted by its shape, not its packed bytes) and the trainable ones."""
    total = sum(math.prod(p.quant_state.shape) if getattr(p, "quant_state", None) is not None else p.numel()
                for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
