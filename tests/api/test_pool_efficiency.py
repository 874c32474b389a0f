"""Pools that learn their GPUs' compute efficiency (issue 32): what a job's profiler windows measured of its
step, less its exposed communication, replaces the catalog's efficiency in the next plans on that pool, where
the pool learns (learnLinks)."""

import pytest
from pydantic import ValidationError
from sqlmodel import Session, select

from tunewright_api.db import make_engine, migrate
from tunewright_api.models import GpuPool, Job, JobEvent, Tenant
from tunewright_api.services.plans import plan_on, pool_of, profile_for
from tunewright_api.services.telemetry import apply
from tunewright_api.telemetry import CommRecord
from tunewright_core.planner import calibration
from tunewright_core.planner.hardware import (
    LINK_WINDOWS_KEPT,
    efficiency_regime,
    fold_efficiency,
    learned_gpu,
    measured_efficiency_factor,
)
from tunewright_core.pools import planner_pool
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, MeasuredEfficiency


@pytest.mark.parametrize(("catalog", "predicted_compute", "measured_step", "measured_exposed", "factor"), [
    (8.0, 8.0, 10.0, 0.5, 1.0),  # as predicted: step 10 = 8 compute + 1.5 rest + 0.5 exposed comm
    (8.0, 8.0, 18.0, 0.5, 0.5),  # compute took twice the prediction: half the catalog's efficiency
    (8.0, 4.0, 10.0, 0.5, 1.0),  # planned at a learned 2x: measured against the catalog, not the plan
    (8.0, 8.0, 10.0, 4.5, 2.0),  # more of the step exposed in collectives: the compute was faster
    (8.0, 8.0, 2.0, 0.5, None),  # a step no longer than its rest and exposed comm: teaches nothing
    (0.0, 8.0, 10.0, 0.5, None),  # nothing predicted
    (8.0, 8.0, 0.0, 0.0, None),  # nothing measured
])
def test_the_factor_is_what_makes_the_catalog_compute_match_the_measured(catalog, predicted_compute, measured_step,
                                                                        measured_exposed, factor):
    # predicted step 10 = compute + 0.5 exposed comm + 1.5 rest (optimizer...), whatever the compute
    got = measured_efficiency_factor(catalog, predicted_compute, predicted_compute + 2.0, 0.5, measured_step,
                                     measured_exposed)
    assert got == (factor and pytest.approx(factor))


def test_windows_fold_into_a_running_mean_per_gpu_type_and_gpu_count():
    record = None
    for factor in (0.6, 0.8):
        record = fold_efficiency(record, "L40S", factor, 8, "ftjob-a", 1.0)
    several = record["severalGPUs"]
    assert (several["factor"], several["windows"], record["gpu"]) == (pytest.approx(0.7), 2, "L40S")
    assert "oneGPU" not in record
    for _ in range(2 * LINK_WINDOWS_KEPT):
        record = fold_efficiency(record, "L40S", 0.9, 8, "ftjob-b", 2.0)
    several = record["severalGPUs"]
    assert several["windows"] == LINK_WINDOWS_KEPT and several["factor"] == pytest.approx(0.9, rel=0.05)
    record = fold_efficiency(record, "L40S", 1.2, 1, "ftjob-c", 3.0)  # a job on one GPU: a record of its own
    assert (record["oneGPU"]["factor"], record["oneGPU"]["windows"]) == (pytest.approx(1.2), 1)
    assert record["severalGPUs"] == several and record["oneGPU"]["lastJob"] == "ftjob-c"
    assert MeasuredEfficiency.model_validate(record).several_gpus.windows == LINK_WINDOWS_KEPT
    other = fold_efficiency(record, "A100-80GB", 1.1, 8, "ftjob-d", 4.0)  # another GPU: starts again
    assert other["gpu"] == "A100-80GB" and other["severalGPUs"]["windows"] == 1 and "oneGPU" not in other
    # the single-factor form of before 2026-12-07 (learned against one H100's earlier figure): starts again
    earlier = {"gpu": "H100", "factor": 1.4, "windows": 12, "lastJob": "ftjob-a", "measuredAt": 1.0}
    assert fold_efficiency(earlier, "H100", 1.0, 1, "ftjob-e", 5.0) == {
        "gpu": "H100", "oneGPU": {"factor": 1.0, "windows": 1, "lastJob": "ftjob-e", "measuredAt": 5.0}}
    with pytest.raises(ValidationError):
        MeasuredEfficiency.model_validate(earlier)


