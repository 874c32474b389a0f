"""Pools that learn their links (issue 13): what a job's profiler windows measured of the link its collectives
crossed replaces the declared bandwidth in the next plans on that pool, where the pool opts in."""

import pytest
from sqlmodel import Session

from tunewright_api.db import make_engine, migrate
from tunewright_api.models import GpuPool, Job, Tenant
from tunewright_api.services.plans import plan_on, pool_of, profile_for
from tunewright_api.services.telemetry import apply
from tunewright_api.telemetry import CommRecord
from tunewright_core.planner.hardware import (
    LINK_WINDOWS_KEPT,
    LINKS,
    fold_measurement,
    learned,
    measured_bus_bytes_per_s,
)
from tunewright_core.pools import INTER_NODE
from tunewright_core.spec import FineTuneJobSpec

ETH = LINKS["eth-100g"]


@pytest.mark.parametrize(("predicted", "transfer", "bus"), [
    (1.0, 1.0, ETH.bus_bytes_per_s),  # as declared
    (1.0, 4.0, ETH.bus_bytes_per_s / 4),  # the collectives took 4x the predicted time: a quarter of the link
    (0.0, 1.0, None),  # nothing predicted to communicate: nothing to learn
    (1.0, 0.0, None),  # nothing measured
])
def test_the_measured_bandwidth_is_what_makes_the_prediction_match(predicted, transfer, bus):
    assert measured_bus_bytes_per_s(ETH, predicted, transfer) == (bus and pytest.approx(bus))


def test_windows_fold_into_a_running_mean_that_forgets_the_oldest():
    record = None
    for bus in (4e9, 6e9):
        record = fold_measurement(record, bus, "ftjob-a", 1.0)
    assert (record["busBytesPerSecond"], record["windows"]) == (5e9, 2)
    for _ in range(2 * LINK_WINDOWS_KEPT):
        record = fold_measurement(record, 8e9, "ftjob-b", 2.0)
    assert record["windows"] == LINK_WINDOWS_KEPT and record["busBytesPerSecond"] == pytest.approx(8e9, rel=0.15)
    assert record["lastJob"] == "ftjob-b"
    link = learned(ETH, record)
    assert link.bus_bytes_per_s == record["busBytesPerSecond"] and "as measured over" in link.name and "declared 11.2 GB/s" in link.name
    assert learned(ETH, None) is ETH


SPEC = {"model": {"source": "hf://meta-llama/Llama-3.1-70B"}, "method": {"type": "full"},
        "dataset": {"train": "file-1", "format": "text"},
        "hyperparameters": {"maxSteps": 100, "seqLen": 4096, "globalBatchSize": 128},
        "resources": {"pool": "eth4x8", "budgetUSD": 100000}}  # the fastest within it: over 4 nodes


