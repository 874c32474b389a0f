"""Search layouts for a workload on a pool, choose one by objective, and say why.

Strategy × GPU count × nodes × shard group × micro-batch × accumulation × activation checkpointing (none,
every block, every other block) × CPU offload (sharded states in host memory, optimizer on the CPU: slower,
but it fits a model on fewer GPUs, which the cheapest objective may prefer) × for FSDP and HSDP, weights
resharded after forward or kept gathered until backward (one gather less per block, more memory).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from tunewright_core.planner.band import Evidence, band
from tunewright_core.planner.estimate import (
    REFERENCE_WEIGHTS,
    TRANSIENT_TERMS,
    Calibration,
    Estimate,
    Layout,
    Workload,
    estimate,
)
from tunewright_core.planner.hardware import GIB, Pool
from tunewright_core.spec import STRATEGIES, JobPlan, Predicted, PredictionBand, RejectedOption

USABLE_MEMORY = 0.9  # allocator fragmentation, CUDA context, NCCL buffers: measured reserved ran up to +15%
# The allocator's peak varies from run to run: Llama-1B full at micro-batch 8 on one H200 read 68.6 GiB in one
# calibration run and 71.0 GiB in a later run of the same shapes on other data (+3.5%). The tests hold the
# calibrated model to under-predict no committed run by more than MEMORY_UNDER_PREDICTION_BOUND (the runtime of
# issue 12, fitted on 10 runs of GPT-2 and Llama-1B: -7.0% at worst, Qwen-0.5B LoRA with checkpointing, held
# out; -6.2% Llama-3B LoRA, a shape whose share of per-hidden activations no fitted run has), so a run can
# peak up to (1 + 3.5%) / (1 - 7.5%) = 1.12 x its prediction: a layout fits when its predicted peak with
# this margin is within the usable memory.
RUN_TO_RUN_MEMORY_VARIATION = 0.035
MEMORY_UNDER_PREDICTION_BOUND = 0.075
MEMORY_MARGIN = (1 + RUN_TO_RUN_MEMORY_VARIATION) / (1 - MEMORY_UNDER_PREDICTION_BOUND) - 1
USABLE_HOST_MEMORY = 0.8  # the rest is the OS, the dataloader, the Ray worker processes and page cache
COMM_BOUND = 0.5  # exposed communication share above which a layout is called communication-bound
# Near ties: layouts within this share of the best on the objective's measure (cost for the cheapest objectives,
# duration for the fastest) are told apart by the other measure. A difference this small is below the model's
# own error (step time ~5%), while the other measure often differs by 2x or more (two GPUs at the cost of one).
NEAR_TIE = 0.01
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
OBJECTIVES = ("cheapest", "fastest", "fastest-within-budget", "cheapest-within-deadline")
# a 4-bit base stays whole on each GPU: the runtime keeps it out of FSDP, and does not offload it
QLORA_STRATEGIES = ("single", "ddp")


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
                    for checkpointing, every in ((False, 1), (True, 1), (True, 2)):
                        for offload in (False,) if w.method == "qlora" else (False, True):
                            for reshard in (True, False) if strategy in ("fsdp", "hsdp") and not offload else (True,):
                                yield Layout(strategy, gpus, nodes, micro, per_rank // micro, checkpointing, shard,
                                             offload, every, reshard)


def shard_groups(strategy: str, gpus: int, nodes: int, gpus_per_node: int) -> list[int]:
    """FSDP shards over every GPU; HSDP over a node's GPUs (within one node: a power-of-two part of them)
    or over whole nodes, replicated across the rest; single and DDP keep whole copies (shards of one)."""
    if strategy == "fsdp":
        return [gpus]
    if strategy == "hsdp":
        # a group within a node divides the node's GPUs too, so no group straddles two nodes
        within = [g for g in (2, 4, 8, 16) if g < min(gpus, gpus_per_node) and gpus % g == 0 and gpus_per_node % g == 0]
        return within + [k * gpus_per_node for k in range(1, nodes) if nodes % k == 0]
    return [1]


def evaluate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Candidate:
    e = estimate(w, layout, pool, cal)
    tokens_per_second = w.tokens_per_step / e.step_seconds
    duration = w.steps * e.step_seconds
    cost = layout.gpus * duration / 3600 * pool.price_per_gpu_hour
    fits_gpu = e.peak_memory_bytes * (1 + MEMORY_MARGIN) <= USABLE_MEMORY * pool.gpu.memory_gib * GIB
    host_per_node = e.host_memory_bytes * (layout.gpus // layout.nodes)
    fits_host = host_per_node <= USABLE_HOST_MEMORY * pool.host_memory_per_node_gib * GIB
    return Candidate(layout, e, tokens_per_second, duration, cost, fits_gpu, fits_host)


def _measures(objective: str, c: Candidate) -> tuple[float, float]:
    """The objective's measure, then the other: cost then duration for the cheapest objectives."""
    if objective.startswith("cheapest"):
        return c.cost_usd, c.duration_seconds
    return c.duration_seconds, c.cost_usd


