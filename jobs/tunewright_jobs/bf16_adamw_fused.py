"""Bf16AdamW's update as one Triton kernel: each element read once (weight, gradient, two moments: 8 bytes in bf16)
and written once (weight and moments: 6 bytes), where the eager update moves ~244 bytes an element through its
fp32 temporaries and roundings. The same arithmetic (fp32, torch's AdamW) and the same stochastic rounding (random
low bits added to the fp32 pattern, then truncated; a NaN kept), with the random bits from Philox keyed by the
optimizer's (seed, step, parameter) seed and the element's index: replicas and resumed runs draw the same bits,
as with the eager update (whose bits come from torch's generator, so the two paths round differently, each
unbiased).

Imported only where it runs: a CUDA parameter, or Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024
MAX_ELEMENTS = 2**31 - BLOCK  # the kernel's element index is 32-bit


@triton.jit
def _stochastic_round(value, noise):
    """`value` (fp32) to bf16, up or down at random: 16 random low bits added to its pattern, then dropped."""
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + (noise & 0xFFFF).to(tl.int32)) & -65536
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(value != value, value, rounded).to(tl.bfloat16)  # a NaN's bits would wrap: kept as NaN


@triton.jit(do_not_specialize=["seed"])  # one compiled kernel whatever the step's seed
def _adamw_kernel(weight_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n, lr, beta1, beta2, eps, decay,
                  step_size, bias_correction2, seed, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offsets < n
    weight = tl.load(weight_ptr + offsets, mask=inside).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside).to(tl.float32)
    exp_avg = exp_avg * beta1 + grad * (1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + grad * grad * (1 - beta2)
    denominator = tl.sqrt(exp_avg_sq / bias_correction2) + eps
    weight = weight * (1 - lr * decay) - step_size * exp_avg / denominator
    noise_weight, noise_avg, noise_avg_sq, _ = tl.randint4x(seed, offsets)
    tl.store(weight_ptr + offsets, _stochastic_round(weight, noise_weight), mask=inside)
    tl.store(exp_avg_ptr + offsets, _stochastic_round(exp_avg, noise_avg), mask=inside)
    tl.store(exp_avg_sq_ptr + offsets, _stochastic_round(exp_avg_sq, noise_avg_sq), mask=inside)


def fits(t: torch.Tensor) -> bool:
    """Whether one launch can update `t`: its elements contiguous (the kernel walks memory from its start) and
    indexed in 32 bits."""
    return t.is_contiguous() and t.numel() <= MAX_ELEMENTS


def adamw_update_(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  seed: int) -> None:
    """One AdamW step of bf16 `weight` and moments, in place, from a bf16 `grad` (all contiguous, one device)."""
    n = weight.numel()
    # Triton launches on the current device: the tensors' own
    with torch.cuda.device(weight.device) if weight.is_cuda else contextlib.nullcontext():
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            weight, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay, lr / (1 - beta1 ** step),
            1 - beta2 ** step, seed, BLOCK_SIZE=BLOCK)
