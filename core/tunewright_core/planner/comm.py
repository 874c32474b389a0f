"""A training step's collectives as FSDP2 issues them, and how much of them compute hides: pure arithmetic.

The runtime shards each decoder block as one FSDP unit and the rest of the model (embeddings, final norm,
head) as the root unit (jobs' parallel.shard_model); DDP is FSDP2 with shards of one GPU and HSDP shards
within a group and replicates across groups. Per micro-batch (the runtime reduces every micro-batch), per
unit:
- forward: an all-gather of the unit's weights in bf16 over the shard group;
- backward: the all-gather again, unless the weights stay unsharded from forward to backward; a
  reduce-scatter of its fp32 gradients over the shard group; with replicas (DDP, HSDP), on the step's last
  micro-batch only (parallel.gradient_sync), an all-reduce of the reduced shard across them.

A ring collective over n ranks costs (n - 1) ring steps, each paying the link's per-step latency, plus its
bytes at the link's bus bandwidth: small messages are latency-bound, and a collective over 512 ranks pays
511 steps, which no single whole-model transfer shows. A ring over several nodes runs at its slowest hop;
a node's NICs are shared by the groups that cross it at once (the k replica groups of HSDP or DDP, one per
local GPU, each get 1/k of them).

FSDP2 prefetches one unit ahead: unit i+1's gather runs under unit i's forward; in backward, unit i-1's
gather and unit i+1's reduce-scatter (and all-reduce) run under unit i's. What no compute hides is exposed:
the first gathers of the forward (the root's and the first block's), the last reductions of the backward,
and, for every unit, what its collectives take beyond the compute they run under.

Every rank waits for the slowest at each step's collectives: the expected maximum of n ranks' step-time
jitter grows as sqrt(2 ln n) (the maximum of n normal draws), so a step on n ranks is longer by
`sync_jitter` x sqrt(2 ln n) of its compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunewright_core.planner.hardware import Link, Pool

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Group:
    """The ranks one collective runs over, and where they are."""

    ranks: int
    nodes: int  # nodes the group spans
    concurrent: int = 1  # groups of this shape crossing the same nodes at once (sharing the NICs)

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def group_link(group: Group, pool: Pool) -> Link:
    """The hop that bounds a ring over `group`: NVLink (or PCIe) within a node; across nodes the slower of
    it and the node's network share this group gets."""
    if not group.crosses_nodes:
        return pool.intra_node
    inter = pool.inter_node or pool.intra_node
    shared = Link(inter.name if group.concurrent == 1 else f"{inter.name}, shared by {group.concurrent} groups",
                  inter.bus_bytes_per_s / group.concurrent, inter.latency_s)
    return min(pool.intra_node, shared, key=lambda link: (link.bus_bytes_per_s, -link.latency_s))