@pytest.mark.parametrize("learns", [True, False])
def test_a_window_teaches_an_opted_in_pool_its_link_and_the_next_plan_uses_it(tmp_path, learns):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    spec = FineTuneJobSpec.model_validate(SPEC)
    profile = profile_for(spec.model.source, param="model.source")
    with Session(engine) as session:
        pool = GpuPool(name="eth4x8", gpu="H100", gpus_per_node=8, max_nodes=4, intra_node="nvlink4",
                       inter_node="eth-100g", price_per_gpu_hour=4.0, host_memory_gib=2048, learn_links=learns)
        tenant = Tenant(name="alice")
        session.add_all([pool, tenant])
        session.flush()
        before = plan_on(spec=spec, profile=profile, pool=pool_of(pool), dataset_tokens=None, spec_param=None)
        assert before.nodes > 1 and before.predicted.comm_seconds > 0
        job = Job(tenant_id=tenant.id, model="llama-70b", spec=SPEC, plan=before)
        session.add(job)
        session.flush()
        # the collectives took twice the predicted time, a fifth of it waiting for the slowest rank
        comm = 2.5 * before.predicted.comm_seconds
        apply(session, job, CommRecord(event="comm", step=10, time=1e9, profiled_steps=2, profiled_step_seconds=100.0,
                                       comm_share=0.5, comm_share_exposed=0.3, comm_seconds_per_step=comm,
                                       exposed_comm_seconds_per_step=0.3 * 100, comm_share_max_rank=0.5,
                                       comm_share_exposed_max_rank=0.3, wait_seconds_per_step=comm / 5,
                                       transfer_seconds_per_step=comm * 4 / 5))
        session.commit()
        session.refresh(pool)
        if not learns:
            assert pool.measured_links is None
            return
        assert set(pool.measured_links) == {INTER_NODE}  # several nodes: the Ethernet bounds the ring
        assert pool.measured_links[INTER_NODE]["busBytesPerSecond"] == pytest.approx(ETH.bus_bytes_per_s / 2)
        assert pool.measured_links[INTER_NODE]["lastJob"] == job.id
        after = plan_on(spec=spec, profile=profile, pool=pool_of(pool), dataset_tokens=None, spec_param=None)
        assert (f"Ethernet 100 Gb/s per node (as measured over 1 profiler window; declared "
                f"{ETH.bus_bytes_per_s / 1e9:.3g} GB/s) at {ETH.bus_bytes_per_s / 2e9:.3g} GB/s bus bandwidth"
                in after.explanation)
        assert after.predicted.step_seconds > before.predicted.step_seconds  # half the bandwidth it declared
        assert pool_of(pool).intra_node == LINKS["nvlink4"]  # untouched: nothing measured within a node
        pool.learn_links = False  # opting out plans on the declared links again, what was learnt is kept
        assert pool_of(pool).inter_node == ETH and pool.measured_links


GPUPOOL = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "eth4x8"},
           "spec": {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 4, "intraNode": "nvlink4", "interNode": "eth-100g",
                    "pricePerGPUHour": 4.0, "hostMemoryGiB": 2048, "workerImage": "w:1"}}


@pytest.mark.parametrize("learns", [True, False])
def test_a_gpupool_that_learns_keeps_its_links_in_its_status_and_the_next_plan_uses_them(emulated_cluster, learns):
    """The cluster's pools: the API folds a window into the GPUPool's status.measuredLinks (its only write to
    a GPUPool), the operator's discovery leaves them there, and plans (the API's and the operator's) use them."""
    from tests.support.emulated import client_for
    from tunewright_api.backends.kubernetes import KubernetesBackend
    from tunewright_api.settings import Settings
    from tunewright_core.pools import discovered, resolve_pool
    from tunewright_core.spec import GPUPoolSpec

    cluster = client_for(emulated_cluster)
    cluster.create(GPUPOOL | {"spec": GPUPOOL["spec"] | {"learnLinks": learns}})
    backend = KubernetesBackend(Settings(backend="kubernetes"), engine=None, cluster=cluster)
    spec = FineTuneJobSpec.model_validate(SPEC)
    profile = profile_for(spec.model.source, param="model.source")
    before = plan_on(spec=spec, profile=profile, pool=backend.pool("eth4x8"), dataset_tokens=None, spec_param=None)
    job = Job(id="ftjob-gpupool", tenant_id="t", model="llama-70b", spec=SPEC, plan=before)
    comm = 2 * before.predicted.comm_seconds  # all transfer: the link gave half what it declares
    said = backend.learn_links(None, job, comm, 1e9)
    status = cluster.get("GPUPool", None, "eth4x8").get("status") or {}
    if not learns:
        assert said is None and "measuredLinks" not in status
        return
    assert said.startswith("pool eth4x8: eth-100g measured")
    assert backend.learn_links(None, job, comm, 1e9) is None  # the same window sent again: folded once
    (key,) = status["measuredLinks"]
    assert key == INTER_NODE and status["measuredLinks"][key]["busBytesPerSecond"] == pytest.approx(ETH.bus_bytes_per_s / 2)
    # the operator's discovery writes its own fields only
    cluster.patch_status("GPUPool", None, "eth4x8", discovered(GPUPoolSpec.model_validate(GPUPOOL["spec"]), []).model_dump(
        by_alias=True, mode="json", exclude_none=True))
    found = cluster.get("GPUPool", None, "eth4x8")
    assert found["status"]["measuredLinks"] == status["measuredLinks"] and found["status"]["nodes"] == 0
    after = plan_on(spec=spec, profile=profile, pool=backend.pool("eth4x8"), dataset_tokens=None, spec_param=None)
    assert "as measured over 1 profiler window" in after.explanation
    assert after.predicted.step_seconds > before.predicted.step_seconds
    measured = resolve_pool(spec, cluster).links  # what the operator plans with
    assert measured.inter_node.windows == 1 and measured.intra_node is None
    cluster.patch_status("GPUPool", None, "eth4x8", {"measuredLinks": None})  # forgetting them (README)
    assert "measuredLinks" not in cluster.get("GPUPool", None, "eth4x8")["status"]
    assert backend.pool("eth4x8").inter_node == ETH


