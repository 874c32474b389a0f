"""Final export in Hugging Face format: the LoRA adapter (and merged weights on request), or the full model.

Parameters are gathered to rank 0 on the CPU (a 4-bit base is whole on every rank: rank 0 dequantizes its own); the export is written to a temporary folder and renamed
into place, so `<output_dir>/final` is either complete or absent.

Every exported folder carries the tokenizer and a generation_config.json that stops at the end of an
assistant turn as well as at eos. A merged or full model picks the latter up when loaded; PEFT loads an
adapter onto its base model's generation config, so adapter users pass
`generation_config=GenerationConfig.from_pretrained(adapter)` or `eos_token_id=tokenizer.eos_token_id`
(the exported tokenizer's eos is the end-of-turn token).
"""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tunewright_core.records import ExportPaths
from tunewright_jobs.config import JobConfig
from tunewright_jobs.data import closes_turns, end_of_turn_id, stop_token_ids
from tunewright_jobs.parallel import Dist

log = logging.getLogger(__name__)


def export_final(cfg: JobConfig, model, tokenizer, dist: Dist) -> ExportPaths:
    """Collective: every rank calls it. Returns the exported paths (on rank 0; none on the others)."""
    lora = cfg.method.type == "lora"
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    )
    if not dist.is_main:
        return ExportPaths()
    generation = stopping_generation_config(cfg, model, tokenizer)
    tokenizer = tokenizer_for_export(cfg, tokenizer)
    final = Path(cfg.output_dir) / "final"
    staging = final.with_name("final.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    exported = []  # folder names, as ExportPaths names them
    if lora:
        model.save_pretrained(staging / "adapter", state_dict=state)
        save_generation_files(staging / "adapter", tokenizer, generation)
        exported.append("adapter")
        if cfg.checkpoint.export_merged:
            if cfg.method.lora.quantization == "nf4":
                merge_dequantized(cfg, model, state, staging / "merged")
            else:
                merge_adapter(cfg, staging / "adapter", staging / "merged")
            save_generation_files(staging / "merged", tokenizer, generation)
            exported.append("merged")
    else:
        model.save_pretrained(staging / "model", state_dict=state)
        save_generation_files(staging / "model", tokenizer, generation)
        exported.append("model")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return ExportPaths(**{name: str(final / name) for name in exported})


def stopping_generation_config(cfg: JobConfig, model, tokenizer):
    """The model's generation config, with eos_token_id listing the end-of-turn token (chat) and every eos.

    A chat model learns to close its answer with the template's end-of-turn token; stopping only at eos
    would let it run on into turns nobody asked for.
    """
    generation = copy.deepcopy(model.generation_config)
    generation.eos_token_id = stop_token_ids(tokenizer, cfg.dataset.format, generation.eos_token_id)
    # No longer config.json's: transformers 4.x's generate() rebuilds a config so marked from config.json.
    generation._from_model_config = False
    if closes_turns(tokenizer, cfg.dataset.format) and end_of_turn_id(tokenizer) is None:
        log.warning("the chat template closes turns with no special token: generation will stop only at eos")
    return generation


def tokenizer_for_export(cfg: JobConfig, tokenizer):
    """For chat, a copy whose eos is the end-of-turn token (as chat models' tokenizers have it), for code
    that stops at `tokenizer.eos_token_id`; the training tokenizer is left as it is."""
    end_of_turn = end_of_turn_id(tokenizer) if closes_turns(tokenizer, cfg.dataset.format) else None
    if end_of_turn is None or end_of_turn == tokenizer.eos_token_id:
        return tokenizer
    exported = copy.deepcopy(tokenizer)
    exported.eos_token = exported.convert_ids_to_tokens(end_of_turn)
    return exported


def save_generation_files(out_dir: Path, tokenizer, generation) -> None:
    tokenizer.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)  # replaces the base model's, which a merged model brings along


def merge_adapter(cfg: JobConfig, adapter_dir: Path, out_dir: Path) -> None:
    """Base weights (re-read from where training started, on the CPU) with the adapter folded in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source, revision = cfg.weights_source
    base = AutoModelForCausalLM.from_pretrained(source, revision=revision,
                                                trust_remote_code=cfg.model.trust_remote_code, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)


def merge_dequantized(cfg: JobConfig, model, adapter: dict[str, torch.Tensor], out_dir: Path) -> None:
    """QLoRA's merged export: each 4-bit weight dequantized from the very codes training computed on (not re-read
    from the source and quantized again), plus its adapter's B·A·alpha/r added in fp32, saved in the dtype the
    base computed in (bf16 on a GPU, fp32 on a CPU run)."""
    from transformers import AutoModelForCausalLM

    from tunewright_jobs.model import weights_dtype

    dtype = weights_dtype(cfg)
    base = model.get_base_model()
    weights = dequantized_weights(base, dtype)
    scale = cfg.method.lora.alpha / cfg.method.lora.r
    for name, a in adapter.items():  # ...q_proj.lora_A.default.weight, beside its lora_B
        if ".lora_A." not in name:
            continue
        module, adapter_name = name.removeprefix("base_model.model.").split(".lora_A.")
        b = adapter[f"base_model.model.{module}.lora_B.{adapter_name}"]
        key = f"{module}.weight"
        delta = (b.float() @ a.float()) * scale
        if delta.shape != weights[key].shape:  # GPT-2's Conv1D keeps its weight as (in, out)
            delta = delta.T
        weights[key] = (weights[key].float() + delta).to(dtype)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        merged = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                  trust_remote_code=cfg.model.trust_remote_code)
    unexpected = merged.load_state_dict(weights, assign=True, strict=False).unexpected_keys
    merged.tie_weights()  # a tied head is no weight of its own: it becomes the embeddings' here
    missing = [name for name, p in merged.named_parameters() if p.is_meta]
    if missing or unexpected:
        raise RuntimeError(f"merged export: the dequantized base does not match its architecture (missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]})")
    merged.save_pretrained(out_dir)


def dequantized_weights(base, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's weights by their own names (PEFT's `base_layer` and adapters left out), 4-bit ones
    dequantized, on the CPU in `dtype`."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    weights = {}
    for module_name, module in base.named_modules():
        parts = module_name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        prefix = ".".join(part for part in parts if part != "base_layer")
        for name, p in module.named_parameters(recurse=False):
            value = dequantize_4bit(p.data, p.quant_state) if isinstance(p, bnb.nn.Params4bit) else p.detach()
            weights[f"{prefix}.{name}" if prefix else name] = value.to("cpu", dtype)
    return weights