def _better(objective: str, a: Candidate, b: Candidate) -> bool:
    return _measures(objective, a) < _measures(objective, b)


def break_near_tie(objective: str, best: Candidate, eligible: list[Candidate]) -> Candidate:
    """Among the layouts within NEAR_TIE of the best on the objective's measure, the best on the other."""
    bound = _measures(objective, best)[0] * (1 + NEAR_TIE)
    near = [c for c in eligible if _measures(objective, c)[0] <= bound]
    return min(near, key=lambda c: _measures(objective, c)[::-1])


@dataclass(frozen=True)
class BatchCap:
    """The global batch keeps plans off part of the pool: each data-parallel rank takes whole sequences."""

    global_batch: int
    gpus: int  # the most GPUs the global batch splits over evenly
    pool_gpus: int  # the most the pool (and maxGPUs) offers
    batch_for_pool: int  # the smallest global batch from this one up that splits over them all

    def note(self) -> str:
        if self.gpus == self.global_batch:
            limit = f"allows at most {self.gpus} data-parallel ranks at micro-batch 1"
        else:
            limit = (f"splits into whole sequences over at most {self.gpus} GPUs (powers of two within a node, "
                     "whole nodes beyond)")
        return (f"globalBatchSize {self.global_batch} {limit}; {self.batch_for_pool} would let it use all "
                f"{self.pool_gpus} GPUs")


def batch_cap(w: Workload, pool: Pool, max_gpus: int) -> BatchCap | None:
    counts = [gpus for gpus, _ in gpu_counts(pool, max_gpus)]
    dividing = max(g for g in counts if w.global_batch % g == 0)  # 1 always does
    if dividing == max(counts):
        return None
    return BatchCap(w.global_batch, dividing, max(counts), math.ceil(w.global_batch / max(counts)) * max(counts))


def _describe(c: Candidate) -> str:
    lay = c.layout
    return (f"{lay.strategy} on {lay.gpus} GPU{'s' if lay.gpus > 1 else ''}"
            f"{f' ({lay.nodes} nodes)' if lay.nodes > 1 else ''}"
            f"{f' in groups of {lay.shard_group}' if lay.strategy == 'hsdp' else ''}"
            f", micro-batch {lay.micro_batch} x {lay.grad_accum}"
            f"{', activation checkpointing' if lay.activation_checkpointing else ''}"
            f"{' (every other block)' if lay.activation_checkpointing and lay.checkpoint_every == 2 else ''}"
            f"{', weights kept unsharded until backward' if not lay.reshard_after_forward else ''}"
            f"{', CPU offload' if lay.cpu_offload else ''}")


