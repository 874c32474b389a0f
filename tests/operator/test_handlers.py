"""The kopf handlers are thin: each hands the object to the reconciler or the pool discovery; at startup the
operator checks that the cluster's CRDs take what it writes."""

import copy
import logging
import threading
import time

import kopf
import pytest

from tests.operator.test_reconcile import POOL, SETTINGS, finetunejob
from tests.support.fake_cluster import FakeCluster
from tunewright_core.crds import SCHEMA_DIGEST, crds
from tunewright_core.k8s import KubernetesError
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


class Refusing(FakeCluster):
    """A cluster answering every read of a CRD with one HTTP status."""

    def __init__(self, status: int):
        super().__init__()
        self.status = status

    def get(self, kind, namespace, name):
        if kind == "CustomResourceDefinition":
            raise KubernetesError(self.status, "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
                                  "{}")
        return super().get(kind, namespace, name)


def cluster_with(*installed: dict) -> FakeCluster:
    cluster = FakeCluster()
    for crd in installed:
        cluster.add(crd)
    return cluster


def test_the_operator_starts_on_this_releases_crds_and_on_later_ones_that_only_add_fields():
    jobs, pools = copy.deepcopy(list(crds().values()))
    handlers.check_crds(cluster_with(jobs, pools))
    later = copy.deepcopy(pools)  # a later release's: another digest, one more field
    later["metadata"]["annotations"][SCHEMA_DIGEST] = "sha256:0123456789abcdef"
    later["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["zone"] = {
        "type": "string"}
    handlers.check_crds(cluster_with(jobs, later))


def test_the_operator_stops_on_crds_that_would_refuse_what_it_writes_naming_the_fields_and_the_fix():
    jobs, pools = copy.deepcopy(list(crds().values()))
    older = copy.deepcopy(pools)
    del older["metadata"]["annotations"][SCHEMA_DIGEST]  # a chart from before digests
    status = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    del status["measuredEfficiency"]
    status["nodes"]["type"] = "string"
    with pytest.raises(kopf.PermanentError) as stopped:
        handlers.check_crds(cluster_with(jobs, older))
    message = str(stopped.value)
    assert message.startswith("gpupools.tunewright.dev is another release's and would refuse or prune what this "
                              "one writes (.status.nodes: type string, not integer; .status.measuredEfficiency: "
                              "missing)"), message
    assert "| kubectl apply --server-side --force-conflicts -f -`" in message and "finetunejobs" not in message


def test_the_operator_waits_for_missing_crds_and_for_an_api_server_that_fails_but_not_for_a_missing_grant(caplog):
    jobs, _pools = copy.deepcopy(list(crds().values()))
    with pytest.raises(kopf.TemporaryError, match="waiting for the CRDs gpupools.tunewright.dev to be installed"):
        handlers.check_crds(cluster_with(jobs))
    with pytest.raises(kopf.TemporaryError, match="reading the CRDs to check them: GET .*: 500"):
        handlers.check_crds(Refusing(500))
    handlers.check_crds(Refusing(403))  # an install that did not grant the read: not checked, said so
    assert "the CRDs were not checked against this release's" in caplog.text


def test_pools_are_rediscovered_each_interval_until_stopped():
    node = {"kind": "Node", "metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
    memo = memo_with(POOL)
    stop = threading.Event()
    loop = threading.Thread(target=handlers.rediscover_pools, args=(memo.cluster, stop, 0.01))
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while (memo.cluster.get("GPUPool", None, "h100").get("status") or {}).get("nodes") != 0:
            assert time.monotonic() < deadline, "no discovery"
            time.sleep(0.01)
        memo.cluster.add(node)  # a node joins; the pool itself does not change
        while memo.cluster.get("GPUPool", None, "h100")["status"]["nodes"] != 1:
            assert time.monotonic() < deadline, "the new node was not found"
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join(5)
    assert not loop.is_alive()


def test_pool_discovery_outlives_an_api_server_that_is_away():
    class Away(FakeCluster):
        def __init__(self):
            super().__init__()
            self.tries = 0

        def list(self, kind, namespace=None, label_selector=None):
            if kind == "GPUPool":
                self.tries += 1
                if self.tries <= 2:  # a connection refused is no KubernetesError
                    raise ConnectionRefusedError("the API server is restarting")
            return super().list(kind, namespace, label_selector)

    cluster = Away()
    cluster.add(POOL)
    stop = threading.Event()
    loop = threading.Thread(target=handlers.rediscover_pools, args=(cluster, stop, 0.01))
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while (cluster.get("GPUPool", None, "h100").get("status") or {}).get("nodes") != 0:
            assert time.monotonic() < deadline and loop.is_alive(), "discovery ended with the API server away"
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join(5)
    assert cluster.tries > 2
