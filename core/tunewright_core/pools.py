"""What a GPUPool's nodes really are, against what the pool declares, and the pool as the planner sees it (pure).

GPU feature discovery labels each GPU node (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory` in MiB) and
the device plugin reports `nvidia.com/gpu` as allocatable. A pool whose nodes disagree with its spec is
planned on wrongly, so every disagreement is reported in its status, in words.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from pydantic import BaseModel, ValidationError

from tunewright_core.k8s import Cluster
from tunewright_core.planner import calibration
from tunewright_core.planner.estimate import Calibration, Layout, Workload, estimate
from tunewright_core.planner.hardware import (
    GPU,
    GPUS,
    LINK_RANGE_OF_DECLARED,
    LINKS,
    Link,
    Pool,
    efficiency_regime,
    fold_efficiency,
    fold_measurement,
    gpu_from_product_name,
    learned,
    learned_gpu,
    measured_bus_bytes_per_s,
    measured_efficiency_factor,
)
from tunewright_core.spec import (
    FineTuneJobSpec,
    GPUPoolSpec,
    GPUPoolStatus,
    JobPlan,
    MeasuredEfficiency,
    MeasuredLinks,
)

PRODUCT_LABEL, MEMORY_LABEL, GPU_RESOURCE = "nvidia.com/gpu.product", "nvidia.com/gpu.memory", "nvidia.com/gpu"
MEMORY_TOLERANCE = 0.1  # the catalog's usable memory is the datasheet's less what the driver keeps


def selector(pool: GPUPoolSpec) -> str:
    """The label selector listing the pool's nodes."""
    return ",".join(f"{k}={v}" for k, v in sorted(pool.node_selector.items()))


def discovered(pool: GPUPoolSpec, nodes: list[dict], generation: int | None = None) -> GPUPoolStatus:
    """The status of a pool from the Nodes its selector matches (core/v1 Node objects)."""
    ready = [n for n in nodes if not n.get("spec", {}).get("unschedulable")]
    allocatable = [int(n.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, 0) or 0) for n in ready]
    labels = [n.get("metadata", {}).get("labels", {}) for n in ready]
    products = sorted({label[PRODUCT_LABEL] for label in labels if PRODUCT_LABEL in label})
    memories = [int(label[MEMORY_LABEL]) for label in labels if str(label.get(MEMORY_LABEL, "")).isdigit()]
    disagreements = []
    if not ready:
        disagreements.append(f"no schedulable node matches the node selector {selector(pool) or '(none)'}")
    for product in products:
        if gpu_from_product_name(product) != pool.gpu:
            disagreements.append(f"nodes report GPU {product}, the pool says {pool.gpu}")
    short = [n["metadata"]["name"] for n, gpus in zip(ready, allocatable, strict=True) if gpus < pool.gpus_per_node]
    if short:
        disagreements.append(f"{len(short)} node(s) allocate fewer than gpusPerNode={pool.gpus_per_node} GPUs: "
                             f"{', '.join(sorted(short)[:5])}")
    if ready and len(ready) < pool.max_nodes:
        disagreements.append(f"maxNodes is {pool.max_nodes} but {len(ready)} node(s) match: plans larger than "
                             f"{len(ready)} node(s) will not schedule")
    declared_mib = GPUS[pool.gpu].memory_gib * 1024
    if memories and min(memories) < declared_mib * (1 - MEMORY_TOLERANCE):
        disagreements.append(f"nodes report {min(memories)} MiB per GPU, the catalog's {pool.gpu} has "
                             f"{declared_mib:.0f} MiB")
    return GPUPoolStatus(observed_generation=generation, nodes=len(ready), allocatable_gpus=sum(allocatable),
                         gpu_products=products, gpu_memory_mib=min(memories) if memories else None,
                         disagreements=disagreements)


def _record(measured: BaseModel | dict | None) -> dict | None:
    return measured.model_dump(by_alias=True) if isinstance(measured, BaseModel) else measured


class DescribedPool(Protocol):
    """What a pool declares, in whichever shape holds it: a GPUPool's spec, a pool described to the API."""

    gpu: str
    gpus_per_node: int
    max_nodes: int
    intra_node: str
    inter_node: str | None
    price_per_gpu_hour: float
    host_memory_gib: float | None
    learn_links: bool