def factor(value: float, windows: int = 3) -> dict:
    return {"factor": value, "windows": windows, "lastJob": "ftjob-a", "measuredAt": 1.0}


@pytest.mark.parametrize(("gpu", "one", "several", "on_one", "on_eight", "windows"), [
    # the L40S's catalog figure is a published factor for any GPU count: a factor learned on one count stands for
    # the other
    ("L40S", None, 0.8, 0.8, 0.8, (5, 5)),
    ("L40S", 1.2, None, 1.2, 1.2, (2, 2)),
    ("L40S", 1.2, 0.8, 1.2, 0.8, (2, 5)),
    # our own runs measured one H100 and one H200: what several measured says nothing of one; what one measured
    # scales several too
    ("H100", None, 1.3, 1.0, 1.3, (0, 5)),
    ("H100", 0.9, None, 0.9, 0.9, (2, 2)),
    ("H100", 0.95, 1.2, 0.95, 1.2, (2, 5)),
    ("H200", None, 0.8, 1.0, 0.8, (0, 5)),
])
def test_plans_on_one_gpu_and_across_gpus_take_the_factor_of_their_kind(gpu, one, several, on_one, on_eight,
                                                                        windows):
    catalog = calibration.for_gpu(gpu)
    record = {"gpu": gpu, **({"oneGPU": factor(one, 2)} if one else {}),
              **({"severalGPUs": factor(several, 5)} if several else {})}
    learnt = learned_gpu(catalog, gpu, record)
    for gpus, expected in ((1, on_one), (8, on_eight)):
        assert learnt.on(gpus).matmul_efficiency == pytest.approx(catalog.on(gpus).matmul_efficiency * expected)
        assert learnt.on(gpus).memory_efficiency == pytest.approx(catalog.on(gpus).memory_efficiency * expected)
    # the windows behind each kind of plan, as its band says them
    assert (learnt.windows_on(1), learnt.windows_on(8)) == windows
    assert learnt.name == gpu  # the prediction band looks the GPU up by its catalog key


def test_a_pool_plans_on_what_it_learned_only_where_it_learns():
    catalog = calibration.for_gpu("H100")
    record = {"gpu": "H100", "oneGPU": factor(0.9)}
    assert learned_gpu(catalog, "A100-80GB", record) is catalog and learned_gpu(catalog, "H100", None) is catalog
    assert learned_gpu(catalog, "H100", {"gpu": "H100"}) is catalog
    spec = GPUPoolSpec.model_validate({"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4",
                                       "pricePerGPUHour": 4.0, "workerImage": "w:1"})
    measured = MeasuredEfficiency.model_validate(record)
    assert planner_pool("p", spec, None, measured).gpu == catalog  # learnLinks off: the catalog's
    assert planner_pool("p", spec.model_copy(update={"learn_links": True}), None, measured).gpu == \
        learned_gpu(catalog, "H100", record)


SPEC = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "full"},
        "dataset": {"train": "file-1", "format": "text"},
        "hyperparameters": {"maxSteps": 100, "seqLen": 4096, "globalBatchSize": 64},
        "resources": {"pool": "h100x8"}}