def test_a_gpupool_that_cannot_be_written_costs_the_window_never_the_telemetry(emulated_cluster, monkeypatch, caplog):
    """An install whose API may not patch GPUPool status (a chart older than the learning): logged, no error."""
    from tests.support.emulated import client_for
    from tunewright_api.backends.kubernetes import KubernetesBackend
    from tunewright_api.settings import Settings
    from tunewright_core.k8s import KubernetesError

    cluster = client_for(emulated_cluster)
    cluster.create(GPUPOOL | {"spec": GPUPOOL["spec"] | {"learnLinks": True}})
    backend = KubernetesBackend(Settings(backend="kubernetes"), engine=None, cluster=cluster)
    spec = FineTuneJobSpec.model_validate(SPEC)
    plan = plan_on(spec=spec, profile=profile_for(spec.model.source, param="model.source"),
                   pool=backend.pool("eth4x8"), dataset_tokens=None, spec_param=None)
    job = Job(id="ftjob-denied", tenant_id="t", model="llama-70b", spec=SPEC, plan=plan)

    def forbidden(*args):
        raise KubernetesError(403, "PATCH", "/apis/tunewright.dev/v1alpha1/gpupools/eth4x8/status", "forbidden")
    monkeypatch.setattr(cluster, "patch_status", forbidden)
    assert backend.learn_links(None, job, plan.predicted.comm_seconds, 1e9) is None
    assert "pool eth4x8 did not learn from job ftjob-denied" in caplog.text
    one_gpu = job.model_copy(update={"plan": plan.model_copy(update={"gpus": 1, "nodes": 1})})
    monkeypatch.setattr(cluster, "get", lambda *args: pytest.fail("a one-GPU job's window asks the cluster nothing"))
    assert backend.learn_links(None, one_gpu, 1.0, 1e9) is None


def test_a_pool_that_has_learned_converges_on_the_true_bandwidth_not_between_it_and_the_declared():
    """A plan made on a pool that had learned predicts its collectives at the learned bandwidth: a window is
    scaled from that one (scaled from the declared one, windows of a link at a quarter of its declared rate
    would settle at half of it: sqrt(declared x true))."""
    from tunewright_core.planner import calibration
    from tunewright_core.planner.estimate import Workload
    from tunewright_core.planner.hardware import Pool, learned
    from tunewright_core.planner.models import CATALOG
    from tunewright_core.planner.search import plan
    from tunewright_core.pools import learnt_links

    cal, _ = calibration.load()
    true_bus = ETH.bus_bytes_per_s / 4
    work = Workload(CATALOG["meta-llama/Llama-3.1-70B"], "full", 4096, 128, 100)
    measured: dict = {}
    for window in range(6):
        link = learned(ETH, measured.get(INTER_NODE))
        pool = Pool("eth4x8", calibration.for_gpu("H100"), 8, 4, LINKS["nvlink4"], link, 2.5)
        chosen = plan(work, pool, cal, objective="fastest", strategy="fsdp", max_gpus=32)
        assert chosen.link_bus_bytes_per_s == link.bus_bytes_per_s
        # what the link delivers: the collectives take the predicted time scaled by planned / true bandwidth
        transfer = chosen.predicted.comm_seconds * link.bus_bytes_per_s / true_bus
        measured, _ = learnt_links(chosen, "eth4x8", "nvlink4", "eth-100g", measured, transfer, f"job-{window}",
                                   float(window))
    assert measured[INTER_NODE]["busBytesPerSecond"] == pytest.approx(true_bus, rel=1e-6)