def plan(w: Workload, pool: Pool, cal: Calibration, objective: str = "cheapest", strategy: str = "auto",
         max_gpus: int | None = None, budget_usd: float | None = None,
         deadline_seconds: float | None = None, evidence: Evidence | None = None) -> JobPlan:
    """The best layout by `objective`; with `evidence` (calibration.evidence()), its predictions' band."""
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
    if w.precision == "fp8" and not w.model.gated_mlp:
        raise NoPlan(f"precision fp8: {w.model.name}'s blocks are GPT-2's Conv1D layers, which the FP8 products do "
                     "not replace (they replace nn.Linear): set resources.precision bf16")
    if w.precision == "fp8" and not pool.gpu.fp8_flops:
        raise NoPlan(f"precision fp8: the {pool.gpu.name} has no FP8 tensor cores (they came with Ada and Hopper): "
                     "set resources.precision bf16, or plan on a pool of H100, H200, L40S or L4")
    if w.method == "qlora":
        if strategy not in ("auto", *QLORA_STRATEGIES):
            raise NoPlan(f"strategy {strategy}: the runtime does not shard a 4-bit (nf4) base; it trains it on one "
                         "GPU (single) or a whole copy on each (ddp): set resources.strategy auto, single or ddp, "
                         "or method.lora.quantization none")
        strategies = tuple(s for s in strategies if s in QLORA_STRATEGIES)

    best_per_strategy: dict[str, Candidate] = {}  # on the objective's measure alone
    eligible: dict[str, list[Candidate]] = {}  # fit, and meet the budget or deadline: for near ties
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
        if objective == "fastest-within-budget" and budget_usd is not None and c.cost_usd > budget_usd:
            continue
        if (objective == "cheapest-within-deadline" and deadline_seconds is not None
                and c.duration_seconds > deadline_seconds):
            continue
        eligible.setdefault(s, []).append(c)
        if s not in best_per_strategy or _better(objective, c, best_per_strategy[s]):
            best_per_strategy[s] = c

    cap = batch_cap(w, pool, limit)
    rejected = _rejections(strategies, best_per_strategy, smallest_per_strategy, cheapest_fit, fastest_fit, pool,
                           objective, budget_usd, deadline_seconds,
                           lambda s: _no_gpu_count(s, w.global_batch, pool, limit,
                                                   max_gpus is not None and max_gpus < pool.max_gpus))
    if not best_per_strategy:
        raise NoPlan("no layout works: " + "; ".join(f"{r.strategy}: {r.reason}" for r in _noting(rejected, cap)))
    best = min(best_per_strategy.values(), key=lambda c: _measures(objective, c))
    chosen = break_near_tie(objective, best, [c for cs in eligible.values() for c in cs])
    # each other strategy at its best by the same rule, and the layout a near tie passed over
    shown = [break_near_tie(objective, c, eligible[s]) for s, c in sorted(best_per_strategy.items())
             if s != chosen.layout.strategy]
    passed_over = [best] if all(best is not c for c in (chosen, *shown)) else []
    for c in shown + passed_over:
        rejected.append(RejectedOption(strategy=c.layout.strategy, gpus=c.layout.gpus,
                                       reason=_compare(c, chosen, objective)))
    made = _to_plan(w, chosen, best, pool, objective, _noting(rejected, cap), cap, evidence)
    if w.precision == "fp8":
        try:  # bf16 products may be best on another layout (FP8 holds its casts: less room for a micro-batch)
            bf16_plan: JobPlan | None = plan(replace(w, precision="bf16"), pool, cal, objective, strategy, max_gpus,
                                             budget_usd, deadline_seconds)
        except NoPlan:
            bf16_plan = None
        made = made.model_copy(update={"precision": "fp8", "explanation": (
            f"{made.explanation} {_fp8_pays(w, chosen, pool, cal, objective, bf16_plan)}")})
    return made


