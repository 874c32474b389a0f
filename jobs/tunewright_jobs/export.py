"""Final export in Hugging Face format: the LoRA adapter (and merged weights on request), or the full model.

Parameters are gathered to rank 0 on the CPU; the export is written to a temporary folder and renamed
into place, so `<output_dir>/final` is either complete or absent.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tunewright_jobs.config import JobConfig
from tunewright_jobs.parallel import Dist
from tunewright_jobs.telemetry import ExportPaths


def export_final(cfg: JobConfig, model, tokenizer, dist: Dist) -> ExportPaths:
    """Collective: every rank calls it. Returns the exported paths (on rank 0; none on the others)."""
    lora = cfg.method.type == "lora"
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    )
    if not dist.is_main:
        return ExportPaths()
    final = Path(cfg.output_dir) / "final"
    staging = final.with_name("final.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    exported = []  # folder names, as ExportPaths names them
    if lora:
        model.save_pretrained(staging / "adapter", state_dict=state)
        tokenizer.save_pretrained(staging / "adapter")
        exported.append("adapter")
        if cfg.checkpoint.export_merged:
            merge_adapter(cfg, staging / "adapter", staging / "merged")
            tokenizer.save_pretrained(staging / "merged")
            exported.append("merged")
    else:
        model.save_pretrained(staging / "model", state_dict=state)
        tokenizer.save_pretrained(staging / "model")
        exported.append("model")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return ExportPaths(**{name: str(final / name) for name in exported})


def merge_adapter(cfg: JobConfig, adapter_dir: Path, out_dir: Path) -> None:
    """Base weights (re-read from the source, on the CPU) with the adapter folded in."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(cfg.model.resolved_source, revision=cfg.model.revision,
                                                trust_remote_code=cfg.model.trust_remote_code, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
