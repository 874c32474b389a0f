"""Process groups and model wrapping: single device, DDP, FSDP2 (per transformer block), HSDP (2-D mesh).

Works the same under Ray Train (which creates the process group), under torchrun, and in one process.
"""

from __future__ import annotations

import contextlib
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
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(t)
        return t.tolist()


def init_dist(cfg: JobConfig, device: torch.device | None = None) -> Dist:
    """Join (or, under torchrun, create) the process group and pick this rank's device.

    Ray Train has already created the group and passes its device; torchrun sets RANK/WORLD_SIZE/LOCAL_RANK.
    """
    use_gpu = cfg.strategy.use_gpu
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("strategy.use_gpu: true, but no CUDA device is visible to this process")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if use_gpu else "gloo"
    if world > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group(backend=backend)
    elif is_sharded(cfg) and not torch_dist.is_initialized():
        # FSDP needs a process group even alone (a device mesh of one): a private file rendezvous
        fd, store = tempfile.mkstemp(prefix="tunewright-pg-")
        os.close(fd)
        torch_dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=0, world_size=1)
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    world = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
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


def is_sharded(cfg: JobConfig) -> bool:
    return cfg.strategy.type in ("fsdp", "hsdp")


def wrap_model(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    kind = cfg.strategy.type
    if kind == "single":
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return _fully_shard(cfg, model, dist)


def _fully_shard(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tunewright_jobs.model import transformer_blocks

    if cfg.strategy.type == "hsdp":
        shard = cfg.strategy.hsdp_shard_size
        mesh = init_device_mesh(dist.device.type, (dist.world_size // shard, shard),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    dtype = compute_dtype(cfg, dist.device)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model.to(dist.device)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


def gradient_sync(model: torch.nn.Module, sync: bool):
    """DDP skips the all-reduce on all but the last micro-batch; FSDP reduce-scatters every micro-batch
    (holding unsharded gradients instead would cost the memory sharding saves)."""
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def autocast(cfg: JobConfig, device: torch.device):
    """bf16 autocast for single/DDP; FSDP casts parameters itself through its MixedPrecisionPolicy."""
    dtype = compute_dtype(cfg, device)
    if dtype == torch.float32 or is_sharded(cfg):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