def _fp8_pays(w: Workload, c: Candidate, pool: Pool, cal: Calibration, objective: str,
              bf16_plan: JobPlan | None) -> str:
    """Whether FP8 pays: its step against the same layout's with bf16 products, then, by the objective's
    measure, against the plan bf16 products would have had on a layout of their own."""
    bf16 = estimate(replace(w, precision="bf16"), c.layout, pool, cal).step_seconds
    fp8 = c.estimate.step_seconds
    verdict = (f"pays: {bf16 / fp8 - 1:.0%} faster" if fp8 < bf16 * (1 - NEAR_TIE)
               else f"does not pay here: {fp8 / bf16 - 1:+.0%} (its casts cost what its products save)")
    said = (f"fp8: step {fp8:.3f} s against {bf16:.3f} s with bf16 products on this layout, so it {verdict}; "
            "the FP8 rate at the bf16 matmul efficiency; the activations' casts at the bytes one H100 run measured "
            "(Llama-8B LoRA, 1.24x bf16; Llama-1B's, left out of the fit, within 3.3%).")
    if bf16_plan is None or bf16_plan.predicted is None:
        return f"{said} bf16 products have no plan here."
    other = bf16_plan.predicted
    if objective.startswith("cheapest"):
        ours, theirs, measure, better = c.cost_usd, other.cost_usd, "cost", "cheaper"
    else:
        ours, theirs, measure, better = c.duration_seconds, other.duration_seconds, "duration", "faster"
    if (bf16_plan.strategy, bf16_plan.gpus, bf16_plan.micro_batch, bf16_plan.grad_accum) == (
            c.layout.strategy, c.layout.gpus, c.layout.micro_batch, c.layout.grad_accum):
        return said
    compared = (f"{1 - ours / theirs:.0%} {better}" if ours < theirs * (1 - NEAR_TIE) else
                f"no better by {measure} ({ours / theirs - 1:+.0%}): set resources.precision bf16")
    return (f"{said} bf16 products' own plan ({bf16_plan.strategy} on {bf16_plan.gpus} GPU(s), micro-batch "
            f"{bf16_plan.micro_batch}, step {other.step_seconds:.3f} s): fp8 is {compared}.")


def _noting(rejected: list[RejectedOption], cap: BatchCap | None) -> list[RejectedOption]:
    """The batch cap added to each rejection it limits: those at the cap, and those no GPU count suits."""
    if cap is None:
        return rejected
    return [r.model_copy(update={"reason": f"{r.reason}; {cap.note()}"}) if r.gpus in (None, cap.gpus) else r
            for r in rejected]


def _footprint(c: Candidate) -> tuple[float, float, int]:
    """To be minimized, in whole MiB; of equal footprints (a peak at the end of backward is the same at any
    micro-batch) the smallest micro-batch, so that no one need try lowering it."""
    if c.layout.cpu_offload:
        return (not c.fits_gpu, round(c.host_bytes_per_node / 2**20), c.layout.micro_batch)
    return (0, round(c.estimate.peak_memory_bytes / 2**20), c.layout.micro_batch)


def _does_not_fit(c: Candidate, pool: Pool) -> str:
    if not c.fits_gpu:
        need, usable = c.estimate.peak_memory_bytes / GIB, USABLE_MEMORY * pool.gpu.memory_gib
        return (f"{need:.0f} GiB at the {c.estimate.peak_moment} ({need * (1 + MEMORY_MARGIN):.0f} with the "
                f"{MEMORY_MARGIN:.0%} run-to-run margin) > {usable:.0f} GiB usable per {pool.gpu.name} even at "
                f"{_describe(c)}")
    need, usable = c.host_bytes_per_node / GIB, USABLE_HOST_MEMORY * pool.host_memory_per_node_gib
    return f"{need:.0f} GiB of host memory > {usable:.0f} GiB usable per node even at {_describe(c)}"


