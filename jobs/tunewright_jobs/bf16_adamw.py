"""AdamW on bf16 weights and bf16 moments, each update rounded stochastically (`optimizer_state: bf16`).

Full fine-tuning with fp32 master weights holds 16 bytes a parameter between steps (weights, two moments, and
the gradient while it is made); this holds 8 (bf16 weights, two bf16 moments, a bf16 gradient), which is what
lets an 8B model train on one 141 GB GPU without offloading. Rounding an update to the nearest bf16 would lose
every update smaller than half a bf16 step of the weight (2^-9 of it): most of them, late in training. Rounded
up or down at random, in proportion to where the exact value falls between its two neighbours, each rounding is
exact in expectation, so small updates accumulate as they would in fp32 (Gupta et al. 2015, "Deep Learning with
Limited Numerical Precision"; Zamirai et al. 2020 for bf16 weights and moments).

The arithmetic of a step is fp32 (AdamW's, as torch's: decoupled weight decay, bias-corrected moments); only
what is stored is bf16. On a GPU it is one Triton kernel per parameter (bf16_adamw_fused.py: each element read and
written once); elsewhere eager torch, a chunk of each tensor at a time, so its fp32 temporaries stay small. The
random bits of a parameter's update are keyed by (the job's seed, the step, the parameter's place): every replica
of a parameter (DDP, HSDP) rounds it the same way and stays identical to the others, and a resumed run draws what
an uninterrupted one would, with nothing to checkpoint.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

ROUNDING_BITS = 16  # an fp32 keeps 16 more mantissa bits than a bf16
CHUNK_ELEMENTS = 1 << 24  # per update: ~24 bytes of fp32 temporaries an element, ~400 MB at most


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), in place; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """`value` (fp32, overwritten) into `target` (bf16), rounded to one of its two bf16 neighbours at random, the
    farther one with probability the share of the gap `value` covers: random low bits added to the fp32 pattern
    carry into the kept bits exactly that often, and truncation drops them. A NaN stays a NaN (its bits would
    wrap), so that a diverged run still shows it."""
    nan = value.isnan()
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << ROUNDING_BITS, value.shape, dtype=torch.int32, device=value.device,
                          generator=generator)
    bits.add_(noise).bitwise_and_(-(1 << ROUNDING_BITS))  # the kept bits of value + noise, in place
    target.copy_(value.masked_fill_(nan, float("nan")))  # exact: the dropped bits are zero


@functools.cache
def _fused_kernel():
    """The fused update's module, or None where Triton does not import (said once)."""
    try:
        from tunewright_jobs import bf16_adamw_fused
    except ImportError as err:
        log.warning("bf16 optimizer state: Triton is not importable (%s); the update runs in eager torch", err)
        return None
    return bf16_adamw_fused


class Bf16AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, for bf16 parameters and moments, stored with stochastic rounding.

    `fused`: None (default) fuses the update of a CUDA parameter when Triton imports; True fuses every one (a CPU
    tensor needs Triton's interpreter: the tests); False never does."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, seed: int = 0, fused: bool | None = None):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self.fused = fused

    def _kernel_for(self, *tensors: torch.Tensor):
        """The fused update's module where it updates these tensors, else None (the eager update)."""
        if self.fused is False or (self.fused is None and not tensors[0].is_cuda):
            return None
        kernel = _fused_kernel()
        if kernel is None and self.fused:
            raise RuntimeError("Bf16AdamW(fused=True) needs Triton")
        return kernel if kernel is not None and all(kernel.fits(t) for t in tensors) else None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Bf16AdamW takes no closure")
        place = 0  # the parameter's index over the groups: the same on every rank
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                place += 1
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"Bf16AdamW steps bf16 parameters, got a {tuple(p.shape)} one in {p.dtype}: "
                                    "hyperparameters.optimizer_state bf16 loads the model in bf16")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                seed = hash((self.seed, int(step), place)) & (2**63 - 1)
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                if (kernel := self._kernel_for(*tensors)) is not None:
                    kernel.adamw_update_(*tensors, step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                                         eps=group["eps"], weight_decay=group["weight_decay"], seed=seed)
                    continue
                generator = torch.Generator(device=tensors[0].device)
                generator.manual_seed(seed)
                for chunk in zip(*(t.view(-1).split(CHUNK_ELEMENTS) for t in tensors), strict=True):
                    self._update(*chunk, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                 generator)

    @staticmethod
    def _update(p, grad, exp_avg, exp_avg_sq, step: float, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, generator: torch.Generator) -> None:
        g = grad.float()
        m = exp_avg.float().mul_(beta1).add_(g, alpha=1 - beta1)
        v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denominator = (v / (1 - beta2 ** step)).sqrt_().add_(eps)
        weights = p.float()
        if weight_decay:
            weights.mul_(1 - lr * weight_decay)
        weights.addcdiv_(m, denominator, value=-lr / (1 - beta1 ** step))
        stochastic_round_(p, weights, generator)
        stochastic_round_(exp_avg, m, generator)
        stochastic_round_(exp_avg_sq, v, generator)
