"""The kopf handlers are thin: each hands the object to the reconciler or the pool discovery."""

import logging

import kopf

from tests.operator.test_reconcile import POOL, SETTINGS, finetunejob
from tests.support.fake_cluster import FakeCluster
from tunewright_operator import handlers

LOG = logging.getLogger("test")


def memo_with(*objects) -> kopf.Memo:
    cluster = FakeCluster()
    for obj in objects:
        cluster.add(obj)
    return kopf.Memo(cluster=cluster, settings=SETTINGS, locks={})


def test_a_created_finetunejob_is_reconciled_and_a_rayjob_event_mirrors_it():
    memo = memo_with(POOL, finetunejob())
    handlers.finetunejob_changed(body=memo.cluster.get("FineTuneJob", "team-a", "llama-lora"), memo=memo, logger=LOG)
    (rayjob,) = memo.cluster.list("RayJob", "team-a")
    memo.cluster.objects[("RayJob", "team-a", rayjob["metadata"]["name"])]["status"] = {
        "jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    handlers.rayjob_changed(body=memo.cluster.get("RayJob", "team-a", rayjob["metadata"]["name"]), memo=memo,
                            logger=LOG)
    assert memo.cluster.get("FineTuneJob", "team-a", "llama-lora")["status"]["phase"] == "Running"
    handlers.finetunejob_deleted(body=memo.cluster.get("FineTuneJob", "team-a", "llama-lora"), memo=memo, logger=LOG)
    assert memo.cluster.count("RayJob") == 0


def test_a_pool_reports_its_nodes():
    node = {"kind": "Node", "metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
    memo = memo_with(POOL, node)
    handlers.gpupool_discovery(body=memo.cluster.get("GPUPool", None, "h100"), memo=memo)
    status = memo.cluster.get("GPUPool", None, "h100")["status"]
    assert (status["nodes"], status["allocatableGPUs"]) == (1, 8)
    assert status["disagreements"] == ["maxNodes is 2 but 1 node(s) match: plans larger than 1 node(s) will not "
                                       "schedule"]
