"""Datasets: chat templates, loss masks, packing, deterministic batches (files are read by `dataset_files`).

A token is *trainable* when the model should learn to predict it: assistant turns (chat), the
completion (prompt_completion), everything (text). Labels are stored already shifted, so that
`logits[:, i]` is scored against `labels[:, i]`; the last token of one packed example never
predicts the first token of the next.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

# Files are read apart, free of numpy, for the API's validator; the names stay importable from here.
from tunewright_jobs.dataset_files import DatasetError, read_jsonl  # noqa: F401

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _chatml_template(end_of_turn: str) -> str:
    """ChatML with `end_of_turn` (a Jinja expression) closing each turn."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + " + end_of_turn + " + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


# Used when a tokenizer has no chat template of its own: ChatML, prefix-stable, ends each turn with a
# marker the model learns to emit (so generation knows where an answer stops).
FALLBACK_CHAT_TEMPLATE = _chatml_template("'<|im_end|>'")
# The same where <|im_end|> is not one token (stock GPT-2 splits it into ordinary tokens, which no
# generation can stop on): eos closes each turn instead. Adding <|im_end|> to the vocabulary would grow
# the embeddings, which a LoRA run would then have to train and ship, and the adapter would no longer
# fit the stock base model.
FALLBACK_CHAT_TEMPLATE_EOS_TURNS = _chatml_template("eos_token")


# --- tokenizing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    trainable: list[bool]  # trainable[i]: token i is a prediction target


def ensure_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    if len(tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1:
        log.warning("tokenizer has no chat template; using tunewright's ChatML fallback")
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    elif tokenizer.eos_token is not None:
        log.warning("tokenizer has no chat template and no <|im_end|> token; using tunewright's ChatML "
                    "fallback with %s closing each turn", tokenizer.eos_token)
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE_EOS_TURNS
    else:
        raise DatasetError("model.source: the tokenizer has no chat template, no <|im_end|> token and no eos "
                           "token, so no token can mark where an answer ends")


def end_of_turn_id(tokenizer) -> int | None:
    """The token that closes an assistant turn in the chat template: the first special token after the answer.

    None where the template closes turns with ordinary text only.
    """
    answer = "tunewright-answer"
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer}]
    rendered = _render(tokenizer, messages, add_generation_prompt=False)
    end = rendered.rfind(answer)
    if end < 0:
        return None
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    tail = tokenizer(rendered[end + len(answer):], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if i in special), None)


def closes_turns(tokenizer, fmt: str) -> bool:
    """Whether answers were trained to end with the chat template's end of turn: chat always; preference pairs
    where the tokenizer has a template (it is given one for pairs of messages)."""
    return fmt == "chat" or (fmt == "preference" and bool(getattr(tokenizer, "chat_template", None)))