def _no_gpu_count(strategy: str, global_batch: int, pool: Pool, limit: int, capped: bool) -> str:
    """Why no layout of `strategy` exists at any GPU count the pool offers (up to `limit`)."""
    counts = [gpus for gpus, _nodes in gpu_counts(pool, limit)]
    offered = f"{max(counts)} GPU{'s' if max(counts) > 1 else ''}" + (" (resources.maxGPUs)" if capped else "")
    if strategy != "single" and max(counts) < 2:
        return f"{strategy} spreads over 2 GPUs or more, and this pool offers {offered}"
    shardable = [g for g, nodes in gpu_counts(pool, limit) if shard_groups(strategy, g, nodes, pool.gpus_per_node)]
    if strategy == "hsdp" and not shardable:
        return (f"hsdp shards within a group and replicates across 2 or more groups; this pool offers {offered} "
                f"({pool.gpus_per_node} a node): too few for two groups")
    fitting = shardable if strategy == "hsdp" else [g for g in counts if (g == 1) == (strategy == "single")]
    return (f"the global batch ({global_batch}) divides over none of the GPU counts this pool offers for it "
            f"({', '.join(map(str, fitting))}): set hyperparameters.globalBatchSize to a multiple of one")


def _rejections(strategies, best, smallest, cheapest, fastest, pool: Pool, objective, budget, deadline,
                no_gpu_count) -> list[RejectedOption]:
    out = []
    for s in strategies:
        if s in best:
            continue
        small, offloaded = smallest.get((s, False)), smallest.get((s, True))
        if small is None:
            out.append(RejectedOption(strategy=s, reason=no_gpu_count(s)))
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


def _link(e: Estimate) -> str:
    """The link that bounds a layout's collectives, with its bus bandwidth."""
    link = e.bounding_link
    assert link is not None, "called only where collectives run on a link"
    return f"{link.name} at {link.bus_bytes_per_s / 1e9:.3g} GB/s bus bandwidth"


def _near_tie(c: Candidate, chosen: Candidate, objective: str) -> str:
    """Why `c`, better on the objective's own measure, was passed over (see NEAR_TIE)."""
    if objective.startswith("cheapest"):
        return (f"{1 - c.cost_usd / chosen.cost_usd:.2%} cheaper but takes "
                f"{c.duration_seconds / chosen.duration_seconds:.2f}x as long: within {NEAR_TIE:.0%} of the "
                f"cheapest cost the fastest layout is chosen")
    return (f"{1 - c.duration_seconds / chosen.duration_seconds:.2%} faster but costs "
            f"{c.cost_usd / chosen.cost_usd:.2f}x as much: within {NEAR_TIE:.0%} of the fastest duration the "
            f"cheapest layout is chosen")


def _compare(c: Candidate, chosen: Candidate, objective: str) -> str:
    e = c.estimate
    parts = []
    if e.exposed_comm_share > COMM_BOUND:
        parts.append(f"communication-bound: {e.exposed_comm_share:.0%} of the step exposed, on {_link(e)}")
    if _measures(objective, c)[0] < _measures(objective, chosen)[0]:
        parts.append(_near_tie(c, chosen, objective))
    else:
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


def _exposed(e: Estimate) -> str:
    """What the exposed communication is made of, in the model's terms (comm.py)."""
    parts = []
    if e.exposed_ends_seconds > 0:
        parts.append(f"the first gathers and last reductions of each micro-batch ({e.exposed_ends_seconds:.3f} s)")
    if e.outlasting_forward_blocks:
        parts.append(f"{e.outlasting_forward_blocks} blocks whose gather outlasts the forward it runs under")
    if e.outlasting_backward_blocks:
        parts.append(f"{e.outlasting_backward_blocks} whose backward collectives outlast their backward")
    return f"; exposed: {', '.join(parts)}" if parts else ""


