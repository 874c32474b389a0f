"""Evaluation: validation loss and mean token accuracy, and exact match of greedy answers.

Every rank runs the same number of forward passes (shards are padded), which FSDP requires.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from tunewright_jobs.data import IGNORE_INDEX, Rows
from tunewright_jobs.kernels import plain_cross_entropy
from tunewright_jobs.parallel import Dist

log = logging.getLogger(__name__)


def _pad_rows(rows: Rows, multiple: int, pad_id: int) -> Rows:
    extra = -len(rows) % multiple
    if not extra:
        return rows
    seq = rows.input_ids.shape[1]
    pad = lambda a, fill: np.concatenate([a, np.full((extra, seq), fill, dtype=a.dtype)])  # noqa: E731
    return Rows(pad(rows.input_ids, pad_id), pad(rows.labels, IGNORE_INDEX),
                np.concatenate([rows.position_ids, np.tile(np.arange(seq), (extra, 1))]),
                np.concatenate([rows.real_tokens, np.zeros(extra, dtype=rows.real_tokens.dtype)]))


def token_loss_sum(model, batch: Rows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, the logits' argmax) over the batch's labelled tokens."""
    logits = model(input_ids=torch.as_tensor(batch.input_ids, device=device),
                   position_ids=torch.as_tensor(batch.position_ids, device=device), use_cache=False).logits
    return plain_cross_entropy(logits, torch.as_tensor(batch.labels, device=device)), logits.argmax(-1)


@torch.no_grad()
def validation_metrics(model, rows: Rows, dist: Dist, micro_batch_size: int, pad_id: int,
                       max_batches: int | None = None) -> dict[str, float]:
    model.eval()
    rows = _pad_rows(rows, dist.world_size * micro_batch_size, pad_id)
    n_slots = len(rows) // micro_batch_size
    loss_sum = correct = count = 0.0
    for i, slot in enumerate(range(dist.rank, n_slots, dist.world_size)):
        if max_batches is not None and i >= max_batches:
            break
        sl = slice(slot * micro_batch_size, (slot + 1) * micro_batch_size)
        batch = Rows(rows.input_ids[sl], rows.labels[sl], rows.position_ids[sl], rows.real_tokens[sl])
        loss, predicted = token_loss_sum(model, batch, dist.device)
        labels = torch.as_tensor(batch.labels, device=dist.device)
        mask = labels != IGNORE_INDEX
        loss_sum += loss.item()
        correct += (predicted[mask] == labels[mask]).sum().item()
        count += mask.sum().item()
    loss_sum, correct, count = dist.all_reduce_sum([loss_sum, correct, count])
    model.train()
    return {"val_loss": loss_sum / max(count, 1), "val_token_accuracy": correct / max(count, 1)}


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, device: torch.device,
                   stop_ids: list[int], batch_size: int = 16) -> list[str]:
    """Greedy continuations, cut at the first of `stop_ids` (the tokens the exported generation config
    stops at: end of turn, end of text), so that answers are scored as a user's generate() returns them.

    No KV cache and a fixed number of forward passes per batch, so that sharded ranks stay in lockstep.
    """
    stops = set(stop_ids)
    pad_id = tokenizer.pad_token_id
    answers = []
    for start in range(0, len(prompts), batch_size):
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start:start + batch_size]]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
        for row in ids[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            answers.append(tokenizer.decode(row[:cut]).strip())
    return answers


def exact_match(model, tokenizer, prompts: list[str], references: list[str], dist: Dist,
                max_new_tokens: int, stop_ids: list[int]) -> dict:
    """Share of validation answers generated exactly (after stripping); rank 0 logs a few of its answers."""
    model.eval()
    per_rank = math.ceil(len(prompts) / dist.world_size)
    mine = list(range(dist.rank * per_rank, min(len(prompts), (dist.rank + 1) * per_rank)))
    # Ranks with a short shard repeat a prompt (and do not score it) to keep the forward count equal.
    padded = mine + [0] * (per_rank - len(mine))
    answers = greedy_answers(model, tokenizer, [prompts[i] for i in padded], max_new_tokens, dist.device,
                             stop_ids)
    correct = sum(answers[j] == references[i].strip() for j, i in enumerate(mine))
    correct, total = dist.all_reduce_sum([float(correct), float(len(mine))])
    model.train()
    if dist.is_main:
        for j, i in enumerate(mine[:3]):  # the prompt's end is the question
            log.info("exact match sample: %r -> %r (expected %r)", prompts[i][-200:], answers[j], references[i])
    return {"exact_match": correct / total, "exact_match_examples": int(total)}