def ring_seconds(nbytes: float, group: Group, link: Link, all_reduce: bool = False) -> float:
    """One ring all-gather or reduce-scatter (or all-reduce: twice the steps and bytes) of `nbytes` (the
    whole, unsharded tensor): latency per ring step plus the bytes each rank moves at the bus bandwidth."""
    n = group.ranks
    if n <= 1 or nbytes <= 0:
        return 0.0
    passes = 2 if all_reduce else 1
    return passes * ((n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bus_bytes_per_s)


@dataclass(frozen=True)
class UnitCompute:
    """Compute seconds of one micro-batch that collectives can run under."""

    block_forward: float  # one decoder block's forward
    block_backward: float  # its backward (with its recompute under activation checkpointing)
    root_forward: float  # embeddings, head and loss
    root_backward: float


@dataclass(frozen=True)
class UnitBytes:
    """What one unit's collectives carry: its weights gathered in bf16, its trainable gradients in fp32."""

    block_weights: float
    block_gradients: float
    root_weights: float
    root_gradients: float


@dataclass(frozen=True)
class StepComm:
    """Collectives of one optimizer step."""

    total_seconds: float
    exposed_seconds: float
    ends_seconds: float  # of the exposed: the first gathers and the last reductions, every micro-batch
    outlasting_forward: int  # blocks whose gather outlasts the forward it runs under (per micro-batch)
    outlasting_backward: int  # blocks whose backward collectives outlast the backward they run under
    sync_seconds: float  # waiting for the slowest rank (jitter), per step
    shard_link: Link | None
    replica_link: Link | None
    shard_seconds: float  # of the total, on the shard group's link
    replica_seconds: float  # of the total, across replicas
    exposed_shard_seconds: float
    exposed_replica_seconds: float


def step_comm(layers: int, micro_batches: int, compute: UnitCompute, nbytes: UnitBytes, shard: Group,
              replica: Group, pool: Pool, reshard_after_forward: bool, sync_jitter: float,
              forwards: int = 1) -> StepComm:
    """The collectives of `micro_batches` micro-batches of a model of `layers` blocks, and their exposed part.

    `forwards`: forward passes per micro-batch, each gathering every unit as the first does (dpo's reference
    forward, before the policy's: the reference's own shards, or LoRA's base again); `compute.block_forward`
    is one pass's."""
    shard_link = group_link(shard, pool) if shard.ranks > 1 else None
    replica_link = group_link(replica, pool) if replica.ranks > 1 else None

    def gather(weights: float) -> float:
        return ring_seconds(weights, shard, shard_link) if shard_link else 0.0

    def reduce(gradients: float) -> tuple[float, float]:
        """(reduce-scatter in the shard group, all-reduce of the shard across replicas)."""
        scatter = ring_seconds(gradients, shard, shard_link) if shard_link else 0.0
        across = ring_seconds(gradients / shard.ranks, replica, replica_link, all_reduce=True) if replica_link else 0.0
        return scatter, across

    block_gather, root_gather = gather(nbytes.block_weights), gather(nbytes.root_weights)
    block_scatter, block_across = reduce(nbytes.block_gradients)
    root_scatter, root_across = reduce(nbytes.root_gradients)
    regather = block_gather if reshard_after_forward else 0.0
    # root's weights stay gathered through the step (FSDP2 does not reshard its root after forward)

    # forward: the root's and the first block's gathers precede any compute; block i+1's gather runs under
    # block i's forward
    outlast_forward = max(0.0, block_gather - compute.block_forward)
    forward_exposed = root_gather + block_gather + (layers - 1) * outlast_forward

    def backward(across: float, root_across: float) -> tuple[float, float, float]:
        """(exposed, of it the last reductions, the time each block's collectives outlast its backward):
        the root's backward (head and loss) hides the last block's re-gather; under each block's backward
        run the next block's gather and the previous block's reductions; the first block's reductions and
        the root's come after the last compute."""
        outlast = max(0.0, regather + block_scatter + across - compute.block_backward)
        last = block_scatter + across + root_scatter + root_across
        return max(0.0, regather - compute.root_backward) + (layers - 1) * outlast + last, last, outlast

    # the replicas' all-reduce rides on the last micro-batch's backward only
    plain_exposed, plain_last, plain_outlast = backward(0.0, 0.0)
    last_exposed, last_last, last_outlast = backward(block_across, root_across)
    exposed = micro_batches * forwards * forward_exposed + (micro_batches - 1) * plain_exposed + last_exposed
    ends = micro_batches * forwards * (root_gather + block_gather) + (micro_batches - 1) * plain_last + last_last

    shard_total = micro_batches * (layers * (forwards * block_gather + regather + block_scatter)
                                   + forwards * root_gather + root_scatter)
    replica_total = layers * block_across + root_across
    total = shard_total + replica_total
    # the exposed time split between the links in proportion to what each carries
    exposed_shard = exposed * shard_total / total if total else 0.0
    ranks = shard.ranks * replica.ranks
    step_compute = micro_batches * (layers * (forwards * compute.block_forward + compute.block_backward)
                                    + compute.root_forward + compute.root_backward)
    sync = sync_jitter * math.sqrt(2 * math.log(ranks)) * step_compute if ranks > 1 else 0.0
    return StepComm(
        total_seconds=total, exposed_seconds=exposed, ends_seconds=min(ends, exposed),
        outlasting_forward=(layers - 1) if outlast_forward > 0 else 0,
        outlasting_backward=(layers - 1) if max(plain_outlast, last_outlast) > 0 else 0,
        sync_seconds=sync, shard_link=shard_link, replica_link=replica_link,
        shard_seconds=shard_total, replica_seconds=replica_total,
        exposed_shard_seconds=exposed_shard, exposed_replica_seconds=exposed - exposed_shard)
