"""Process groups and model wrapping. Several ranks (and offloading) go through FSDP2 (per transformer block)
on a device mesh — DDP (shards of one, replicated), FSDP (one shard group), HSDP (2-D mesh); `single` trains
the plain module, its fp32 master weights beside the compute copies (`MasterWeights`): the same mixed
precision as FSDP2's, without its per-block hooks and DTensor dispatch.

Works the same under Ray Train (which creates the process group), under torchrun, and in one process.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
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
    A single process gets a group of its own (a private file rendezvous), for FSDP2 on a mesh of one and for
    torch.distributed.checkpoint.
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
    """bf16 on a GPU, fp32 on the CPU, unless `strategy.precision` says; bf16 wherever the weights are (a full
    fine-tune with `optimizer_state: bf16` has no other copy to compute on)."""
    precision = cfg.strategy.precision
    if cfg.hyperparameters.optimizer_state == "bf16":
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.float32 if precision == "fp32" else torch.bfloat16  # fp8: bf16 around the FP8 products


def mesh_shape(cfg: JobConfig, world_size: int) -> tuple[int, ...]:
    """The device mesh each strategy shards over: (shard,) or (replicate, shard).

    DDP is FSDP2 with shards of one GPU (parameters replicated, gradients all-reduced), so that every
    strategy of several ranks shares one mixed-precision path: fp32 master weights, bf16 compute, fp32
    reduction (`single`'s `MasterWeights` does the same casts and sums).
    """
    kind = cfg.strategy.type
    if kind == "ddp":
        return (world_size, 1)
    if kind == "hsdp":
        return (world_size // cfg.strategy.hsdp_shard_size, cfg.strategy.hsdp_shard_size)
    return (world_size,)  # single (a world of one) and fsdp


def device_mesh(cfg: JobConfig, dist: Dist):
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(cfg, dist.world_size)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh(dist.device.type, shape, mesh_dim_names=names)


def keeps_blocks_gathered(shard_size: int, offload: bool, frozen_in_fsdp: bool) -> bool:
    """Whether each block's compute copy is kept from its forward to its backward. A shard of one GPU is the
    whole model: freeing a block's bf16 copy after its forward saves no transfer, only memory, and costs a
    second cast and copy (with FSDP2's host-side hooks) for its backward. The planner counts every block's
    copy held on such layouts. Sharded or offloaded, the copy is freed (it is what sharding saves); so it is
    where FSDP holds a frozen base to cast (a LoRA base not in the compute dtype), whose copy the planner
    does not count."""
    return shard_size == 1 and not offload and not frozen_in_fsdp


def shards_with_fsdp(cfg: JobConfig) -> bool:
    """Whether FSDP2 wraps the model: on every strategy but `single`, and on `single` when it offloads (FSDP2
    is what keeps the states on the host) or computes in a wider dtype than its frozen base's (fp32 compute
    on a bf16 LoRA base: FSDP2 casts a block at a time, where the plain module would hold the whole base
    widened). Otherwise a `single` run has nothing to shard or reduce, so it trains the plain module with
    `MasterWeights`: FSDP2's per-block hooks and the optimizer's dispatch over DTensors are host time that
    launch-bound steps (GPT-2 124M on an H200) wait on. `fsdp` on one worker is FSDP2's path for the same
    job."""
    from tunewright_jobs.model import weights_dtype

    if cfg.strategy.type != "single" or cfg.strategy.cpu_offload:
        return True
    device = torch.device("cuda" if cfg.strategy.use_gpu else "cpu")
    return weights_dtype(cfg).itemsize < compute_dtype(cfg, device).itemsize


def wrap_model(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> tuple[torch.nn.Module, MasterWeights]:
    """The model on its device, sharded or not (in place: the module keeps its class), and the weights its
    optimizer steps."""
    if shards_with_fsdp(cfg):
        model = shard_model(cfg, model, dist)
        return model, MasterWeights(model, None)
    model = model.to(dist.device)
    return model, MasterWeights(model, compute_dtype(cfg, dist.device))


def shard_model(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """FSDP2: each transformer block sharded, then the rest; fp32 master weights, bf16 compute copies, fp32
    gradient reduction. A block's gathered copy is freed after its forward unless `keeps_blocks_gathered`
    or `strategy.reshard_after_forward: false` keeps it for its backward (ZeRO-2-like: one all-gather per
    block per micro-batch instead of two); the root (embeddings, head) follows the blocks."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    shape = mesh_shape(cfg, dist.world_size)
    dtype = compute_dtype(cfg, dist.device)
    offload = cfg.strategy.cpu_offload
    outside = one_gpu_shards(model, shard_size=shape[-1], offload=offload, dtype=dtype)
    frozen_in_fsdp = any(not p.requires_grad and p not in outside.get("ignored_params", ()) for p in model.parameters())
    options = {"mesh": device_mesh(cfg, dist),
               "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
               "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
               "reshard_after_forward": cfg.strategy.reshard_after_forward and not keeps_blocks_gathered(
                   shard_size=shape[-1], offload=offload, frozen_in_fsdp=frozen_in_fsdp),
               **outside}
    return _shard_blocks(model, options, dist, offload)


def place_frozen(cfg: JobConfig, model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """A frozen model that runs beside the policy (DPO's reference), in eval mode and computing in the policy's
    compute dtype, placed as the policy is: whole on each rank where the policy's shards are whole GPUs
    (single, ddp: nothing to gather, and no gradient to reduce), else sharded by FSDP2 over the same mesh,
    each block's weights gathered for its forward and freed after it (and offloaded with the policy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    model.requires_grad_(False).eval()
    dtype = compute_dtype(cfg, dist.device)
    for p in model.parameters():  # stored as it computes, sharded and offloaded too: half an fp32 copy's bytes
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    offload = cfg.strategy.cpu_offload
    if mesh_shape(cfg, dist.world_size)[-1] == 1 and not offload:
        return model.to(dist.device)
    options = {"mesh": device_mesh(cfg, dist),
               "mp_policy": MixedPrecisionPolicy(param_dtype=dtype),
               "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(), "reshard_after_forward": True}
    return _shard_blocks(model, options, dist, offload)


def _shard_blocks(model: torch.nn.Module, options: dict, dist: Dist, offload: bool) -> torch.nn.Module:
    """FSDP2 on each transformer block, then on the rest; the model on its device, or offloaded."""
    from torch.distributed.fsdp import fully_shard

    from tunewright_jobs.model import transformer_blocks

    for block in transformer_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    if not offload:
        return model.to(dist.device)
    # Offloaded parameters stay on the host (FSDP2 copies each block in for compute); buffers such as
    # rotary frequencies are not FSDP's and must be on the GPU.
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(name, buffer.to(dist.device), persistent=name not in module._non_persistent_buffers_set)
    return model


class MasterWeights:
    """The trainable parameters an optimizer steps, for a model that computes in another dtype without FSDP.

    Each trainable parameter keeps its fp32 original (the master: stepped, checkpointed, exported) while a
    copy in the compute dtype stands in the module for forward, backward and evaluation. As soon as autograd
    has accumulated a copy's gradient (its last use in that backward), the gradient is folded into the
    master's fp32 one (summed over micro-batches in fp32) and freed, and on the step's last micro-batch so is
    the copy's storage; after the step every copy is made again from its master. This is FSDP2's mixed
    precision on a shard of one: the same casts and sums (so the same numbers), and no more memory where a
    step peaks (every copy held when backward starts; when the last one ends, the masters' fp32 gradients
    and no copy, as FSDP2 reshards). Between the last backward and `refresh` the module's parameters have
    no storage: `train.train_step` refreshes them on its way out, an exception included.

    Built with `dtype=None` (FSDP2 keeps its own masters) or where the parameters already are in the compute
    dtype, it holds no copies: `trainable` are the module's own parameters and the rest does nothing.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None):
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]] = []
        self._masters: list[torch.nn.Parameter] = []
        self._copies: list[torch.nn.Parameter] = []
        self._free_folded = False
        if dtype is None:
            return
        # A frozen weight needs no master: it is cast once to the compute dtype (only ever narrowed: a wider
        # compute dtype goes through FSDP2, `shards_with_fsdp`).
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        copies: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        for master in self.trainable:
            if master.dtype != dtype:
                copy = torch.nn.Parameter(master.detach().to(dtype))
                copy.register_post_accumulate_grad_hook(self._folding_into(master))
                copies[master] = copy
        for module in model.modules():  # every slot of a parameter, tied ones (embeddings and head) included
            for name, p in module._parameters.items():
                if p is not None and p in copies:
                    self._slots.append((module, name, p, copies[p]))
        self._masters, self._copies = list(copies), list(copies.values())
        self._install(masters=False)

    def last_micro_batch(self, last: bool) -> None:
        """Whether the backward to come is the step's last: then each copy is freed once its gradient is
        folded (the micro-batches before it compute on the copies again)."""
        self._free_folded = last

    def _install(self, masters: bool) -> None:
        for module, name, master, copy in self._slots:
            module._parameters[name] = master if masters else copy

    @torch.no_grad()
    def refresh(self) -> None:
        """Every compute copy from its master (after a step, or after a checkpoint was read into them)."""
        for copy in self._copies:
            storage = copy.untyped_storage()
            if storage.size() == 0:  # freed once its gradient was folded
                storage.resize_(copy.nbytes)
        if self._copies:
            torch._foreach_copy_(self._copies, self._masters)

    def _folding_into(self, master: torch.nn.Parameter) -> Callable[[torch.nn.Parameter], None]:
        def fold(copy: torch.nn.Parameter) -> None:
            if master.grad is None:
                master.grad = copy.grad.to(master.dtype)
            else:
                master.grad.add_(copy.grad)
            copy.grad = None
            if self._free_folded:  # nothing reads it again before `refresh`
                copy.untyped_storage().resize_(0)
        return fold

    @contextlib.contextmanager
    def masters_installed(self) -> Iterator[None]:
        """The masters in the module, for what reads or writes its weights as trained (checkpoints, export)."""
        self._install(masters=True)
        try:
            yield
        finally:
            self._install(masters=False)


