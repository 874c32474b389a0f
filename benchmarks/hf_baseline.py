"""The baselines users run today: Hugging Face `Trainer` + PEFT, plain or with `use_liger_kernel=True`, and
Unsloth (its `FastLanguageModel` loading and LoRA; `unsloth` with its defaults, its own offloaded gradient
checkpointing, `unsloth-no-ckpt` with `use_gradient_checkpointing=False`, every activation kept: its fastest; the
same `Trainer`, which Unsloth patches). Unsloth needs a CUDA GPU and is imported before transformers, as it asks.

One case per process (`vs_hf.py` runs it): the same model folder, the same examples tokenized by the same
code as tunewright's (so both train on the very same tokens and loss masks), HF's own batching (each batch
padded to its longest example: HF pads, tunewright packs), bf16, SDPA, fused AdamW, constant learning rate.
Prints one JSON object: trained (non-padding) tokens/s over the steps after the warm-up, step times,
peak memory and the loss of every step.

  python benchmarks/hf_baseline.py CASE.json     (written by vs_hf.py)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))


# Unsloth's LoRA targets for a Llama: every linear layer of a block, as `all-linear` is for the others
UNSLOTH_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


UNSLOTH_SYSTEMS = ("unsloth", "unsloth-no-ckpt")


def unsloth_model(case: dict, lora: bool):
    """The model as an Unsloth user loads it: bf16, no 4-bit, Unsloth's LoRA (rank 16, alpha 32, no dropout) with
    its default gradient checkpointing (`unsloth`) or none (`unsloth-no-ckpt`), or its full fine-tuning."""
    import torch
    from unsloth import FastLanguageModel

    checkpointing = "unsloth" if case["system"] == "unsloth" else False

    model, _ = FastLanguageModel.from_pretrained(case["model_dir"], max_seq_length=case["seq_len"],
                                                 dtype=torch.bfloat16, load_in_4bit=False, full_finetuning=not lora,
                                                 use_gradient_checkpointing=checkpointing)
    if lora:
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 target_modules=UNSLOTH_TARGETS, random_state=case["seed"],
                                                 use_gradient_checkpointing=checkpointing)
    return model


def main() -> int:
    case = json.loads(Path(sys.argv[1]).read_text())
    if case["system"] in UNSLOTH_SYSTEMS:
        import unsloth  # noqa: F401  (first: it patches transformers and peft as they load)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from tunewright_jobs.data import read_jsonl, tokenize_dataset

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = tokenize_dataset(tokenizer, read_jsonl(case["data"], case["format"]), case["format"], case["seq_len"],
                            case["data"])
    # HF shifts labels itself: a token is a target where tunewright would train on it
    examples = [{"input_ids": ex.input_ids, "labels": [t if keep else -100 for t, keep in zip(ex.input_ids,
                                                                                              ex.trainable,
                                                                                              strict=True)]}
                for ex in data.examples]

    trained_tokens: list[int] = []  # per collated batch, in the order the Trainer takes them
    padded_tokens: list[int] = []

    def collate(batch: list[dict]) -> dict:
        longest = max(len(b["input_ids"]) for b in batch)
        pad = lambda seq, fill: seq + [fill] * (longest - len(seq))  # noqa: E731
        trained_tokens.append(sum(len(b["input_ids"]) for b in batch))
        padded_tokens.append(longest * len(batch))
        return {"input_ids": torch.tensor([pad(b["input_ids"], tokenizer.pad_token_id) for b in batch]),
                "labels": torch.tensor([pad(b["labels"], -100) for b in batch]),
                "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (longest - len(b["input_ids"]))
                                                for b in batch])}

    lora = case["method"] == "lora"
    dtype = torch.bfloat16 if lora and cuda else torch.float32  # full: fp32 master weights under bf16 autocast
    if case["system"] in UNSLOTH_SYSTEMS:
        model = unsloth_model(case, lora)
    else:
        model = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if lora and case["system"] not in UNSLOTH_SYSTEMS:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))

    step_seconds: list[float] = []
    losses: list[float] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(
        output_dir=case["work_dir"], per_device_train_batch_size=case["micro_batch"], gradient_accumulation_steps=1,
        max_steps=case["steps"], learning_rate=case["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, bf16=cuda, use_cpu=not cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, remove_unused_columns=False, seed=case["seed"], disable_tqdm=True,
        use_liger_kernel=case["system"] == "hf+liger")
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collate, callbacks=[Timing()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()

    warm = case["warmup_steps"]
    measured = step_seconds[warm:]
    # the Trainer's loader may collate one batch ahead: over many steps the mean is what counts
    tokens = trained_tokens[warm:warm + len(measured)]
    print(json.dumps({
        "tokens_per_second": sum(tokens) / sum(measured),
        "step_seconds_median": statistics.median(measured),
        "trained_tokens_per_step": statistics.mean(tokens),
        "padding_share": 1 - sum(trained_tokens) / sum(padded_tokens),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "losses": losses, "steps_measured": len(measured),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
