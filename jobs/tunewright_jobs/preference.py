"""Preference pairs and DPO (`method.objective: dpo`), as TRL's DPOTrainer computes it with `loss_type="sigmoid"`.

A pair is two sequences: the prompt followed by the chosen answer, and by the rejected one. They are tokenized
as TRL tokenizes them, and an answer's tokens (where the two diverge from the prompt alone) are the labelled
ones. A sequence's log-probability is the sum over its labelled tokens; a pair's DPO loss is
`-(1 - ls) logsigmoid(beta d) - ls logsigmoid(-beta d)`, where d is the chosen answer's log-ratio to the
reference model less the rejected one's, and a step's loss is the mean over its pairs (all micro-batches,
all ranks). Both sequences of a pair go through one forward: a micro-batch's sequences one to a row, the
chosen ones first (TRL's layout), or packed into as few rows as hold them, attention kept within each.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from tunewright_jobs.config import JobConfig
from tunewright_jobs.data import (
    IGNORE_INDEX,
    DatasetError,
    Example,
    Rows,
    StepInputs,
    build_rows,
    ensure_chat_template,
    pack_best_fit_decreasing,
)
from tunewright_jobs.kernels import VARLEN, VARLEN_KWARGS, Kernels, copy_to_device, for_evaluation, to_device
from tunewright_jobs.parallel import Dist, place_frozen

log = logging.getLogger(__name__)

# --- reading and tokenizing ---------------------------------------------------------------------------


def preference_parts(record: dict) -> tuple[str | list[dict], str | list[dict], str | list[dict]]:
    """(prompt, chosen, rejected) of a record in either shape (`dataset_files` checked it): all text, or all
    messages, as TRL takes them. An answer given as text after a prompt of messages is an assistant message."""
    if "input" in record:  # OpenAI's shape
        return record["input"]["messages"], record["preferred_output"], record["non_preferred_output"]
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, list):
        chosen, rejected = ([{"role": "assistant", "content": a}] if isinstance(a, str) else a
                            for a in (chosen, rejected))
    return prompt, chosen, rejected


def answer_text(answer: str | list[dict]) -> str:
    return answer if isinstance(answer, str) else answer[-1]["content"]


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example

    @property
    def tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def tokenize_pair(tokenizer, record: dict) -> Pair:
    """TRL's tokenization (`DPOTrainer._prepare_dataset`): messages through the chat template (the prompt with
    the generation prompt, each answer after it as the whole conversation), text as it is with eos appended to
    each answer; the answers start where the prompt alone and the whole sequences diverge."""
    prompt, chosen, rejected = preference_parts(record)
    if isinstance(prompt, list):
        def encode(messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      add_generation_prompt=add_generation_prompt)["input_ids"])
        prompt_ids = encode(prompt, add_generation_prompt=True)
        sequences = [encode(prompt + chosen), encode(prompt + rejected)]
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        sequences = [tokenizer(prompt + (a if a.endswith(eos) else a + eos))["input_ids"] for a in (chosen, rejected)]
    start = min(_common_prefix(prompt_ids, ids) for ids in sequences)
    chosen_ex, rejected_ex = (Example(list(ids), [i >= start for i in range(len(ids))]) for ids in sequences)
    return Pair(chosen_ex, rejected_ex)


@dataclass(frozen=True)
class PairDataset:
    pairs: list[Pair]
    truncated: int  # pairs with a sequence cut to seq_len
    dropped: int  # pairs with an answer left without a labelled token, or the same answer twice


def tokenize_pairs(tokenizer, records: list[dict], seq_len: int, source: str) -> PairDataset:
    """Every pair, each sequence cut to seq_len (keeping its start, as TRL's `truncation_mode="keep_start"`)."""
    if any(isinstance(preference_parts(r)[0], list) for r in records):
        ensure_chat_template(tokenizer)
    pairs, truncated, dropped, same = [], 0, 0, 0
    for record in records:
        pair = tokenize_pair(tokenizer, record)
        sides = [Example(ex.input_ids[:seq_len], ex.trainable[:seq_len]) for ex in (pair.chosen, pair.rejected)]
        truncated += any(len(ex.input_ids) > seq_len for ex in (pair.chosen, pair.rejected))
        # Token 0 is never a target: each answer needs a labelled token after it, or the pair says nothing.
        if not all(any(ex.trainable[1:]) for ex in sides):
            dropped += 1
            continue
        if sides[0] == sides[1]:  # one answer twice (within seq_len): loss log 2, no gradient, a diluted mean
            same += 1
            continue
        pairs.append(Pair(*sides))
    if not pairs:
        raise DatasetError(f"{source}: no preference pair has two different answers with tokens within "
                           f"seq_len={seq_len}")
    if truncated or dropped or same:
        log.warning("%s: %d preference pairs truncated to %d tokens; dropped: %d with an answer left with no "
                    "token, %d with the same answer twice", source, truncated, seq_len, dropped, same)
    return PairDataset(pairs, truncated, dropped + same)


def prompt_and_answer(tokenizer, record: dict) -> tuple[str, str]:
    """(the prompt as generation sees it, the chosen answer's text): for exact match."""
    prompt, chosen, _ = preference_parts(record)
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt, answer_text(chosen)


# --- batches ------------------------------------------------------------------------------------------


class PairBatches:
    """Deterministic batches of `global_batch_size` pairs: epoch e's order is a pure function of (seed, e)."""

    def __init__(self, data: PairDataset, seed: int, global_batch_size: int):
        self.data, self.seed, self.global_batch_size = data, seed, global_batch_size
        self._order: tuple[int, np.ndarray] | None = None
        self.steps_per_epoch = len(data.pairs) // global_batch_size
        if self.steps_per_epoch == 0:
            raise DatasetError(
                f"hyperparameters.global_batch_size: at most {len(data.pairs)} preference pairs a step (one epoch "
                f"holds that many), not {global_batch_size}. Lower the batch size, or add data")

    def step_rows(self, step: int) -> tuple[int, list[Pair]]:
        """(epoch, the global batch of pairs) of optimizer step `step` (0-based, counted from the start)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.data.pairs)))
        taken = self._order[1][in_epoch * self.global_batch_size:(in_epoch + 1) * self.global_batch_size]
        return epoch, [self.data.pairs[i] for i in taken]


@dataclass(frozen=True)
class PairRows:
    """A micro-batch of pairs as rows, and its labelled positions (flat indices into the rows), each with its
    target token and the sequence it scores (chosen answer of pair p: p, rejected: pairs + p): worked out on
    the host, so that picking them on the device waits for nothing."""

    rows: Rows
    labelled: np.ndarray
    targets: np.ndarray
    sequence: np.ndarray
    pairs: int


def pair_rows(pairs: list[Pair], seq_len: int, pad_id: int, packing: bool) -> PairRows:
    examples = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    if packing:
        groups = pack_best_fit_decreasing([len(e.input_ids) for e in examples], seq_len)
    else:
        groups = [[i] for i in range(len(examples))]
    rows = build_rows(examples, groups, seq_len, pad_id)
    sequence = np.zeros(rows.labels.shape, dtype=np.int64)
    for row, group in enumerate(groups):
        at = 0
        for index in group:
            length = len(examples[index].input_ids)
            sequence[row, at:at + length] = index
            at += length
    labelled = np.flatnonzero(rows.labels != IGNORE_INDEX)
    return PairRows(rows, labelled, rows.labels.reshape(-1)[labelled], sequence.reshape(-1)[labelled], len(pairs))


# --- the loss -----------------------------------------------------------------------------------------


def labelled_logits(model, batch: dict) -> torch.Tensor:
    """The logits at the labelled positions, in fp32: [labelled tokens, vocab] (only they are widened)."""
    extra = {name: batch[name] for name in VARLEN_KWARGS if name in batch}
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **extra).logits
    return logits.flatten(0, 1).index_select(0, batch["labelled"]).float()


def sequence_logps(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each sequence's summed log-probability of its labelled tokens: [2 x pairs], chosen answers first."""
    token_logps = logits.gather(-1, batch["targets"][:, None]).squeeze(-1) - logits.logsumexp(-1)
    return token_logps.new_zeros(2 * batch["pairs"]).index_add(0, batch["sequence"], token_logps)


@dataclass(frozen=True)
class PairScores:
    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # beta x log-ratio to the reference, detached
    rejected_rewards: torch.Tensor


def dpo_scores(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float,
               label_smoothing: float) -> PairScores:
    """TRL's `dpo_loss` for `loss_type="sigmoid"`, with conservative DPO's label smoothing (TRL < 1.0's
    sigmoid loss; 0 gives TRL 1.x's)."""
    chosen_ratios, rejected_ratios = (policy_logps - reference_logps).chunk(2)
    logits = beta * (chosen_ratios - rejected_ratios)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return PairScores(losses, beta * chosen_ratios.detach(), beta * rejected_ratios.detach())


# --- the reference ------------------------------------------------------------------------------------


def reference_copy(cfg: JobConfig, model, dist: Dist):
    """Full fine-tuning's reference: a frozen copy of the initial model (taken before the policy is wrapped),
    placed as the policy is. LoRA needs none: its reference is the policy with the adapters off."""
    if cfg.method.objective != "dpo" or cfg.method.type != "full":
        return None
    return place_frozen(cfg, copy.deepcopy(model), dist)


class Reference:
    """The reference's log-probabilities, computed under no_grad: from a frozen copy, or from the policy with
    its adapters switched off (the base it started from, and no second model)."""

    def __init__(self, policy, frozen):
        self.model = frozen if frozen is not None else policy
        self.adapters_off = frozen is None

    @torch.no_grad()
    def logps(self, batch: dict) -> torch.Tensor:
        with adapters_off(self.model) if self.adapters_off else contextlib.nullcontext():
            return sequence_logps(labelled_logits(self.model, batch), batch)


@contextlib.contextmanager
def adapters_off(model) -> Iterator[None]:
    """The model's PEFT adapters switched off by their flag alone. PEFT's `disable_adapter` also sets and
    restores requires_grad on the adapter weights, and under FSDP2 that reaches whichever copy of each weight
    (sharded or gathered) is registered at the moment: the sharded ones could stay frozen, still stepped by
    the optimizer but missing from every trainable-only state dict (checkpoints, the exported adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    were = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, were, strict=True):
            layer._disable_adapters = was


def disable_dropout(model) -> None:
    """As TRL's `disable_dropout=True` (its default): dropout would make the policy's log-probabilities noise
    against the reference's, and the rewards with them."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


# --- the objective ------------------------------------------------------------------------------------


class PreferenceObjective:
    """DPO on batches of preference pairs: the `train` loop's objective for `method.objective: dpo`."""

    statistics = 3  # summed over a micro-batch's pairs: chosen rewards, rejected rewards, pairs ranked right

    def __init__(self, cfg: JobConfig, model, frozen, kernels: Kernels, dist: Dist, pad_id: int):
        self.cfg, self.model, self.kernels, self.dist, self.pad_id = cfg, model, kernels, dist, pad_id
        # evaluation runs on the plain paths (`kernels.for_evaluation`): SDPA where training runs varlen
        self.evaluation_kernels = replace(kernels, attention="sdpa" if kernels.attention == VARLEN
                                          else kernels.attention)
        self.beta, self.label_smoothing = cfg.method.dpo.beta, cfg.method.dpo.label_smoothing
        self.reference = Reference(model, frozen)
        disable_dropout(model)

    def tensors(self, pairs: list[Pair], kernels: Kernels) -> dict:
        """A micro-batch on the device: its rows (with the attention inputs `kernels` take), and its labelled
        positions with their targets and sequences (`PairRows`)."""
        cfg, device = self.cfg, self.dist.device
        batch = pair_rows(pairs, cfg.hyperparameters.seq_len, self.pad_id, cfg.dataset.packing)
        picked = {name: copy_to_device(getattr(batch, name), device) for name in ("labelled", "targets", "sequence")}
        return to_device(batch.rows, device, kernels) | picked | {"pairs": batch.pairs}

    def micro_batches(self, batch: list[Pair]) -> StepInputs:
        """Micro-batch m of rank r is slot m x world + r, as `data.micro_batches` deals rows."""
        size, dist = self.cfg.strategy.micro_batch_size, self.dist
        mine = [batch[slot * size:(slot + 1) * size] for slot in range(dist.rank, len(batch) // size, dist.world_size)]
        return StepInputs(len(batch), sum(p.tokens for p in batch), [self.tensors(m, self.kernels) for m in mine])

    def scores(self, batch: dict) -> tuple[PairScores, torch.Tensor]:
        """The pairs' DPO scores, and the policy's labelled logits (for evaluation's token accuracy)."""
        reference = self.reference.logps(batch)
        logits = labelled_logits(self.model, batch)
        return dpo_scores(sequence_logps(logits, batch), reference, self.beta, self.label_smoothing), logits

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed pair losses, and its statistics' sums."""
        scores, _ = self.scores(batch)
        chosen, rejected = scores.chosen_rewards, scores.rejected_rewards
        ranked_right = (chosen > rejected).sum().to(chosen.dtype)
        return scores.losses.sum(), torch.stack([chosen.sum(), rejected.sum(), ranked_right])

    def step_fields(self, sums: list[float], pairs: int) -> dict:
        """The `step` record's DPO fields, from the window's statistics summed over ranks."""
        chosen, rejected, ranked_right = (value / max(pairs, 1) for value in sums)
        return {"chosen_reward": chosen, "rejected_reward": rejected, "reward_margin": chosen - rejected,
                "preference_accuracy": ranked_right}

    @torch.no_grad()
    def evaluate(self, pairs: list[Pair]) -> dict[str, float]:
        """Over the validation pairs (at most `eval.max_batches` micro-batches a rank): the mean DPO loss, the
        share of the chosen answers' tokens predicted exactly, the preference accuracy and the reward margin.
        Every rank runs as many forwards (a short one repeats a micro-batch and does not count it)."""
        self.model.eval()
        sums, count = torch.zeros(5, dtype=torch.float64, device=self.dist.device), 0
        with for_evaluation(self.reference.model):
            for chunk, counted in self.evaluation_slots(pairs):
                batch = self.tensors(chunk, self.evaluation_kernels)
                scores, logits = self.scores(batch)
                chosen_tokens = batch["sequence"] < batch["pairs"]
                right = (logits.argmax(-1) == batch["targets"]) & chosen_tokens
                chosen, rejected = scores.chosen_rewards, scores.rejected_rewards
                values = [scores.losses.sum(), (chosen > rejected).sum(), (chosen - rejected).sum(), right.sum(),
                          chosen_tokens.sum()]
                sums += counted * torch.stack([v.double() for v in values])
                count += counted * len(chunk)
        loss, ranked_right, margin, right_tokens, tokens, count = self.dist.all_reduce_sum([*sums.tolist(), count])
        self.model.train()
        return {"val_loss": loss / max(count, 1), "val_token_accuracy": right_tokens / max(tokens, 1),
                "preference_accuracy": ranked_right / max(count, 1), "reward_margin": margin / max(count, 1)}

    def evaluation_slots(self, pairs: list[Pair]) -> Iterator[tuple[list[Pair], int]]:
        """This rank's micro-batches of the validation pairs, in file order, each with whether it counts."""
        size, dist, cap = self.cfg.strategy.micro_batch_size, self.dist, self.cfg.eval.max_batches
        slots = math.ceil(len(pairs) / size)
        per_rank = math.ceil(slots / dist.world_size)
        if cap is not None:
            per_rank = min(per_rank, cap)
        for i in range(per_rank):
            slot = dist.rank + i * dist.world_size
            yield (pairs[slot * size:(slot + 1) * size], 1) if slot < slots else (pairs[:size], 0)
