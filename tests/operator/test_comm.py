"""The per-unit communication model (planner/comm.py): pure arithmetic, checked as tables."""

import math

import pytest

from tunewright_core.planner.comm import (
    Group,
    UnitBytes,
    UnitCompute,
    group_link,
    ring_seconds,
    step_comm,
)
from tunewright_core.planner.estimate import Layout, groups
from tunewright_core.planner.hardware import GPUS, LINKS, Link, Pool

NVLINK, IB, ETH = LINKS["nvlink4"], LINKS["ib-8x400g"], LINKS["eth-100g"]
LINK = Link("test link", 100e9, 10e-6)


def pool(nodes=4, inter=ETH, per_node=8) -> Pool:
    return Pool("p", GPUS["H100"], per_node, nodes, NVLINK, inter, 1.0)


@pytest.mark.parametrize(("nbytes", "ranks", "all_reduce", "seconds"), [
    (1e9, 1, False, 0.0),  # nothing to exchange
    (1e9, 2, False, 10e-6 + 0.5 * 1e9 / 100e9),  # one ring step, half the bytes
    (1e9, 8, False, 7 * 10e-6 + 7 / 8 * 1e9 / 100e9),
    (1e9, 8, True, 2 * (7 * 10e-6 + 7 / 8 * 1e9 / 100e9)),  # all-reduce: reduce-scatter then all-gather
    # 512 ranks, 1 MB: 511 steps of latency dwarf the transfer (an effective bus bandwidth of ~0.2 GB/s)
    (1e6, 512, False, 511 * 10e-6 + 511 / 512 * 1e6 / 100e9),
])
def test_a_ring_pays_latency_per_step_and_bytes_at_the_bus_bandwidth(nbytes, ranks, all_reduce, seconds):
    assert ring_seconds(nbytes, Group(ranks, 1), LINK, all_reduce) == pytest.approx(seconds)


@pytest.mark.parametrize(("group", "expected"), [
    (Group(8, 1), NVLINK),  # within a node
    (Group(32, 4), ETH),  # across nodes: the slower hop
    (Group(4, 4, concurrent=8), Link(f"{ETH.name}, shared by 8 groups", ETH.bus_bytes_per_s / 8, ETH.latency_s)),
    (Group(16, 2), NVLINK),  # 8 x 400 Gb/s InfiniBand is as fast as NVLink's share: NVLink, lower latency
])
def test_the_hop_that_bounds_a_ring(group, expected):
    inter = IB if expected is NVLINK and group.crosses_nodes else ETH
    found = group_link(group, pool(inter=inter))
    if expected is NVLINK and group.crosses_nodes:  # IB at 360 GB/s ties NVLink: the higher latency bounds
        assert found == IB
    else:
        assert found == expected


@pytest.mark.parametrize(("layout", "shard", "replica"), [
    (Layout("fsdp", 32, 4, 1, 1, False, shard_group=32), Group(32, 4), Group(1, 1)),
    (Layout("hsdp", 32, 4, 1, 1, False, shard_group=8), Group(8, 1), Group(4, 4, concurrent=8)),
    (Layout("hsdp", 32, 4, 1, 1, False, shard_group=16), Group(16, 2), Group(2, 2, concurrent=8)),
    (Layout("hsdp", 32, 4, 1, 1, False, shard_group=2), Group(2, 1), Group(16, 4, concurrent=2)),
    (Layout("ddp", 32, 4, 1, 1, False), Group(1, 1), Group(32, 4)),  # one group through every GPU
    (Layout("ddp", 8, 1, 1, 1, False), Group(1, 1), Group(8, 1)),
])
def test_a_layouts_shard_and_replica_groups_as_the_device_mesh_lays_them_out(layout, shard, replica):
    assert groups(layout, pool()) == (shard, replica)


COMPUTE = UnitCompute(block_forward=0.010, block_backward=0.020, root_forward=0.005, root_backward=0.010)


EIGHT, ALONE = Group(8, 1), Group(1, 1)


def comm(block_weights, layers=10, micro=1, shard=EIGHT, replica=ALONE, reshard=True, jitter=0.0,
         block_gradients=0.0):
    return step_comm(layers, micro, COMPUTE, UnitBytes(block_weights, block_gradients, 0.0, 0.0), shard, replica,
                     pool(nodes=1, inter=None), reshard, jitter)


def test_collectives_shorter_than_compute_expose_only_the_ends():
    gather = ring_seconds(1e8, Group(8, 1), NVLINK)
    assert gather < COMPUTE.block_forward
    c = comm(1e8)
    assert c.total_seconds == pytest.approx(20 * gather)  # 10 blocks, gathered for forward and for backward
    assert c.exposed_seconds == pytest.approx(gather) == pytest.approx(c.ends_seconds)  # the first gather
    assert (c.outlasting_forward, c.outlasting_backward) == (0, 0)


def test_a_gather_longer_than_the_compute_it_hides_under_exposes_the_difference_per_block():
    gather = ring_seconds(6e9, Group(8, 1), NVLINK)
    assert COMPUTE.block_forward < gather
    c = comm(6e9)
    forward = gather + 9 * (gather - COMPUTE.block_forward)
    backward = max(0.0, gather - COMPUTE.root_backward) + 9 * max(0.0, gather - COMPUTE.block_backward)
    assert c.exposed_seconds == pytest.approx(forward + backward)
    assert c.outlasting_forward == 9 and c.outlasting_backward == (9 if gather > COMPUTE.block_backward else 0)


def test_weights_kept_unsharded_until_backward_gather_once():
    assert comm(1e9, reshard=False).total_seconds == pytest.approx(comm(1e9).total_seconds / 2)


def test_replicas_all_reduce_on_the_last_micro_batch_only():
    once = comm(0.0, micro=1, shard=Group(1, 1), replica=Group(8, 1), block_gradients=4e8)
    four = comm(0.0, micro=4, shard=Group(1, 1), replica=Group(8, 1), block_gradients=4e8)
    assert once.replica_seconds > 0 and four.replica_seconds == pytest.approx(once.replica_seconds)
    assert four.exposed_seconds == pytest.approx(once.exposed_seconds)


@pytest.mark.parametrize("ranks", [2, 8, 64, 512])
def test_waiting_for_the_slowest_rank_grows_with_the_ranks(ranks):
    c = comm(0.0, shard=Group(ranks, 1), jitter=0.01)
    step_compute = 10 * (COMPUTE.block_forward + COMPUTE.block_backward) + COMPUTE.root_forward + COMPUTE.root_backward
    assert c.sync_seconds == pytest.approx(0.01 * math.sqrt(2 * math.log(ranks)) * step_compute)
    assert comm(0.0, shard=Group(1, 1), jitter=0.01).sync_seconds == 0.0