@pytest.mark.parametrize("learns", [True, False])
def test_a_window_teaches_an_opted_in_pool_its_efficiency_and_the_next_plan_uses_it(tmp_path, learns):
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(engine)
    spec = FineTuneJobSpec.model_validate(SPEC)
    profile = profile_for(spec.model.source, param="model.source")
    with Session(engine) as session:
        pool = GpuPool(name="h100x8", gpu="H100", gpus_per_node=8, max_nodes=1, intra_node="nvlink4",
                       price_per_gpu_hour=4.0, learn_links=learns)
        tenant = Tenant(name="alice")
        session.add_all([pool, tenant])
        session.flush()
        before = plan_on(spec=spec, profile=profile, pool=pool_of(pool), dataset_tokens=None, spec_param=None)
        p = before.predicted
        job = Job(tenant_id=tenant.id, model="llama-8b", spec=SPEC, plan=before)
        session.add(job)
        session.flush()
        # the compute took twice the prediction; the profiler's own cost is left out of the step
        compute = p.matmul_seconds + p.memory_bound_seconds
        step = p.step_seconds + compute
        record = CommRecord(event="comm", step=10, time=1e9, profiled_steps=2, profiled_step_seconds=step + 0.5,
                            comm_share=0.1, comm_share_exposed=0.0, comm_seconds_per_step=0.1 * step,
                            exposed_comm_seconds_per_step=p.exposed_comm_seconds, comm_share_max_rank=0.1,
                            comm_share_exposed_max_rank=0.0, window_cost_seconds=1.0)
        apply(session, job, record)
        apply(session, job, record)  # the same window sent again: folded once
        session.commit()
        session.refresh(pool)
        if not learns:
            assert pool.measured_efficiency is None
            return
        learnt = pool.measured_efficiency[efficiency_regime(before.gpus)]
        assert learnt["factor"] == pytest.approx(0.5)
        assert (learnt["windows"], learnt["lastJob"]) == (1, job.id)
        said = session.exec(select(JobEvent.message).where(JobEvent.job_id == job.id)).all()
        assert any("its H100s computed at 0.5x the catalog's efficiency on" in message for message in said)
        after = plan_on(spec=spec, profile=profile, pool=pool_of(pool), dataset_tokens=None, spec_param=None)
        assert after.predicted.step_seconds > before.predicted.step_seconds
        # a window of the same job, planned before the pool learned, still measures against the catalog
        apply(session, job, record.model_copy(update={"time": 2e9}))
        assert pool.measured_efficiency[efficiency_regime(before.gpus)]["factor"] == pytest.approx(0.5)
        pool.learn_links = False  # opting out plans on the catalog's efficiency again, what was learnt is kept
        assert pool_of(pool).gpu == calibration.for_gpu("H100") and pool.measured_efficiency


GPUPOOL = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "l40s"},
           "spec": {"gpu": "L40S", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "pcie4",
                    "pricePerGPUHour": 1.5, "workerImage": "w:1"}}


