"""A GPUPool's status says what its nodes are and where they contradict its spec."""

import pytest

from tunewright_core.pools import discovered, selector
from tunewright_core.spec import GPUPoolSpec

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


def test_a_pool_plans_on_its_measured_links_only_where_it_learns_them():
    from tunewright_core.planner.hardware import LINKS
    from tunewright_core.pools import measured_links_of, planner_pool
    from tunewright_core.spec import MeasuredLinks

    measured = MeasuredLinks.model_validate({"intraNode": {"busBytesPerSecond": 1e11, "windows": 3, "lastJob": "j",
                                                           "measuredAt": 1.0}})
    learning = POOL.model_copy(update={"learn_links": True})
    assert planner_pool("p", learning, measured).intra_node.bus_bytes_per_s == 1e11
    assert "as measured over 3 profiler windows" in planner_pool("p", learning, measured).intra_node.name
    assert planner_pool("p", POOL, measured).intra_node == LINKS["nvlink4"]  # not opted in: as declared
    assert planner_pool("p", learning, None).intra_node == LINKS["nvlink4"]
    status = {"measuredLinks": measured.model_dump(by_alias=True, mode="json", exclude_none=True)}
    assert measured_links_of({"status": status}) == measured
    assert measured_links_of({}) is None
    assert measured_links_of({"status": {"measuredLinks": {"intraNode": {"windows": "many"}}}}) is None  # hand-edited


@pytest.mark.parametrize(("gpus", "nodes", "key"), [(1, 1, None), (8, 1, "intraNode"), (16, 2, "interNode")])
def test_a_window_teaches_the_link_its_collectives_crossed(gpus, nodes, key):
    from tunewright_core.pools import learnt_links
    from tunewright_core.spec import JobPlan, Predicted

    predicted = Predicted.model_construct(comm_seconds=0.5)
    plan = JobPlan.model_construct(device="gpu", gpus=gpus, nodes=nodes, predicted=predicted)
    learnt = learnt_links(plan, "p", "nvlink4", "eth-100g", {}, 1.0, "job-1", 5.0)
    if key is None:
        assert learnt is None
        return
    links, said = learnt
    assert list(links) == [key] and links[key]["windows"] == 1 and links[key]["lastJob"] == "job-1"
    assert said.startswith(f"pool p: {'eth-100g' if nodes > 1 else 'nvlink4'} measured")
