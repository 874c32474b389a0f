"""Process groups and model wrapping: every strategy is FSDP2 (per transformer block) on its device mesh —
single (a mesh of one), DDP (shards of one, replicated), FSDP (one shard group), HSDP (2-D mesh).

Works the same under Ray Train (which creates the process group), under torchrun, and in one process.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from tunewright_jobs.config import JobConfig


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            torch_dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, torch_dist.ReduceOp.SUM)

    def all_reduce_max(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, torch_dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[float], op) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t, op=op)
        return t.tolist()


def init_dist(cfg: JobConfig, device: torch.device | None = None) -> Dist:
    """Join (or, under torchrun, create) the process group and pick this rank's device.

    Ray Train has already created the group and passes its device; torchrun sets RANK/WORLD_SIZE/LOCAL_RANK.
    A single process gets a group of its own (a private file rendezvous): every strategy runs on FSDP2.
    """
    use_gpu = cfg.strategy.use_gpu
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("strategy.use_gpu: true, but no CUDA device is visible to this process")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if use_gpu else "gloo"
    if world > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group(backend=backend)
    elif not torch_dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="tunewright-pg-")
        os.close(fd)
        torch_dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=0, world_size=1)
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world != cfg.strategy.num_workers:
        raise RuntimeError(f"strategy.num_workers is {cfg.strategy.num_workers} but {world} processes were started")
    return Dist(rank, world, local_rank, device)


def compute_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    precision = cfg.strategy.precision
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32


def mesh_shape(cfg: JobConfig, world_size: int) -> tuple[int, ...]:
    """The device mesh each strategy shards over: (shard,) or (replicate, shard).

    DDP is FSDP2 with shards of one GPU (parameters replicated, gradients all-reduced), so that every
    strategy shares one mixed-precision path: fp32 master weights, bf16 compute, fp32 reduction.
    """
    kind = cfg.strategy.type
    if kind == "ddp":
        return (world_size, 1)
    if kind == "hsdp":
        return (world_size // cfg.strategy.hsdp_shard_size, cfg.strategy.hsdp_shard_size)
    return (world_size,)  # single (a world of one) and fsdp


def keeps_blocks_gathered(shard_size: int, offload: bool, frozen_in_fsdp: bool) -> bool:
    """Whether each block's compute copy is kept from its forward to its backward. A shard of one GPU is the
    whole model: freeing a block's bf16 copy after its forward saves no transfer, only memory, and costs a
    second cast and copy (with FSDP2's host-side hooks) for its backward. The planner counts every block's
    copy held on such layouts. Sharded or offloaded, the copy is freed (it is what sharding saves); so it is
    where FSDP holds a frozen base to cast (a LoRA base not in the compute dtype), whose copy the planner
    does not count."""
    return shard_size == 1 and not offload and not frozen_in_fsdp


def wrap_model(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """Shard each transformer block, then the rest; in place (the module keeps its class)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from tunewright_jobs.model import transformer_blocks

    shape = mesh_shape(cfg, dist.world_size)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh(dist.device.type, shape, mesh_dim_names=names)
    dtype = compute_dtype(cfg, dist.device)
    offload = cfg.strategy.cpu_offload
    outside = one_gpu_shards(model, shard_size=shape[-1], offload=offload, dtype=dtype)
    frozen_in_fsdp = any(not p.requires_grad and p not in outside.get("ignored_params", ()) for p in model.parameters())
    options = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
               "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
               "reshard_after_forward": not keeps_blocks_gathered(shard_size=shape[-1], offload=offload,
                                                                  frozen_in_fsdp=frozen_in_fsdp),
               **outside}
    for block in transformer_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    if not cfg.strategy.cpu_offload:
        return model.to(dist.device)
    # Offloaded parameters stay on the host (FSDP2 copies each block in for compute); buffers such as
    # rotary frequencies are not FSDP's and must be on the GPU.
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(name, buffer.to(dist.device), persistent=name not in module._non_persistent_buffers_set)
    return model


def one_gpu_shards(model: torch.nn.Module, shard_size: int, offload: bool, dtype: torch.dtype) -> dict:
    """FSDP2 options where each shard is a whole GPU's copy (single, DDP): frozen weights already in the
    compute dtype (a LoRA base in bf16; identical on every replica) need no gathering, no reduction, no
    cast and no optimizer, so they stay plain tensors outside FSDP instead of being copied into a gathered
    buffer for every block's forward and backward. Frozen weights in another dtype stay in FSDP, which
    casts them; offloading keeps everything in FSDP, which is what moves it to the host."""
    if shard_size > 1 or offload:
        return {}
    frozen = {p for p in model.parameters() if not p.requires_grad and p.dtype == dtype}
    return {"ignored_params": frozen} if frozen else {}


def gradient_sync(model: torch.nn.Module, cfg: JobConfig, last_micro_batch: bool) -> None:
    """Across replicas (DDP, HSDP), gradients are all-reduced once per optimizer step, on the last
    micro-batch; within a shard group they are reduce-scattered every micro-batch (holding unsharded
    gradients instead would cost the memory sharding saves)."""
    if cfg.strategy.type in ("ddp", "hsdp"):
        model.set_requires_all_reduce(last_micro_batch)
