"""GPUs, links and pools: datasheet leads, with measured values taking precedence.

Rates are per GPU. `matmul_efficiency` and `memory_efficiency` are the shares of the datasheet peaks that
training kernels reach: H200's come from runs measured here (planner/calibration_h200.json); the others are set by
`calibration.for_gpu` (the H200's on its own die, a published factor over them on others), until a pool's
measurements replace them (`learned_gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # usable by one process (datasheet less what the driver keeps)
    bf16_flops: float  # dense, datasheet
    hbm_bytes_per_s: float  # datasheet
    host_bytes_per_s: float  # host <-> GPU copies of pinned memory, per GPU, each direction (PCIe)
    matmul_efficiency: float = 0.5
    memory_efficiency: float = 0.6
    fp8_flops: float = 0.0  # dense FP8 tensor-core rate, datasheet; 0: none (before Ada and Hopper)
    # profiler windows of a pool's own jobs its one-GPU efficiencies come from, and its several-GPU ones (0: the
    # catalog's)
    learned_windows: int = 0
    several_learned_windows: int = 0
    # where a plan spans GPUs: the efficiency published runs on several of this chip reached over the one-GPU
    # efficiencies above (ours measured on one; calibration.for_gpu): no run of ours has crossed GPUs
    several_gpus_factor: float = 1.0

    def calibrated(self, **measured: float) -> GPU:
        changes: dict[str, Any] = measured  # float fields only; replace() types each field's keyword
        return replace(self, **changes)

    def windows_on(self, gpus: int) -> int:
        """The profiler windows of the pool's jobs behind a plan on `gpus` of these GPUs."""
        return self.learned_windows if gpus == 1 else self.several_learned_windows

    def on(self, gpus: int) -> GPU:
        """This GPU as a plan of `gpus` of them runs on it: at `several_gpus_factor` of its efficiencies past one."""
        if gpus == 1 or self.several_gpus_factor == 1.0:
            return self
        return replace(self, matmul_efficiency=self.matmul_efficiency * self.several_gpus_factor,
                       memory_efficiency=self.memory_efficiency * self.several_gpus_factor)


@dataclass(frozen=True)
class Link:
    """A collective's path: achievable bus bandwidth per GPU (nccl-tests' busbw) and per-call latency."""

    name: str
    bus_bytes_per_s: float
    latency_s: float


# chips that are the H200's own die (the H100 SXM: GH100 at the same clocks, with less memory): one of them runs at
# the H200's measured efficiencies (calibration.for_gpu), as our runs on one H100 checked (fitting's chip_check)
H200_DIE = frozenset({"H100"})
ONE_GPU_MEASURED = frozenset({"H200", *H200_DIE})  # chips whose one-GPU figures our own runs measured

GPUS = {
    # host links: ~80% of PCIe Gen5 x16 (64 GB/s) on SXM Hopper, of Gen4 x16 (32 GB/s) elsewhere
    "H200": GPU("H200", 139.0, 989e12, 4.8e12, 50e9, fp8_flops=1979e12),
    "H100": GPU("H100", 79.0, 989e12, 3.35e12, 50e9, fp8_flops=1979e12),
    "A100-80GB": GPU("A100-80GB", 79.0, 312e12, 2.0e12, 25e9),
    "A100-40GB": GPU("A100-40GB", 39.4, 312e12, 1.55e12, 25e9),
    "L40S": GPU("L40S", 44.5, 362e12, 0.864e12, 25e9, fp8_flops=733e12),
    "L4": GPU("L4", 22.0, 121e12, 0.3e12, 25e9, fp8_flops=242e12),
    "A10G": GPU("A10G", 22.0, 125e12, 0.6e12, 25e9),
}

