"""Search layouts for a workload on a pool, choose one by objective, and say why.

Strategy × GPU count × nodes × micro-batch × accumulation × activation checkpointing. (No CPU offload:
the runtime has none, and a plan it cannot run is no plan.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel, Field

from tunewright_operator.planner.estimate import Calibration, Estimate, Layout, Workload, estimate
from tunewright_operator.planner.hardware import GIB, Pool

USABLE_MEMORY = 0.9  # allocator fragmentation, CUDA context, NCCL buffers: measured reserved ran up to +15%
COMM_BOUND = 0.5  # exposed communication share above which a layout is called communication-bound
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
STRATEGIES = ("single", "ddp", "fsdp", "hsdp")
OBJECTIVES = ("cheapest", "fastest", "fastest-within-budget", "cheapest-within-deadline")


class Predicted(BaseModel):
    peak_memory_gib: float
    step_seconds: float
    matmul_seconds: float
    memory_bound_seconds: float
    optimizer_seconds: float
    comm_seconds: float
    exposed_comm_seconds: float
    comm_share: float
    exposed_comm_share: float
    mfu: float
    tokens_per_second: float
    duration_seconds: float
    cost_usd: float
    memory_breakdown_gib: dict[str, float]


class Rejected(BaseModel):
    strategy: str
    gpus: int | None = None
    reason: str


class Plan(BaseModel):
    """The planner's answer: one layout, its predictions, and why (the operator, API and CLI share it)."""

    strategy: str
    gpus: int
    nodes: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    shard_group: int = Field(description="GPUs one copy of the training state is sharded over")
    predicted: Predicted
    explanation: str
    rejected: list[Rejected]