def planner_pool(name: str, pool: DescribedPool, measured_links: MeasuredLinks | dict | None = None,
                 measured_efficiency: MeasuredEfficiency | dict | None = None) -> Pool:
    """The pool as the planner models it (its GPU calibrated against the measured H200 runs); with
    learnLinks, each link at the bandwidth the pool's jobs measured and its GPU at the compute efficiency
    they measured (a GPUPool's status models, or a described pool's camelCase columns)."""
    links = _record(measured_links) or {} if pool.learn_links else {}
    learnt = _record(measured_efficiency) if pool.learn_links else None
    return Pool(name, gpu_as_planned(pool.gpu, learnt), pool.gpus_per_node, pool.max_nodes,
                *links_as_planned(pool.intra_node, pool.inter_node, links), pool.price_per_gpu_hour,
                pool.host_memory_gib)


def gpu_as_planned(gpu: str, measured: dict | None) -> GPU:
    """A pool's GPU at the catalog's efficiency, times the factor its jobs measured where `measured` holds one."""
    return learned_gpu(calibration.for_gpu(gpu), gpu, measured)


def links_as_planned(intra_node: str, inter_node: str | None, measured: dict) -> tuple[Link, Link | None]:
    """A pool's declared links, each at its measured bandwidth where `measured` holds one."""
    return (learned(LINKS[intra_node], measured.get(INTRA_NODE)),
            learned(LINKS[inter_node], measured.get(INTER_NODE)) if inter_node else None)


INTRA_NODE, INTER_NODE = "intraNode", "interNode"  # the keys of measured links (MeasuredLinks' aliases)


def readable(model: type[MeasuredLinks] | type[MeasuredEfficiency], record: dict | None):
    """What a pool's jobs measured, as `model` reads it; None where nothing is, or where what is there is not ours
    to read (hand-edited, or of an earlier form: the single-factor efficiency of before 2026-12-07): plans take the
    declared figures rather than fail, and answers show none rather than a 500."""
    try:
        return model.model_validate(record) if record else None
    except ValidationError:
        return None


def measured_links_of(gpupool: dict) -> MeasuredLinks | None:
    """A GPUPool object's measured links (`readable`)."""
    return readable(MeasuredLinks, (gpupool.get("status") or {}).get("measuredLinks"))


def measured_efficiency_of(gpupool: dict) -> MeasuredEfficiency | None:
    """A GPUPool object's measured efficiency (`readable`)."""
    return readable(MeasuredEfficiency, (gpupool.get("status") or {}).get("measuredEfficiency"))


def status_as_read(gpupool: dict) -> dict:
    """A GPUPool object's status with what its jobs measured as `readable` reads it (unreadable records left out)."""
    status = dict(gpupool.get("status") or {})
    for key, found in (("measuredLinks", measured_links_of(gpupool)),
                       ("measuredEfficiency", measured_efficiency_of(gpupool))):
        status.pop(key, None)
        if found is not None:
            status[key] = found.model_dump(by_alias=True, mode="json", exclude_none=True)
    return status


def teaches(plan: JobPlan) -> bool:
    """Whether the profiler windows of a job so planned say anything of its pool's links."""
    return plan.device == "gpu" and plan.gpus >= 2 and plan.predicted is not None


def learnt_links(plan: JobPlan, pool_name: str, intra_node: str, inter_node: str | None, measured: dict,
                 transfer_seconds: float, job_id: str, at: float) -> tuple[dict, str] | None:
    """A pool's measured links with one profiler window more, and what was learnt (for the job's events);
    None where the window teaches nothing (one GPU, no collectives predicted or measured). The link is the
    one across nodes where the plan spans several (the slowest hop bounds the ring), else within the node;
    the window's transfer time excludes its waiting for the slowest rank."""
    if not teaches(plan):
        return None
    key, name = (INTER_NODE, inter_node) if plan.nodes > 1 and inter_node else (INTRA_NODE, intra_node)
    previous = measured.get(key) or {}
    if previous.get("lastJob") == job_id and previous.get("measuredAt") == at:
        return None  # this window is in already (a batch of telemetry sent again)
    # scaled from the bandwidth the plan predicted at (what the pool had learned by then, else the declared
    # one): scaled from the declared one, a pool that had learned would settle at sqrt(declared x true)
    assert plan.predicted is not None  # teaches(plan) checked it
    planned = replace(LINKS[name], bus_bytes_per_s=plan.link_bus_bytes_per_s or LINKS[name].bus_bytes_per_s)
    bus = measured_bus_bytes_per_s(planned, plan.predicted.comm_seconds, transfer_seconds)
    if bus is None:
        return None
    declared = LINKS[name].bus_bytes_per_s  # one window moves a shared pool's link only so far
    bus = min(max(bus, declared * LINK_RANGE_OF_DECLARED[0]), declared * LINK_RANGE_OF_DECLARED[1])
    return ({**measured, key: fold_measurement(measured.get(key), bus, job_id, at)},
            f"pool {pool_name}: {name} measured {bus / 1e9:.3g} GB/s bus bandwidth in this window (declared "
            f"{LINKS[name].bus_bytes_per_s / 1e9:.3g}); its next plans use the mean of its last windows")