def _communication(e: Estimate) -> str:
    shares = f"{e.comm_share:.0%} of the step in collectives, {e.exposed_comm_share:.0%} exposed"
    if e.bounding_link is None:
        return shares
    if e.bounding_link_seconds >= e.comm_seconds:
        return f"{shares}, all on {_link(e)}{_exposed(e)}"
    return (f"{shares}; bound by {_link(e)}: {e.bounding_link_seconds / e.step_seconds:.0%} of the step, "
            f"{e.bounding_link_exposed_seconds / e.step_seconds:.0%} exposed{_exposed(e)}")


def prediction_band(w: Workload, c: Candidate, pool: Pool, evidence: Evidence) -> PredictionBand:
    b = band(evidence, pool.gpu.name, c.layout.gpus, pool.inter_node if c.layout.nodes > 1 else None, w.seq_len,
             w.method, pool.gpu.windows_on(c.layout.gpus), w.objective, w.optimizer_state, w.precision,
             c.layout.cpu_offload)
    (tps_low, tps_high), (step_low, step_high) = b.around(c.tokens_per_second), b.around(c.estimate.step_seconds, True)
    (duration_low, duration_high), (cost_low, cost_high) = (b.around(c.duration_seconds, True),
                                                            b.around(c.cost_usd, True))
    return PredictionBand(tokens_per_second_low=tps_low, tokens_per_second_high=tps_high, step_seconds_low=step_low,
                          step_seconds_high=step_high, duration_seconds_low=duration_low,
                          duration_seconds_high=duration_high, cost_usd_low=cost_low, cost_usd_high=cost_high,
                          basis=b.basis)


def _preference(w: Workload, c: Candidate) -> str:
    """What dpo adds to a step, and where its reference is."""
    lay, e = c.layout, c.estimate
    pairs = f"{lay.micro_batch} pair{'s' if lay.micro_batch != 1 else ''}"
    if w.reference_copy:
        held = (f"{e.memory_breakdown[REFERENCE_WEIGHTS] / GIB:.1f} GiB per GPU" if REFERENCE_WEIGHTS in e.memory_breakdown
                else "in host memory with the other states")
        reference = f"a frozen bf16 copy of the weights{' sharded like them' if lay.shard_group > 1 else ''} ({held})"
    else:
        reference = "the base with the adapters off (no copy held)"
    return (f"dpo: chosen and rejected per example, plus the reference forward: a micro-batch of {pairs} is "
            f"{lay.micro_batch * w.sequences_per_example} sequences through the policy's forward and backward and the "
            f"reference's forward, and tokens/s counts both sequences' tokens; the reference is {reference}.")