# busbw that large collectives reach, ~80-90% of the link's rate (nccl-tests PERFORMANCE.md). Between nodes
# NCCL spreads rings over every NIC, so the bound is the node's total network rate.
LINKS = {
    "nvlink4": Link("NVLink 4 (H100/H200 SXM, 450 GB/s per direction)", 360e9, 10e-6),
    "nvlink3": Link("NVLink 3 (A100 SXM, 300 GB/s per direction)", 240e9, 10e-6),
    "pcie5": Link("PCIe Gen5 x16", 40e9, 15e-6),
    "pcie4": Link("PCIe Gen4 x16", 20e9, 15e-6),
    "ib-8x400g": Link("InfiniBand 8x400 Gb/s per node", 360e9, 20e-6),
    "ib-8x200g": Link("InfiniBand 8x200 Gb/s per node", 180e9, 20e-6),
    "eth-400g": Link("Ethernet 400 Gb/s per node", 45e9, 30e-6),
    "eth-2x100g": Link("Ethernet 2x100 Gb/s per node", 22.5e9, 40e-6),
    "eth-100g": Link("Ethernet 100 Gb/s per node", 11.25e9, 40e-6),
    "eth-25g": Link("Ethernet 25 Gb/s per node", 2.8e9, 50e-6),
}


@dataclass(frozen=True)
class Pool:
    """What a GPUPool resource describes: one kind of node, repeated up to `max_nodes`."""

    name: str
    gpu: GPU
    gpus_per_node: int
    max_nodes: int
    intra_node: Link
    inter_node: Link | None
    price_per_gpu_hour: float
    host_memory_gib: float | None = None  # per node; None: HOST_MEMORY_PER_GPU_MEMORY x the node's GPU memory

    @property
    def max_gpus(self) -> int:
        return self.gpus_per_node * self.max_nodes

    @property
    def host_memory_per_node_gib(self) -> float:
        if self.host_memory_gib is not None:
            return self.host_memory_gib
        return HOST_MEMORY_PER_GPU_MEMORY * self.gpu.memory_gib * self.gpus_per_node


# Cloud GPU nodes carry about twice their GPU memory in host memory (A100 40GB: 85 GB, 8 x H100: 2 TB).
HOST_MEMORY_PER_GPU_MEMORY = 2.0


def gpu_from_product_name(product: str) -> str | None:
    """The catalog key for a product name as nvidia-smi or the nvidia.com/gpu.product label writes it."""
    name = product.upper().replace("-", " ")
    if "A100" in name:
        return "A100-80GB" if "80GB" in name.replace(" ", "") else "A100-40GB"
    for key in ("H200", "H100", "L40S", "A10G"):
        if key in name:
            return key
    return "L4" if " L4" in f" {name}" else None


# --- what the runs on a pool measured of its links (opt-in write-back, per pool) ---------------------------

LINK_WINDOWS_KEPT = 50  # a link's measurement is the mean of its last windows at most this many (older ones fade)


def measured_bus_bytes_per_s(planned: Link, predicted_comm_seconds: float, transfer_seconds: float) -> float | None:
    """The bus bandwidth that would make the plan's predicted collective time (predicted on `planned`: the
    link at the bandwidth the plan used) equal the measured transfer (the collectives' time less the waiting
    for the slowest rank): what the link delivered to that job. None where either time is not positive (no
    collectives predicted, or none measured)."""
    if predicted_comm_seconds <= 0 or transfer_seconds <= 0:
        return None
    return planned.bus_bytes_per_s * predicted_comm_seconds / transfer_seconds


def fold_measurement(previous: dict | None, bus_bytes_per_s: float, job_id: str, at: float) -> dict:
    """A link's record with one more window: the running mean over at most LINK_WINDOWS_KEPT windows."""
    return _running_mean(previous or {}, "busBytesPerSecond", bus_bytes_per_s, job_id, at)


def _running_mean(previous: dict, key: str, value: float, job_id: str, at: float) -> dict:
    windows = min(previous.get("windows", 0), LINK_WINDOWS_KEPT - 1)
    mean = (previous.get(key, 0.0) * windows + value) / (windows + 1)
    return {**previous, key: mean, "windows": windows + 1, "lastJob": job_id, "measuredAt": at}


def learned(link: Link, measured: dict | None) -> Link:
    """The declared link, or its measured bandwidth where runs on the pool measured it (the name says so)."""
    if not measured:
        return link
    windows = measured["windows"]
    return replace(link, name=f"{link.name} (as measured over {windows} profiler window{'s' if windows != 1 else ''}; "
                              f"declared {link.bus_bytes_per_s / 1e9:.3g} GB/s)",
                   bus_bytes_per_s=measured["busBytesPerSecond"])


# --- what the runs on a pool measured of its GPUs' compute (same opt-in, same window) ------------------------


