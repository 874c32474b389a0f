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
    if not dist.is_main:  # (the whole state is gathered on rank 0 only)
        return ExportPaths()
    if lora and not any("lora_" in name for name in state):  # PEFT would write an empty adapter file
        raise RuntimeError("export: the adapter weights are not among the trainable parameters (requires_grad is "
                           "off on them), so the adapter would be exported empty; nothing was written")
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
            try:
                if cfg.method.lora.quantization == "nf4":
                    merge_dequantized(cfg, model, state, staging / "merged")
                else:
                    merge_adapter(cfg, staging / "adapter", staging / "merged")
            except Exception:  # the adapter is whole: publish it, then say what failed
                shutil.rmtree(staging / "merged", ignore_errors=True)
                publish(staging, final)
                log.error("the merged export failed; the adapter is exported in %s", final / "adapter")
                raise
            save_generation_files(staging / "merged", tokenizer, generation)
            exported.append("merged")
    else:
        model.save_pretrained(staging / "model", state_dict=state)
        save_generation_files(staging / "model", tokenizer, generation)
        exported.append("model")
    publish(staging, final)
    return ExportPaths(**{name: str(final / name) for name in exported})


def publish(staging: Path, final: Path) -> None:
    """The staged export in place of any earlier one."""
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)


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
    base computed in (bf16 on a GPU, fp32 on a CPU run). Host memory: the whole model in that dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    from tunewright_jobs.model import weights_dtype

    unmergeable = sorted({k.split(".lora_")[1].split(".")[0] for k in adapter if ".lora_" in k} - {"A", "B"})
    if unmergeable:
        raise ValueError(f"checkpoint.export_merged: the adapter holds lora_{', lora_'.join(unmergeable)} weights "
                         "(an adapted embedding), which a 4-bit base's merge does not fold in: adapt linear layers "
                         "only (method.lora.target_modules), or export the adapter alone")
    dtype = weights_dtype(cfg)
    base = model.get_base_model()
    weights, four_bit = dequantized_weights(base, dtype)
    scale = cfg.method.lora.alpha / cfg.method.lora.r
    for name, a in adapter.items():  # ...q_proj.lora_A.default.weight, beside its lora_B
        if ".lora_A." not in name:
            continue
        module, adapter_name = name.removeprefix("base_model.model.").split(".lora_A.")
        b = adapter[f"base_model.model.{module}.lora_B.{adapter_name}"]
        key = f"{module}.weight"  # a 4-bit weight is (out, in), as B·A is
        weights[key] = (weights[key].float() + (b.float() @ a.float()) * scale).to(dtype)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        merged = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                  trust_remote_code=cfg.model.trust_remote_code)
    for key in four_bit:  # GPT-2's Conv1D holds (in, out): its weight was transposed to be quantized
        if isinstance(merged.get_submodule(key.rsplit(".", 1)[0]), Conv1D):
            weights[key] = weights[key].t().contiguous()
    unexpected = merged.load_state_dict(weights, assign=True, strict=False).unexpected_keys
    merged.tie_weights()  # a tied head is no weight of its own: it becomes the embeddings' here
    missing = [name for name, p in merged.named_parameters() if p.is_meta]
    if missing or unexpected:
        raise RuntimeError(f"merged export: the dequantized base does not match its architecture (missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}); the adapter is exported: load it with "
                           "PEFT onto the base loaded in 4 bits")
    merged.save_pretrained(out_dir)


def dequantized_weights(base, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The base model's weights by their own names (PEFT's `base_layer` and adapters left out), 4-bit ones
    dequantized, on the CPU in `dtype`; and the names of the 4-bit ones."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    weights, four_bit = {}, set()
    for module_name, module in base.named_modules():
        parts = module_name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        prefix = ".".join(part for part in parts if part != "base_layer")
        for name, p in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(p, bnb.nn.Params4bit):
                weights[key] = dequantize_4bit(p.data, p.quant_state).to("cpu", dtype)
                four_bit.add(key)
            else:
                weights[key] = p.detach().to("cpu", dtype)
    return weights, four_bit