@pytest.mark.parametrize("learns", [True, False])
def test_a_gpupool_that_learns_keeps_its_efficiency_in_its_status_and_the_next_plans_use_it(emulated_cluster,
                                                                                            learns):
    """The cluster's pools, as the described ones: the API folds a window into the GPUPool's
    status.measuredEfficiency, the operator's discovery leaves it, and both the API's and the operator's
    plans use it; a GPU the pool's jobs measured over enough windows is no longer widened as unmeasured."""
    from tests.support.emulated import client_for
    from tunewright_api.backends.kubernetes import KubernetesBackend
    from tunewright_api.settings import Settings
    from tunewright_core.planner.band import LEARNED_ENOUGH
    from tunewright_core.pools import discovered, resolve_pool
    from tunewright_operator.reconcile import plan_on_pool

    cluster = client_for(emulated_cluster)
    cluster.create(GPUPOOL | {"spec": GPUPOOL["spec"] | {"learnLinks": learns}})
    # learned in the single-factor form of before 2026-12-07 (the CRD of today prunes its fields, an older one
    # kept them): not read (plans take the catalog's), replaced
    earlier = {"gpu": "L40S", "factor": 2.0, "windows": 9, "lastJob": "ftjob-old", "measuredAt": 0.5}
    cluster.patch_status("GPUPool", None, "l40s", {"measuredEfficiency": earlier})
    backend = KubernetesBackend(Settings(backend="kubernetes"), engine=None, cluster=cluster)
    spec = FineTuneJobSpec.model_validate({**SPEC, "resources": {"pool": "l40s"}})
    job_spec = spec.model_dump(by_alias=True, exclude_none=True)
    profile = profile_for(spec.model.source, param="model.source")
    before = plan_on(spec=spec, profile=profile, pool=backend.pool("l40s"), dataset_tokens=None, spec_param=None)
    assert "no run measured a L40S" in before.predicted.band.basis
    p = before.predicted
    compute = p.matmul_seconds + p.memory_bound_seconds
    job = Job(id="ftjob-l40s", tenant_id="t", model="llama-8b", spec=job_spec, plan=before)
    said = [backend.learn_efficiency(None, job, p.step_seconds + compute, p.exposed_comm_seconds, at)
            for at in range(1, LEARNED_ENOUGH + 1)]
    again = backend.learn_efficiency(None, job, p.step_seconds + compute, p.exposed_comm_seconds, LEARNED_ENOUGH)
    assert again is None  # the last window sent again: folded once
    status = cluster.get("GPUPool", None, "l40s").get("status") or {}
    if not learns:
        assert said == [None] * LEARNED_ENOUGH
        assert not {"oneGPU", "severalGPUs"} & set(status.get("measuredEfficiency") or {})
        return
    assert said[0].startswith("pool l40s: its L40Ss computed at 0.5x the catalog's efficiency on")
    learnt = status["measuredEfficiency"][efficiency_regime(before.gpus)]
    assert (learnt["factor"], learnt["windows"]) == (pytest.approx(0.5), LEARNED_ENOUGH)
    assert set(status["measuredEfficiency"]) == {"gpu", efficiency_regime(before.gpus)}  # the earlier form's gone
    cluster.patch_status("GPUPool", None, "l40s", discovered(GPUPoolSpec.model_validate(GPUPOOL["spec"]), []).model_dump(
        by_alias=True, mode="json", exclude_none=True))  # the operator's discovery writes its own fields only
    learned = resolve_pool(spec, cluster).efficiency
    assert (learned.one_gpu or learned.several_gpus).windows == LEARNED_ENOUGH
    after = plan_on(spec=spec, profile=profile, pool=backend.pool("l40s"), dataset_tokens=None, spec_param=None)
    ftj = {"metadata": {"name": "j", "namespace": "n", "uid": "u", "annotations": {}}, "spec": job_spec}
    by_operator = plan_on_pool(spec, resolve_pool(spec, cluster), ftj)
    assert after.predicted.step_seconds > before.predicted.step_seconds
    assert by_operator.predicted.step_seconds == pytest.approx(after.predicted.step_seconds)
    assert "no run measured" not in after.predicted.band.basis
    assert f"{LEARNED_ENOUGH} profiler windows of this pool's jobs measured it" in after.predicted.band.basis
    cluster.patch_status("GPUPool", None, "l40s", {"measuredEfficiency": None})  # forgetting it
    assert backend.pool("l40s").gpu == calibration.for_gpu("L40S")


def test_one_window_moves_a_shared_pool_only_so_far():
    """A job's telemetry can be wrong, or forged by whoever holds its token: one window's factor is held to
    EFFICIENCY_FACTOR_RANGE, and one link window to a range around the declared bandwidth."""
    from tunewright_core.planner.hardware import EFFICIENCY_FACTOR_RANGE, LINK_RANGE_OF_DECLARED

    assert fold_efficiency(None, "H100", 1e6, 8, "ftjob-x", 1.0)["severalGPUs"]["factor"] == EFFICIENCY_FACTOR_RANGE[1]
    assert fold_efficiency(None, "H100", 1e-6, 1, "ftjob-x", 1.0)["oneGPU"]["factor"] == EFFICIENCY_FACTOR_RANGE[0]
    assert LINK_RANGE_OF_DECLARED[0] < 1 < LINK_RANGE_OF_DECLARED[1]