def measured_efficiency_factor(catalog_compute_seconds: float, predicted_compute_seconds: float,
                               predicted_step_seconds: float, predicted_exposed_comm_seconds: float,
                               measured_step_seconds: float, measured_exposed_comm_seconds: float) -> float | None:
    """The factor on the catalog's compute efficiencies (matmul and memory-bound alike) that makes the
    predicted compute equal what a window measured:

        measured compute = measured step - measured exposed communication - predicted rest
        predicted rest   = predicted step - predicted compute - predicted exposed communication
        factor           = catalog compute / measured compute

    Compute is matmul + memory-bound seconds, which scale as 1 / efficiency; `catalog_compute_seconds` is
    the plan's layout estimated at the catalog's efficiency (not the plan's, which may already be a learned
    one: folding against it would compound). The rest (optimizer, exposed host copies, waiting for the
    slowest rank) is taken as predicted. None where the window teaches nothing: nothing predicted, a
    non-positive time, or a measured step no longer than what it leaves the compute."""
    if min(catalog_compute_seconds, predicted_compute_seconds, predicted_step_seconds, measured_step_seconds) <= 0:
        return None
    rest = max(0.0, predicted_step_seconds - predicted_compute_seconds - predicted_exposed_comm_seconds)
    measured_compute = measured_step_seconds - measured_exposed_comm_seconds - rest
    if measured_compute <= 0:
        return None
    return catalog_compute_seconds / measured_compute


# what one window may teach: a job's own telemetry can be wrong (or forged by whoever holds its token), and
# one window must not move every later plan on a shared pool beyond what a GPU can be off its catalog figures
EFFICIENCY_FACTOR_RANGE = (0.2, 2.0)
LINK_RANGE_OF_DECLARED = (1 / 20, 1.5)


ONE_GPU, SEVERAL_GPUS = "oneGPU", "severalGPUs"  # a measured efficiency's records (MeasuredEfficiency's aliases)


def efficiency_regime(gpus: int) -> str:
    """Which record of a pool's measured efficiency a window of a plan on `gpus` GPUs folds into."""
    return ONE_GPU if gpus == 1 else SEVERAL_GPUS


def fold_efficiency(previous: dict | None, gpu: str, factor: float, gpus: int, job_id: str, at: float) -> dict:
    """A pool's efficiency record with one more window of a plan on `gpus` GPUs (its factor held to
    EFFICIENCY_FACTOR_RANGE), folded into the record of its kind: the running mean over at most
    LINK_WINDOWS_KEPT windows. A record of another GPU type, or of the single-factor form (learned against the
    one-H100 figure of before 2026-12-07), starts again."""
    kept = previous if previous and previous.get("gpu") == gpu and "factor" not in previous else {}
    low, high = EFFICIENCY_FACTOR_RANGE
    regime = efficiency_regime(gpus)
    return {**kept, "gpu": gpu,
            regime: _running_mean(kept.get(regime) or {}, "factor", min(max(factor, low), high), job_id, at)}


def learned_gpu(gpu: GPU, catalog_key: str, measured: dict | None) -> GPU:
    """The catalog's GPU, or its efficiencies times the factors the pool's runs measured on that GPU type, with
    how many windows said so. Plans on one GPU take the one-GPU factor, plans across GPUs the several-GPU one
    (through `several_gpus_factor`); where a pool measured one kind only, the other kind borrows its factor, but
    for one GPU of a chip whose one-GPU figure our own runs measured (the H200 and its die): a factor learned
    across GPUs says nothing of one. The name stays the catalog key."""
    if not measured or measured.get("gpu") != catalog_key:
        return gpu
    one, several = measured.get(ONE_GPU), measured.get(SEVERAL_GPUS)
    borrowed_by_one = None if catalog_key in ONE_GPU_MEASURED else several
    one_kind, several_kind = one or borrowed_by_one, several or one
    if not one_kind and not several_kind:
        return gpu
    one_factor = one_kind["factor"] if one_kind else 1.0
    several_factor = several_kind["factor"] if several_kind else 1.0
    return replace(gpu, matmul_efficiency=gpu.matmul_efficiency * one_factor,
                   memory_efficiency=gpu.memory_efficiency * one_factor,
                   several_gpus_factor=gpu.several_gpus_factor * several_factor / one_factor,
                   learned_windows=one_kind["windows"] if one_kind else 0,
                   several_learned_windows=several_kind["windows"] if several_kind else 0)