def stop_token_ids(tokenizer, fmt: str, model_eos: int | list[int] | None = None) -> list[int]:
    """The tokens generation ends at: the end of an assistant turn (chat), then eos, the tokenizer's and
    the model's (`model_eos`, from its generation config)."""
    ids = [end_of_turn_id(tokenizer)] if closes_turns(tokenizer, fmt) else []
    ids += [tokenizer.eos_token_id, *(model_eos if isinstance(model_eos, list) else [model_eos])]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(rendered prompt up to the last assistant turn, that turn's content): for generation checks."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return _render(tokenizer, messages[:last], add_generation_prompt=True), messages[last]["content"]


def _tokenize_chat(tokenizer, messages: list[dict]) -> Example:
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        end_text = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(start_text) and full.startswith(end_text)):
            raise DatasetError(
                "the tokenizer's chat template is not prefix-stable (rendering the first turns does not give a "
                "prefix of the whole conversation), so assistant tokens cannot be located"
            )
        spans.append((len(start_text), len(end_text)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    trainable = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    return Example(list(enc["input_ids"]), trainable)


def tokenize_record(tokenizer, record: dict, fmt: str) -> Example:
    if fmt == "chat":
        return _tokenize_chat(tokenizer, record["messages"])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "prompt_completion":
        prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos
        return Example(prompt + completion, [False] * len(prompt) + [True] * len(completion))
    ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"] + eos
    return Example(ids, [True] * len(ids))


@dataclass(frozen=True)
class TokenizedDataset:
    examples: list[Example]
    truncated: int
    dropped: int


def tokenize_dataset(tokenizer, records: list[dict], fmt: str, seq_len: int, source: str) -> TokenizedDataset:
    if fmt == "chat":
        ensure_chat_template(tokenizer)
    examples, truncated, dropped = [], 0, 0
    for record in records:
        ex = tokenize_record(tokenizer, record, fmt)
        if len(ex.input_ids) > seq_len:
            truncated += 1
            ex = Example(ex.input_ids[:seq_len], ex.trainable[:seq_len])
        # Token 0 is never a target (nothing precedes it), so an example needs a trainable token after it.
        if not any(ex.trainable[1:]):
            dropped += 1
            continue
        examples.append(ex)
    if not examples:
        raise DatasetError(f"{source}: no example has a trainable token within seq_len={seq_len}")
    if truncated or dropped:
        log.warning("%s: %d examples truncated to %d tokens, %d dropped (nothing left to learn)",
                    source, truncated, seq_len, dropped)
    return TokenizedDataset(examples, truncated, dropped)


# --- packing and batches -----------------------------------------------------------------------------


def pack_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Assign items to bins of `capacity` tokens: longest first, each into the fullest bin it fits, O(n log n).
    Items of one length keep the given order, so a shuffled order varies the groups only among equal lengths:
    epochs hold nearly the same groups, in a shuffled order of rows. Longest first leaves the short items to
    fill the gaps: on vs_hf's chat data 0.4% of the packed rows' tokens were padding, 3.3% placing the
    items in a random order (benchmarks/results/vs_hf_h200.json)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining room, bin index)
    for idx in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[idx]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(idx)
        else:
            room, b = capacity, len(bins)
            bins.append([idx])
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


@dataclass(frozen=True)
class Rows:
    """Fixed-shape training rows: [n, seq_len] arrays."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    real_tokens: np.ndarray  # [n] non-padding tokens per row

    def __len__(self) -> int:
        return len(self.input_ids)


def build_rows(examples: list[Example], groups: list[list[int]], seq_len: int, pad_id: int) -> Rows:
    n = len(groups)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((n, seq_len), dtype=np.int64)
    real = np.zeros(n, dtype=np.int64)
    for row, group in enumerate(groups):
        at = 0
        for idx in group:
            ex = examples[idx]
            length = len(ex.input_ids)
            ids[row, at : at + length] = ex.input_ids
            positions[row, at : at + length] = np.arange(length)
            for i in range(1, length):
                if ex.trainable[i]:
                    labels[row, at + i - 1] = ex.input_ids[i]
            at += length
        # The padded tail is its own segment (positions restart), so nothing real ever attends to it.
        positions[row, at:] = np.arange(seq_len - at)
        real[row] = at
    return Rows(ids, labels, positions, real)


class EpochBatches:
    """Deterministic batches: epoch e is a pure function of (seed, e), so a position is (epoch, step)."""

    def __init__(self, data: TokenizedDataset, seq_len: int, pad_id: int, packing: bool, seed: int,
                 global_batch_size: int):
        self.data, self.seq_len, self.pad_id = data, seq_len, pad_id
        self.packing, self.seed, self.global_batch_size = packing, seed, global_batch_size
        self._cached: tuple[int, Rows] | None = None
        rows_per_epoch = len(self.rows(0))
        self.steps_per_epoch = rows_per_epoch // global_batch_size
        if self.steps_per_epoch == 0:
            raise DatasetError(
                f"hyperparameters.global_batch_size: at most {rows_per_epoch} sequences a step, not "
                f"{global_batch_size}; one epoch ({len(data.examples)} examples) holds {rows_per_epoch} sequences "
                f"of {seq_len} tokens. Lower the batch size or seq_len, or add data"
            )

    def rows(self, epoch: int) -> Rows:
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(self.data.examples)).tolist()
            if self.packing:
                bins = pack_best_fit_decreasing([len(self.data.examples[i].input_ids) for i in order], self.seq_len)
                groups = [[order[i] for i in b] for b in bins]
                groups = [groups[i] for i in rng.permutation(len(groups))]
            else:
                groups = [[i] for i in order]
            self._cached = (epoch, build_rows(self.data.examples, groups, self.seq_len, self.pad_id))
        return self._cached[1]

    def step_rows(self, step: int) -> tuple[int, Rows]:
        """(epoch, the global batch of rows) of optimizer step `step` (0-based, counted from the start)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        rows = self.rows(epoch)
        sl = slice(in_epoch * self.global_batch_size, (in_epoch + 1) * self.global_batch_size)
        return epoch, Rows(rows.input_ids[sl], rows.labels[sl], rows.position_ids[sl], rows.real_tokens[sl])


def micro_batches(batch: Rows, rank: int, world: int, micro_batch_size: int) -> Iterator[Rows]:
    """This rank's micro-batches of one global batch: micro-batch m of rank r is slot m*world + r."""
    per_slot = micro_batch_size
    slots = len(batch) // per_slot
    for slot in range(rank, slots, world):
        sl = slice(slot * per_slot, (slot + 1) * per_slot)
        yield Rows(batch.input_ids[sl], batch.labels[sl], batch.position_ids[sl], batch.real_tokens[sl])


@dataclass(frozen=True)
class StepInputs:
    """What the training step runs on: the global batch's size in the units its loss is the mean over
    (labelled tokens, or preference pairs), its non-padding tokens, and this rank's micro-batches."""

    units: int
    tokens: int
    micro_batches: list[dict]  # each micro-batch's tensors, on this rank's device


def eval_rows(data: TokenizedDataset, seq_len: int, pad_id: int, packing: bool) -> Rows:
    """Validation rows in file order (no shuffling, so every evaluation scores the same tokens): packed rows
    ordered by their first example, so that an evaluation capped at a few batches scores the file's first
    examples, not its longest."""
    if packing:
        groups = sorted(pack_best_fit_decreasing([len(e.input_ids) for e in data.examples], seq_len), key=min)
    else:
        groups = [[i] for i in range(len(data.examples))]
    return build_rows(data.examples, groups, seq_len, pad_id)