def catalog_compute_seconds(plan: JobPlan, w: Workload, pool: Pool, cal: Calibration) -> float:
    """The plan's compute per step (matmul + memory-bound) as its layout runs on the catalog's GPU: what a
    measured efficiency is a factor over, whatever factor the plan itself was made with."""
    layout = Layout(plan.strategy, plan.gpus, plan.nodes, plan.micro_batch, plan.grad_accum,
                    plan.activation_checkpointing, plan.shard_group, plan.cpu_offload,
                    plan.activation_checkpointing_every, plan.reshard_after_forward)
    at_catalog = estimate(w, layout, replace(pool, gpu=calibration.for_gpu(pool.gpu.name)), cal)
    return at_catalog.matmul_seconds + at_catalog.memory_bound_seconds


def learns_efficiency(plan: JobPlan) -> bool:
    """Whether the profiler windows of a job so planned say anything of its pool's GPUs (any GPU count): not an
    FP8 job's, whose products run at another rate than the bf16 one the pool's efficiency scales."""
    return plan.device == "gpu" and plan.gpus >= 1 and plan.predicted is not None and plan.precision == "bf16"


def learnt_efficiency(plan: JobPlan, pool_name: str, gpu: str, measured: dict | None, catalog_compute: float,
                      measured_step_seconds: float, measured_exposed_comm_seconds: float, job_id: str,
                      at: float) -> tuple[dict, str] | None:
    """A pool's measured efficiency with one profiler window more, and what was learnt (for the job's
    events); None where the window teaches nothing or is in already (a batch of telemetry sent again)."""
    if not learns_efficiency(plan):
        return None
    previous = (measured or {}).get(efficiency_regime(plan.gpus)) or {}
    if previous.get("lastJob") == job_id and previous.get("measuredAt") == at:
        return None  # this window is in already (a batch of telemetry sent again)
    p = plan.predicted
    assert p is not None  # learns_efficiency(plan) checked it
    factor = measured_efficiency_factor(catalog_compute, p.matmul_seconds + p.memory_bound_seconds, p.step_seconds,
                                        p.exposed_comm_seconds, measured_step_seconds, measured_exposed_comm_seconds)
    if factor is None:
        return None
    on = "one GPU" if plan.gpus == 1 else "several GPUs"
    return (fold_efficiency(measured, gpu, factor, plan.gpus, job_id, at),
            f"pool {pool_name}: its {gpu}s computed at {factor:.3g}x the catalog's efficiency on {on} in this "
            f"window; its next plans on {on} use the mean of its last such windows")


@dataclass(frozen=True)
class ResolvedPool:
    """The GPUPool a job runs on, with what its jobs measured of it (`status`); `spec` is None, and
    `why_not` says why, where there is none."""

    name: str | None
    spec: GPUPoolSpec | None
    links: MeasuredLinks | None = None
    efficiency: MeasuredEfficiency | None = None
    why_not: str = ""

    @classmethod
    def of(cls, gpupool: dict) -> ResolvedPool:
        return cls(gpupool["metadata"]["name"], GPUPoolSpec.model_validate(gpupool["spec"]),
                   measured_links_of(gpupool), measured_efficiency_of(gpupool))

    def planner_pool(self) -> Pool:
        assert self.name is not None and self.spec is not None, self.why_not
        return planner_pool(self.name, self.spec, self.links, self.efficiency)


def resolve_pool(spec: FineTuneJobSpec, cluster: Cluster, name: str | None = None) -> ResolvedPool:
    """The pool named by the spec (or the plan), else the one marked default, with what its jobs measured;
    why not when there is none."""
    wanted = name or spec.resources.pool
    if wanted:
        found = cluster.get("GPUPool", None, wanted)
        if found is None:
            return ResolvedPool(wanted, None, why_not=f"no GPUPool {wanted}: create it, or set resources.pool "
                                                      "to an existing one")
        return ResolvedPool.of(found)
    defaults = [p for p in cluster.list("GPUPool") if p["spec"].get("default")]
    if len(defaults) != 1:
        names = ", ".join(sorted(p["metadata"]["name"] for p in defaults))
        why = (f"several GPUPools are marked default ({names}): set resources.pool" if defaults else
               "no GPUPool is marked default: set resources.pool, or create a pool with default: true")
        return ResolvedPool(None, None, why_not=why)
    return ResolvedPool.of(defaults[0])
