"""Search layouts for a workload on a pool, choose one by objective, and say why.

Strategy × GPU count × nodes × shard group × micro-batch × accumulation × activation checkpointing ×
CPU offload (sharded states in host memory, optimizer on the CPU: slower, but it fits a model on fewer
GPUs, which the cheapest objective may prefer).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from tunewright_operator.planner.estimate import Calibration, Estimate, Layout, Workload, estimate
from tunewright_operator.planner.hardware import GIB, Pool
from tunewright_operator.spec import STRATEGIES, JobPlan, Predicted, RejectedOption

USABLE_MEMORY = 0.9  # allocator fragmentation, CUDA context, NCCL buffers: measured reserved ran up to +15%
USABLE_HOST_MEMORY = 0.8  # the rest is the OS, the dataloader, the Ray worker processes and page cache
COMM_BOUND = 0.5  # exposed communication share above which a layout is called communication-bound
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
OBJECTIVES = ("cheapest", "fastest", "fastest-within-budget", "cheapest-within-deadline")


class NoPlan(ValueError):
    """No layout fits or meets the objective; the message lists why each was rejected."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: Estimate
    tokens_per_second: float
    duration_seconds: float
    cost_usd: float
    fits_gpu: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def host_bytes_per_node(self) -> float:
        return self.estimate.host_memory_bytes * (self.layout.gpus // self.layout.nodes)


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
                        for offload in (False, True):
                            yield Layout(strategy, gpus, nodes, micro, per_rank // micro, checkpointing, shard,
                                         offload)


def shard_groups(strategy: str, gpus: int, nodes: int, gpus_per_node: int) -> list[int]:
    """FSDP shards over every GPU; HSDP over a node's GPUs (within one node: a power-of-two part of them)
    or over whole nodes, replicated across the rest; single and DDP keep whole copies (shards of one)."""
    if strategy == "fsdp":
        return [gpus]
    if strategy == "hsdp":
        within = [g for g in (2, 4, 8, 16) if g < min(gpus, gpus_per_node) and gpus % g == 0]
        return within + [k * gpus_per_node for k in range(1, nodes) if nodes % k == 0]
    return [1]


def evaluate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Candidate:
    e = estimate(w, layout, pool, cal)
    tokens_per_second = w.tokens_per_step / e.step_seconds
    duration = w.steps * e.step_seconds
    cost = layout.gpus * duration / 3600 * pool.price_per_gpu_hour
    fits_gpu = e.peak_memory_bytes <= USABLE_MEMORY * pool.gpu.memory_gib * GIB
    host_per_node = e.host_memory_bytes * (layout.gpus // layout.nodes)
    fits_host = host_per_node <= USABLE_HOST_MEMORY * pool.host_memory_per_node_gib * GIB
    return Candidate(layout, e, tokens_per_second, duration, cost, fits_gpu, fits_host)


def _better(objective: str, a: Candidate, b: Candidate) -> bool:
    if objective in ("cheapest", "cheapest-within-deadline"):
        return (a.cost_usd, a.duration_seconds) < (b.cost_usd, b.duration_seconds)
    return (a.duration_seconds, a.cost_usd) < (b.duration_seconds, b.cost_usd)


def _describe(c: Candidate) -> str:
    lay = c.layout
    return (f"{lay.strategy} on {lay.gpus} GPU{'s' if lay.gpus > 1 else ''}"
            f"{f' ({lay.nodes} nodes)' if lay.nodes > 1 else ''}"
            f"{f' in groups of {lay.shard_group}' if lay.strategy == 'hsdp' else ''}"
            f", micro-batch {lay.micro_batch} x {lay.grad_accum}"
            f"{', activation checkpointing' if lay.activation_checkpointing else ''}"
            f"{', CPU offload' if lay.cpu_offload else ''}")


def plan(w: Workload, pool: Pool, cal: Calibration, objective: str = "cheapest", strategy: str = "auto",
         max_gpus: int | None = None, budget_usd: float | None = None,
         deadline_seconds: float | None = None) -> JobPlan:
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
    if w.method == "qlora":
        single = estimate(w, Layout("single", 1, 1, 1, w.global_batch, True), pool, cal)
        raise NoPlan(f"method qlora: the runtime does not train 4-bit bases yet (the memory model alone puts "
                     f"{single.peak_memory_bytes / GIB:.0f} GiB on one {pool.gpu.name} at micro-batch 1 with "
                     f"checkpointing); use lora")

    best_per_strategy: dict[str, Candidate] = {}
    # least GPU memory without offload, least host memory with it: to say by how much nothing fits
    smallest_per_strategy: dict[tuple[str, bool], Candidate] = {}
    # the cheapest and the fastest that fit, per strategy: to say how far a budget or deadline is
    cheapest_fit: dict[str, Candidate] = {}
    fastest_fit: dict[str, Candidate] = {}
    for layout in layouts(w, pool, strategies, limit):
        c = evaluate(w, layout, pool, cal)
        s = layout.strategy
        key = (s, layout.cpu_offload)
        small = smallest_per_strategy.get(key)
        if small is None or _footprint(c) < _footprint(small):
            smallest_per_strategy[key] = c
        if not c.fits:
            continue
        if s not in cheapest_fit or c.cost_usd < cheapest_fit[s].cost_usd:
            cheapest_fit[s] = c
        if s not in fastest_fit or c.duration_seconds < fastest_fit[s].duration_seconds:
            fastest_fit[s] = c
        if objective == "fastest-within-budget" and c.cost_usd > budget_usd:
            continue
        if objective == "cheapest-within-deadline" and c.duration_seconds > deadline_seconds:
            continue
        if s not in best_per_strategy or _better(objective, c, best_per_strategy[s]):
            best_per_strategy[s] = c

    rejected = _rejections(strategies, best_per_strategy, smallest_per_strategy, cheapest_fit, fastest_fit, pool,
                           objective, budget_usd, deadline_seconds)
    if not best_per_strategy:
        raise NoPlan("no layout works: " + "; ".join(f"{r.strategy}: {r.reason}" for r in rejected))
    chosen = min(best_per_strategy.values(),
                 key=lambda c: (c.cost_usd, c.duration_seconds) if objective.startswith("cheapest")
                 else (c.duration_seconds, c.cost_usd))
    for s, c in sorted(best_per_strategy.items()):
        if c is chosen:
            continue
        rejected.append(RejectedOption(strategy=s, gpus=c.layout.gpus, reason=_compare(c, chosen, objective)))
    return _to_plan(w, chosen, pool, objective, rejected)


def _footprint(c: Candidate) -> tuple[float, float]:
    if c.layout.cpu_offload:
        return (not c.fits_gpu, c.host_bytes_per_node)
    return (0, c.estimate.peak_memory_bytes)


def _does_not_fit(c: Candidate, pool: Pool) -> str:
    if not c.fits_gpu:
        need, usable = c.estimate.peak_memory_bytes / GIB, USABLE_MEMORY * pool.gpu.memory_gib
        return f"{need:.0f} GiB > {usable:.0f} GiB usable per {pool.gpu.name} even at {_describe(c)}"
    need, usable = c.host_bytes_per_node / GIB, USABLE_HOST_MEMORY * pool.host_memory_per_node_gib
    return f"{need:.0f} GiB of host memory > {usable:.0f} GiB usable per node even at {_describe(c)}"


def _rejections(strategies, best, smallest, cheapest, fastest, pool: Pool, objective, budget, deadline
                ) -> list[RejectedOption]:
    out = []
    for s in strategies:
        if s in best:
            continue
        small, offloaded = smallest.get((s, False)), smallest.get((s, True))
        if small is None:
            out.append(RejectedOption(strategy=s, reason="no GPU count in this pool suits it (the global batch must "
                                                   "divide over the GPUs; hsdp needs 2+ shard groups)"))
        elif s not in cheapest:  # nothing fits, with or without offload
            reason = f"does not fit: {_does_not_fit(small, pool)}"
            if offloaded is not None:
                reason += f"; with CPU offload: {_does_not_fit(offloaded, pool)}"
            out.append(RejectedOption(strategy=s, gpus=small.layout.gpus, reason=reason))
        elif objective == "fastest-within-budget":
            c = cheapest[s]
            out.append(RejectedOption(strategy=s, gpus=c.layout.gpus, reason=(
                f"no layout within the ${budget:,.2f} budget (the cheapest, {_describe(c)}, costs "
                f"${c.cost_usd:,.2f})")))
        else:
            c = fastest[s]
            out.append(RejectedOption(strategy=s, gpus=c.layout.gpus, reason=(
                f"no layout within the {deadline:,.0f} s deadline (the fastest, {_describe(c)}, takes "
                f"{c.duration_seconds:,.0f} s)")))
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


def _to_plan(w: Workload, c: Candidate, pool: Pool, objective: str, rejected: list[RejectedOption]) -> JobPlan:
    e, lay, m = c.estimate, c.layout, w.model
    mfu = c.tokens_per_second / lay.gpus * m.flops_per_token(w.seq_len, w.method) / pool.gpu.bf16_flops
    predicted = Predicted(
        peak_memory_gib=e.peak_memory_bytes / GIB, step_seconds=e.step_seconds, matmul_seconds=e.matmul_seconds,
        memory_bound_seconds=e.memory_bound_seconds, optimizer_seconds=e.optimizer_seconds,
        comm_seconds=e.comm_seconds, exposed_comm_seconds=e.exposed_comm_seconds,
        offload_seconds=e.offload_seconds, exposed_offload_seconds=e.exposed_offload_seconds,
        host_memory_gib_per_node=c.host_bytes_per_node / GIB, comm_share=e.comm_share,
        exposed_comm_share=e.exposed_comm_share, mfu=mfu, tokens_per_second=c.tokens_per_second,
        duration_seconds=c.duration_seconds, cost_usd=c.cost_usd,
        memory_breakdown_gib={k: v / GIB for k, v in e.memory_breakdown.items()},
    )
    regime = ("communication-bound" if e.exposed_comm_share > COMM_BOUND
              else "bound by the host's optimizer step" if e.optimizer_seconds > 0.5 * e.step_seconds
              else "compute-bound" if e.matmul_seconds >= e.memory_bound_seconds else "memory-bandwidth-bound")
    states = sum(v for k, v in e.memory_breakdown.items() if k not in ("activations", "logits and loss")) / GIB
    offload = (f"; {c.host_bytes_per_node / GIB:.0f} GiB of states per node in host memory (of "
               f"{USABLE_HOST_MEMORY * pool.host_memory_per_node_gib:.0f} GiB usable), "
               f"{e.exposed_offload_seconds:.3f} s of host copies exposed" if lay.cpu_offload else "")
    explanation = (
        f"{_describe(c)} ({objective}): {predicted.peak_memory_gib:.1f} GiB per {pool.gpu.name} "
        f"({states:.1f} GiB weights and optimizer, the rest activations and logits) of "
        f"{USABLE_MEMORY * pool.gpu.memory_gib:.0f} GiB usable{offload}; {regime}: step {e.step_seconds:.3f} s = "
        f"{e.matmul_seconds:.3f} matmul + {e.memory_bound_seconds:.3f} memory-bound + "
        f"{e.optimizer_seconds:.3f} optimizer + {e.exposed_comm_seconds:.3f} exposed communication "
        f"({e.comm_share:.0%} of the step in collectives, {e.exposed_comm_share:.0%} exposed); "
        f"{c.tokens_per_second:,.0f} tokens/s, MFU {mfu:.0%}, {math.ceil(c.duration_seconds / 60)} min, "
        f"${c.cost_usd:,.2f}."
    )
    return JobPlan(pool=pool.name, strategy=lay.strategy, workers=lay.gpus, gpus=lay.gpus, nodes=lay.nodes,
                   micro_batch=lay.micro_batch, grad_accum=lay.grad_accum,
                   activation_checkpointing=lay.activation_checkpointing, shard_group=lay.shard_group,
                   cpu_offload=lay.cpu_offload, predicted=predicted, explanation=explanation, rejected=rejected)