class NoPlan(ValueError):
    """No layout fits or meets the objective; the message lists why each was rejected."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: Estimate
    tokens_per_second: float
    duration_seconds: float
    cost_usd: float
    fits: bool


def gpu_counts(pool: Pool, max_gpus: int) -> Iterator[tuple[int, int]]:
    """(GPUs, nodes): powers of two within a node, whole nodes beyond it."""
    limit = min(max_gpus, pool.max_gpus)
    n = 1
    while n <= min(limit, pool.gpus_per_node):
        yield n, 1
        n *= 2
    for nodes in range(2, pool.max_nodes + 1):
        if nodes * pool.gpus_per_node <= limit:
            yield nodes * pool.gpus_per_node, nodes


def layouts(w: Workload, pool: Pool, strategies: tuple[str, ...], max_gpus: int) -> Iterator[Layout]:
    for gpus, nodes in gpu_counts(pool, max_gpus):
        if w.global_batch % gpus:
            continue
        for strategy in strategies:
            if (strategy == "single") != (gpus == 1):
                continue
            for shard in shard_groups(strategy, gpus, nodes, pool.gpus_per_node):
                for micro in MICRO_BATCHES:
                    per_rank = w.global_batch // gpus
                    if per_rank % micro:
                        continue
                    for checkpointing in (False, True):
                        yield Layout(strategy, gpus, nodes, micro, per_rank // micro, checkpointing, shard)


def shard_groups(strategy: str, gpus: int, nodes: int, gpus_per_node: int) -> list[int]:
    """FSDP shards over every GPU; HSDP over whole nodes (1, 2, ... of them), replicated across the rest."""
    if strategy == "fsdp":
        return [gpus]
    if strategy == "hsdp":  # within one node, hybrid shard is plain FSDP
        return [k * gpus_per_node for k in range(1, nodes) if nodes % k == 0] if nodes > 1 else []
    return [1]


def evaluate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Candidate:
    e = estimate(w, layout, pool, cal)
    tokens_per_second = w.tokens_per_step / e.step_seconds
    duration = w.steps * e.step_seconds
    cost = layout.gpus * duration / 3600 * pool.price_per_gpu_hour
    fits = e.peak_memory_bytes <= USABLE_MEMORY * pool.gpu.memory_gib * GIB
    return Candidate(layout, e, tokens_per_second, duration, cost, fits)


def _better(objective: str, a: Candidate, b: Candidate) -> bool:
    if objective in ("cheapest", "cheapest-within-deadline"):
        return (a.cost_usd, a.duration_seconds) < (b.cost_usd, b.duration_seconds)
    return (a.duration_seconds, a.cost_usd) < (b.duration_seconds, b.cost_usd)


def _describe(c: Candidate) -> str:
    lay = c.layout
    return (f"{lay.strategy} on {lay.gpus} GPU{'s' if lay.gpus > 1 else ''}"
            f"{f' ({lay.nodes} nodes)' if lay.nodes > 1 else ''}, micro-batch {lay.micro_batch} x {lay.grad_accum}"
            f"{', activation checkpointing' if lay.activation_checkpointing else ''}")


def plan(w: Workload, pool: Pool, cal: Calibration, objective: str = "cheapest", strategy: str = "auto",
         max_gpus: int | None = None, budget_usd: float | None = None,
         deadline_seconds: float | None = None) -> Plan:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective == "fastest-within-budget" and budget_usd is None:
        raise ValueError("budget_usd: needed for objective fastest-within-budget")
    if objective == "cheapest-within-deadline" and deadline_seconds is None:
        raise ValueError("deadline_seconds: needed for objective cheapest-within-deadline")
    strategies = STRATEGIES if strategy == "auto" else (strategy,)
    if strategy not in ("auto", *STRATEGIES):
        raise ValueError(f"strategy: must be auto or one of {', '.join(STRATEGIES)}, got {strategy!r}")
    limit = max_gpus or pool.max_gpus

    best_per_strategy: dict[str, Candidate] = {}
    smallest_per_strategy: dict[str, Candidate] = {}  # least memory, to say by how much nothing fits
    for layout in layouts(w, pool, strategies, limit):
        c = evaluate(w, layout, pool, cal)
        s = layout.strategy
        small = smallest_per_strategy.get(s)
        if small is None or c.estimate.peak_memory_bytes < small.estimate.peak_memory_bytes:
            smallest_per_strategy[s] = c
        if not c.fits:
            continue
        if objective == "fastest-within-budget" and c.cost_usd > budget_usd:
            continue
        if objective == "cheapest-within-deadline" and c.duration_seconds > deadline_seconds:
            continue
        if s not in best_per_strategy or _better(objective, c, best_per_strategy[s]):
            best_per_strategy[s] = c

    rejected = _rejections(strategies, best_per_strategy, smallest_per_strategy, pool, objective, budget_usd,
                           deadline_seconds)
    if not best_per_strategy:
        raise NoPlan("no layout works: " + "; ".join(f"{r.strategy}: {r.reason}" for r in rejected))
    chosen = min(best_per_strategy.values(),
                 key=lambda c: (c.cost_usd, c.duration_seconds) if objective.startswith("cheapest")
                 else (c.duration_seconds, c.cost_usd))
    for s, c in sorted(best_per_strategy.items()):
        if c is chosen:
            continue
        rejected.append(Rejected(strategy=s, gpus=c.layout.gpus, reason=_compare(c, chosen, objective)))
    return _to_plan(w, chosen, pool, objective, rejected)


def _rejections(strategies, best, smallest, pool: Pool, objective, budget, deadline) -> list[Rejected]:
    out = []
    usable = USABLE_MEMORY * pool.gpu.memory_gib
    for s in strategies:
        if s in best:
            continue
        small = smallest.get(s)
        if small is None:
            out.append(Rejected(strategy=s, reason="no GPU count in this pool suits it (hsdp needs 2+ nodes; "
                                                   "the global batch must divide over the GPUs)"))
        elif not small.fits:
            need = small.estimate.peak_memory_bytes / GIB
            out.append(Rejected(strategy=s, gpus=small.layout.gpus,
                                reason=f"does not fit: {need:.0f} GiB > {usable:.0f} GiB usable per "
                                       f"{pool.gpu.name} even at {_describe(small)}"))
        elif objective == "fastest-within-budget":
            out.append(Rejected(strategy=s, reason=f"no layout within the ${budget:,.2f} budget"))
        else:
            out.append(Rejected(strategy=s, reason=f"no layout within the {deadline:,.0f} s deadline"))
    return out


def _compare(c: Candidate, chosen: Candidate, objective: str) -> str:
    e = c.estimate
    parts = []
    if e.exposed_comm_share > COMM_BOUND:
        parts.append(f"communication-bound: {e.exposed_comm_share:.0%} of the step exposed")
    slower = c.duration_seconds / chosen.duration_seconds - 1
    dearer = c.cost_usd / chosen.cost_usd - 1 if chosen.cost_usd else 0.0
    if slower > 0.005:
        parts.append(f"{slower:.0%} slower")
    elif slower < -0.005:
        parts.append(f"{-slower:.0%} faster")
    if dearer > 0.005:
        parts.append(f"{dearer:.0%} more expensive")
    elif dearer < -0.005:
        parts.append(f"{-dearer:.0%} cheaper")
    verdict = ", ".join(parts) or "no better"
    return f"best layout {_describe(c)}: {verdict} (objective: {objective})"


def _to_plan(w: Workload, c: Candidate, pool: Pool, objective: str, rejected: list[Rejected]) -> Plan:
    e, lay, m = c.estimate, c.layout, w.model
    mfu = c.tokens_per_second / lay.gpus * m.flops_per_token(w.seq_len, w.method) / pool.gpu.bf16_flops
    predicted = Predicted(
        peak_memory_gib=e.peak_memory_bytes / GIB, step_seconds=e.step_seconds, matmul_seconds=e.matmul_seconds,
        memory_bound_seconds=e.memory_bound_seconds, optimizer_seconds=e.optimizer_seconds,
        comm_seconds=e.comm_seconds, exposed_comm_seconds=e.exposed_comm_seconds, comm_share=e.comm_share,
        exposed_comm_share=e.exposed_comm_share, mfu=mfu, tokens_per_second=c.tokens_per_second,
        duration_seconds=c.duration_seconds, cost_usd=c.cost_usd,
        memory_breakdown_gib={k: v / GIB for k, v in e.memory_breakdown.items()},
    )
    regime = ("communication-bound" if e.exposed_comm_share > COMM_BOUND
              else "compute-bound" if e.matmul_seconds >= e.memory_bound_seconds else "memory-bandwidth-bound")
    states = sum(v for k, v in e.memory_breakdown.items() if k not in ("activations", "logits and loss")) / GIB
    explanation = (
        f"{_describe(c)} ({objective}): {predicted.peak_memory_gib:.1f} GiB per {pool.gpu.name} "
        f"({states:.1f} GiB weights and optimizer, the rest activations and logits) of "
        f"{USABLE_MEMORY * pool.gpu.memory_gib:.0f} GiB usable; {regime}: step {e.step_seconds:.3f} s = "
        f"{e.matmul_seconds:.3f} matmul + {e.memory_bound_seconds:.3f} memory-bound + "
        f"{e.optimizer_seconds:.3f} optimizer + {e.exposed_comm_seconds:.3f} exposed communication "
        f"({e.comm_share:.0%} of the step in collectives, {e.exposed_comm_share:.0%} exposed); "
        f"{c.tokens_per_second:,.0f} tokens/s, MFU {mfu:.0%}, {math.ceil(c.duration_seconds / 60)} min, "
        f"${c.cost_usd:,.2f}."
    )
    return Plan(strategy=lay.strategy, gpus=lay.gpus, nodes=lay.nodes, micro_batch=lay.micro_batch,
                grad_accum=lay.grad_accum, activation_checkpointing=lay.activation_checkpointing,
                shard_group=lay.shard_group, predicted=predicted, explanation=explanation, rejected=rejected)
