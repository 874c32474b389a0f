"""Tiny-model kit: small models, a tokenizer and a task made here, with no download.

The models are randomly initialised GPT-2- and Llama-class causal LMs in Hugging Face format, so the
runtime loads them through exactly the code path a hub model takes. The task (reviews → sentiment
label, in OpenAI chat format) is generated from a fixed seed and shipped under `tiny/data/`; a random
model scores 0% exact match on it, and a short LoRA run lifts that far up.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SYSTEM_PROMPT = "Classify the sentiment of the review as positive or negative."

_POSITIVE = ["great", "lovely", "excellent", "superb", "delightful", "wonderful", "tasty", "friendly",
             "charming", "brilliant", "fresh", "perfect"]
_NEGATIVE = ["awful", "terrible", "bland", "rude", "dirty", "horrible", "stale", "slow", "noisy",
             "disappointing", "cold", "greasy"]
_SUBJECTS = ["the food", "the staff", "the room", "the service", "the coffee", "the view", "the music",
             "the bread", "the soup", "the bed", "the waiter", "the menu", "the price", "the garden"]
_LINKS = ["was", "seemed", "felt", "looked", "tasted", "proved"]
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _clause(rng: random.Random, words: list[str]) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_LINKS)} {rng.choice(words)}"


def make_review(rng: random.Random) -> tuple[str, str]:
    label = rng.choice(["positive", "negative"])
    words = _POSITIVE if label == "positive" else _NEGATIVE
    clauses = [_clause(rng, words) for _ in range(rng.randint(1, 3))]
    return " and ".join(clauses).capitalize() + ".", label


def chat_record(review: str, label: str) -> dict:
    return {"messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": review},
        {"role": "assistant", "content": label},
    ]}


def make_dataset(n_train: int = 800, n_validation: int = 100, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < n_train + n_validation:
        review, label = make_review(rng)
        if review not in seen:  # validation reviews never appear in training
            seen.add(review)
            records.append(chat_record(review, label))
    return records[:n_train], records[n_train:]


def _corpus() -> list[str]:
    train, validation = make_dataset()
    texts = [m["content"] for r in train + validation for m in r["messages"]]
    return texts + ["user", "assistant", "system", "\n"]


def build_tokenizer(out_dir: Path, chat_template: str | None):
    """A byte-level BPE tokenizer trained on the task's text (any string still encodes: no UNK)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


def build_model(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a tiny random-init model of `kind` ('gpt2' or 'llama') with its tokenizer to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from tunewright_jobs.data import FALLBACK_CHAT_TEMPLATE

    out_dir = Path(out_dir)
    # The GPT-2 tokenizer has no template (exercises the fallback); the Llama one carries its own.
    tokenizer = build_tokenizer(out_dir, chat_template=None if kind == "gpt2" else FALLBACK_CHAT_TEMPLATE)
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.3,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)  # no dropout, as in modern LMs
    elif kind == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
                             **common)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: use 'gpt2' or 'llama'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    return out_dir