def _to_plan(w: Workload, c: Candidate, best: Candidate, pool: Pool, objective: str, rejected: list[RejectedOption],
             cap: BatchCap | None, evidence: Evidence | None) -> JobPlan:
    e, lay, m = c.estimate, c.layout, w.model
    mfu = c.tokens_per_second / lay.gpus * m.flops_per_token(w.seq_len, w.method, w.objective) / pool.gpu.bf16_flops
    spread = prediction_band(w, c, pool, evidence) if evidence else None
    predicted = Predicted(
        peak_memory_gib=e.peak_memory_bytes / GIB, step_seconds=e.step_seconds, matmul_seconds=e.matmul_seconds,
        memory_bound_seconds=e.memory_bound_seconds, optimizer_seconds=e.optimizer_seconds,
        comm_seconds=e.comm_seconds, exposed_comm_seconds=e.exposed_comm_seconds,
        offload_seconds=e.offload_seconds, exposed_offload_seconds=e.exposed_offload_seconds,
        host_memory_gib_per_node=c.host_bytes_per_node / GIB, comm_share=e.comm_share,
        exposed_comm_share=e.exposed_comm_share, mfu=mfu, tokens_per_second=c.tokens_per_second,
        duration_seconds=c.duration_seconds, cost_usd=c.cost_usd,
        memory_breakdown_gib={k: v / GIB for k, v in e.memory_breakdown.items()}, memory_margin=MEMORY_MARGIN,
        band=spread,
    )
    # named by the largest part of the step (a step can be bound by two at once: say the larger)
    regime = max([("compute-bound", e.matmul_seconds), ("memory-bandwidth-bound", e.memory_bound_seconds),
                  ("bound by the host's optimizer step" if lay.cpu_offload else "bound by the optimizer step",
                   e.optimizer_seconds),
                  ("communication-bound", e.exposed_comm_seconds),
                  ("bound by host copies", e.exposed_offload_seconds)], key=lambda part: part[1])[0]
    transient = TRANSIENT_TERMS[e.peak_moment]
    states = sum(v for k, v in e.memory_breakdown.items() if k not in transient) / GIB
    rest = "activations and logits" if "activations" in transient else "gradients"
    offload = (f"; {c.host_bytes_per_node / GIB:.0f} GiB of states per node in host memory (of "
               f"{USABLE_HOST_MEMORY * pool.host_memory_per_node_gib:.0f} GiB usable), "
               f"{e.exposed_offload_seconds:.3f} s of host copies exposed" if lay.cpu_offload else "")
    explanation = (
        f"{_describe(c)} ({objective}): {predicted.peak_memory_gib:.1f} GiB per {pool.gpu.name} at the "
        f"{e.peak_moment} ({states:.1f} GiB weights and optimizer, the rest {rest}), "
        f"{predicted.peak_memory_gib * (1 + MEMORY_MARGIN):.1f} GiB with the {MEMORY_MARGIN:.0%} run-to-run margin, "
        f"of {USABLE_MEMORY * pool.gpu.memory_gib:.0f} GiB usable{offload}; {regime}: step {e.step_seconds:.3f} s = "
        f"{e.matmul_seconds:.3f} matmul + {e.memory_bound_seconds:.3f} memory-bound + "
        f"{e.optimizer_seconds:.3f} optimizer + {e.exposed_comm_seconds:.3f} exposed communication "
        f"({_communication(e)})"
        f"{f' + {e.exposed_offload_seconds:.3f} exposed host copies' if lay.cpu_offload else ''}"
        f"{f' + {e.sync_seconds:.3f} waiting for the slowest of {lay.gpus} ranks' if e.sync_seconds else ''}; "
        f"{c.tokens_per_second:,.0f} tokens/s, MFU {mfu:.0%}, {math.ceil(c.duration_seconds / 60)} min, "
        f"${c.cost_usd:,.2f}."
    )
    if w.objective == "dpo":
        explanation += f" {_preference(w, c)}"
    if spread is not None:
        explanation += (f" Likely {spread.tokens_per_second_low:,.0f}-{spread.tokens_per_second_high:,.0f} tokens/s, "
                        f"{math.ceil(spread.duration_seconds_low / 60)}-{math.ceil(spread.duration_seconds_high / 60)} "
                        f"min, ${spread.cost_usd_low:,.2f}-${spread.cost_usd_high:,.2f} ({spread.basis}).")
    if c is not best:
        explanation += f" Near tie: {_describe(best)} is {_near_tie(best, c, objective)}."
    if cap is not None and lay.gpus == cap.gpus:
        explanation += f" The global batch holds it to {cap.gpus} GPUs: {cap.note()}."
    return JobPlan(pool=pool.name, strategy=lay.strategy, workers=lay.gpus, gpus=lay.gpus, nodes=lay.nodes,
                   micro_batch=lay.micro_batch, grad_accum=lay.grad_accum,
                   activation_checkpointing=lay.activation_checkpointing,
                   activation_checkpointing_every=lay.checkpoint_every,
                   reshard_after_forward=lay.reshard_after_forward, shard_group=lay.shard_group,
                   link_bus_bytes_per_s=(pool.inter_node if lay.nodes > 1 and pool.inter_node
                                         else pool.intra_node).bus_bytes_per_s,
                   cpu_offload=lay.cpu_offload, predicted=predicted, explanation=explanation, rejected=rejected)
