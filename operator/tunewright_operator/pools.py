"""What a GPUPool's nodes really are, against what the pool declares, and the pool as the planner sees it (pure).

GPU feature discovery labels each GPU node (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory` in MiB) and
the device plugin reports `nvidia.com/gpu` as allocatable. A pool whose nodes disagree with its spec is
planned on wrongly, so every disagreement is reported in its status, in words.
"""

from __future__ import annotations

from tunewright_operator.planner import calibration
from tunewright_operator.planner.hardware import GPUS, LINKS, Pool, gpu_from_product_name
from tunewright_operator.spec import GPUPoolSpec, GPUPoolStatus

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


def planner_pool(name: str, spec: GPUPoolSpec) -> Pool:
    """The pool as the planner models it (its GPU calibrated against the measured H200 runs)."""
    return Pool(name, calibration.for_gpu(spec.gpu), spec.gpus_per_node, spec.max_nodes, LINKS[spec.intra_node],
                LINKS[spec.inter_node] if spec.inter_node else None, spec.price_per_gpu_hour, spec.host_memory_gib)