def one_gpu_shards(model: torch.nn.Module, shard_size: int, offload: bool, dtype: torch.dtype) -> dict:
    """FSDP2 options where each shard is a whole GPU's copy (DDP, FSDP on one rank): frozen weights in the
    compute dtype (a LoRA base in bf16; identical on every replica) need no gathering, no reduction, no
    cast and no optimizer, so they stay plain tensors outside FSDP instead of being copied into a gathered
    buffer for every block's forward and backward; so do a 4-bit base's codes (QLoRA), which only their own
    modules read. Frozen weights in another floating dtype stay in FSDP, which casts them; offloading keeps
    everything in FSDP, which is what moves it to the host."""
    if shard_size > 1 or offload:
        return {}
    frozen = {p for p in model.parameters()
              if not p.requires_grad and (p.dtype == dtype or not p.is_floating_point())}
    return {"ignored_params": frozen} if frozen else {}


def gradient_sync(model: torch.nn.Module, cfg: JobConfig, last_micro_batch: bool) -> None:
    """Across replicas (DDP, HSDP), gradients are all-reduced once per optimizer step, on the last
    micro-batch; within a shard group they are reduce-scattered every micro-batch (holding unsharded
    gradients instead would cost the memory sharding saves)."""
    if cfg.strategy.type in ("ddp", "hsdp"):
        model.set_requires_all_reduce(last_micro_batch)
