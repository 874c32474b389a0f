"""A GPUPool's status says what its nodes are and where they contradict its spec."""

import pytest

from tunewright_operator.pools import discovered, selector
from tunewright_operator.spec import GPUPoolSpec

POOL = GPUPoolSpec.model_validate({"gpu": "H100", "gpusPerNode": 8, "maxNodes": 2, "intraNode": "nvlink4",
                                   "nodeSelector": {"pool": "h100", "tier": "train"}, "pricePerGPUHour": 2.5,
                                   "workerImage": "w:1"})


def node(name, gpus=8, product="NVIDIA-H100-80GB-HBM3", memory="81559", unschedulable=False):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": memory} if product else {}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"unschedulable": unschedulable},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "96"}}}


@pytest.mark.parametrize(("nodes", "count", "allocatable", "disagreements"), [
    ([node("a"), node("b")], 2, 16, []),
    ([node("a"), node("b", gpus=4)], 2, 12, ["1 node(s) allocate fewer than gpusPerNode=8 GPUs: b"]),
    ([node("a"), node("b", product="NVIDIA-A100-SXM4-80GB")], 2, 16, ["nodes report GPU NVIDIA-A100-SXM4-80GB"]),
    ([node("a")], 1, 8, ["maxNodes is 2 but 1 node(s) match"]),
    ([node("a"), node("b", unschedulable=True)], 1, 8, ["maxNodes is 2 but 1 node(s) match"]),
    ([], 0, 0, ["no schedulable node matches the node selector pool=h100,tier=train"]),
    ([node("a", memory="40960"), node("b")], 2, 16, ["nodes report 40960 MiB per GPU"]),
    ([node("a", product=None), node("b", product=None)], 2, 16, []),  # no feature discovery: nothing to check
])
def test_discovery_reports_what_the_nodes_are_and_each_disagreement(nodes, count, allocatable, disagreements):
    status = discovered(POOL, nodes, generation=3)
    assert (status.nodes, status.allocatable_gpus, status.observed_generation) == (count, allocatable, 3)
    assert len(status.disagreements) == len(disagreements)
    for got, want in zip(status.disagreements, disagreements, strict=True):
        assert got.startswith(want), got


def test_the_selector_is_the_pools_node_selector():
    assert selector(POOL) == "pool=h100,tier=train"