def test_a_gpupool_record_of_the_earlier_form_is_replaced_whole(emulated_cluster):
    """A merge patch keeps the keys it does not name: where the stored record still holds the single-factor
    form's (a CRD of before 2026-12-07 kept them), the patch removes each."""
    from tests.support.emulated import client_for
    from tunewright_api.backends.kubernetes import KubernetesBackend
    from tunewright_api.settings import Settings

    cluster = client_for(emulated_cluster)
    cluster.create(GPUPOOL | {"spec": GPUPOOL["spec"] | {"learnLinks": True}})
    earlier = {"gpu": "L40S", "factor": 2.0, "windows": 9, "lastJob": "ftjob-old", "measuredAt": 0.5}
    patches = []

    class AsAnOlderCRDKeptIt:  # the emulated server prunes what today's CRD does not name
        def __getattr__(self, name):
            return getattr(cluster, name)

        def get(self, kind, namespace, name):
            found = cluster.get(kind, namespace, name)
            return found | {"status": {**(found.get("status") or {}), "measuredEfficiency": earlier}}

        def patch_status(self, kind, namespace, name, body):
            patches.append(body)
            return cluster.patch_status(kind, namespace, name, body)

    backend = KubernetesBackend(Settings(backend="kubernetes"), engine=None, cluster=AsAnOlderCRDKeptIt())
    spec = FineTuneJobSpec.model_validate({**SPEC, "resources": {"pool": "l40s"}})
    profile = profile_for(spec.model.source, param="model.source")
    plan = plan_on(spec=spec, profile=profile, pool=backend.pool("l40s"), dataset_tokens=None, spec_param=None)
    assert "no run measured a L40S" in plan.predicted.band.basis  # the earlier record is not read
    job = Job(id="ftjob-l40s", tenant_id="t", model="llama-8b", spec=spec.model_dump(by_alias=True), plan=plan)
    p = plan.predicted
    assert backend.learn_efficiency(None, job, p.step_seconds, p.exposed_comm_seconds, 1.0)
    (written,) = [body["measuredEfficiency"] for body in patches]
    assert {k: written[k] for k in ("factor", "windows", "lastJob", "measuredAt")} == dict.fromkeys(
        ("factor", "windows", "lastJob", "measuredAt"))
    assert written["gpu"] == "L40S" and written[efficiency_regime(plan.gpus)]["windows"] == 1


def test_a_record_of_the_earlier_form_reads_as_none_where_pools_are_shown():
    """GET /v1/pools validates what it answers: a record the model refuses (the single-factor form, written by a
    replica not yet upgraded, or kept by an older CRD) shows as none rather than a 500."""
    from tunewright_api.routes.pools import pool_public
    from tunewright_core.pools import status_as_read

    earlier = {"gpu": "H100", "factor": 1.4, "windows": 12, "lastJob": "ftjob-a", "measuredAt": 1.0}
    now = {"gpu": "H100", "oneGPU": factor(0.9)}
    described = GpuPool(name="p", gpu="H100", gpus_per_node=8, max_nodes=1, intra_node="nvlink4",
                        price_per_gpu_hour=3.0, learn_links=True, measured_efficiency=earlier)
    assert pool_public(described).measured_efficiency is None
    described.measured_efficiency = now
    assert pool_public(described).measured_efficiency.one_gpu.factor == 0.9
    gpupool = GPUPOOL | {"status": {"nodes": 2, "measuredEfficiency": earlier}}
    assert status_as_read(gpupool) == {"nodes": 2}
    read = status_as_read(GPUPOOL | {"status": {"nodes": 2, "measuredEfficiency": now}})
    assert read["measuredEfficiency"]["oneGPU"]["factor"] == 0.9 and read["nodes"] == 2
