"""FP8 matrix products for the decoder blocks' linear layers (`strategy.precision: fp8`), tensor-wise scaled.

Each product casts its two operands to FP8 with one scale per tensor (the largest magnitude maps to the format's
largest value) and multiplies them with `torch._scaled_mm` (Hopper's FP8 tensor cores: twice bf16's rate),
accumulating in fp32 and writing bf16. Forward takes activations and weights in E4M3 (more mantissa); backward
takes the output's gradient in E5M2 (more range): the input's gradient is E5M2 x E4M3 and, where the weight
trains, the weight's gradient is E5M2 x E4M3 too; backward saves the input, in FP8, only for that gradient.

A frozen weight that stays a plain tensor on the GPU (a LoRA base on one-GPU shards: single, ddp) is cast once, by
`keep_frozen_casts` after the model is placed, and kept as that cast alone: the weight becomes a meta parameter of
its shape and dtype (its bf16 storage freed), a byte a weight where bf16 took two. Nothing reads a frozen base's
weights after that (checkpoints hold the trained weights only, a merged export loads the base anew); reading its
values would raise (a meta tensor has none), never return stale numbers. Any other weight (trained, or gathered by
FSDP) is cast in each forward and again in backward.

Everything here is plain tensor code that torch.compile traces whole, so a compiled block fuses each cast into the
work before it (the norm before q, k and v; the product before the output's gradient). The output head, attention
and norms stay in the compute dtype, as do the adapters' products. torchao's float8 training ("tensorwise") is the
reference design.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_ALIGNMENT = 16  # `_scaled_mm` wants both dimensions of each operand divisible by 16
SMALLEST_AMAX = 1e-12  # an all-zero tensor still gets a finite scale


def _to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    largest = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=SMALLEST_AMAX)
    scale = largest / amax
    return (x.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


_compiled_to_fp8: object = None  # the compiled cast; False once compiling failed


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in FP8 scaled so that its largest magnitude is the format's largest value, and the inverse scale
    (fp32, a scalar) that `_scaled_mm` multiplies the product by. Inside a compiled block, traced with it; else on
    CUDA compiled on its own into a reduction and one elementwise pass (eager, its fp32 temporaries would move five
    times the bytes), unless compiling fails there (then eager, said once); eager on the CPU."""
    global _compiled_to_fp8
    if torch.compiler.is_compiling() or x.device.type != "cuda" or _compiled_to_fp8 is False:
        return _to_fp8(x, dtype)
    if _compiled_to_fp8 is None:
        _compiled_to_fp8 = torch.compile(_to_fp8, dynamic=True)
    try:
        return _compiled_to_fp8(x, dtype)
    except Exception as err:  # no Triton or C compiler on the worker: slower, not wrong
        log.warning("fp8: compiling the casts failed (%s); they run eager", str(err).splitlines()[0][:200])
        _compiled_to_fp8 = False
        return _to_fp8(x, dtype)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column by column (what `_scaled_mm` takes as its second operand)."""
    return t.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    """x (tokens, in) @ W^T (in, out) in FP8, bf16 out; gradients for x and, when it trains, W. `weight` is
    either the weight (cast here, and again in backward) or, with `kept_inverse`, a frozen weight's kept cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, kept_inverse: torch.Tensor | None) -> torch.Tensor:
        x8, x_inverse = to_fp8(x, E4M3)
        ctx.kept = kept_inverse is not None
        w8, w_inverse = (weight, kept_inverse) if ctx.kept else to_fp8(weight, E4M3)
        # forward accumulates fast (as torchao's forward does); the gradients' products accumulate exactly
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse, out_dtype=x.dtype,
                               use_fast_accum=True)
        ctx.weight_trains = weight.requires_grad and not ctx.kept
        # Backward reads the input only for a trained weight's gradient; and the kept cast, else the weight
        # itself, cast again there: an FP8 copy held from forward to backward would be a whole unsharded weight
        # per block, what FSDP's resharding saves.
        ctx.save_for_backward(*((x8, x_inverse) if ctx.weight_trains else ()),
                              *((weight, kept_inverse) if ctx.kept else (weight,)))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = list(ctx.saved_tensors)
        x8, x_inverse = (saved.pop(0), saved.pop(0)) if ctx.weight_trains else (None, None)
        w8, w_inverse = (saved[0], saved[1]) if ctx.kept else to_fp8(saved[0], E4M3)
        g8, g_inverse = to_fp8(grad.contiguous(), E5M2)
        grad_x = torch._scaled_mm(g8, column_major(w8), scale_a=g_inverse, scale_b=w_inverse, out_dtype=grad.dtype)
        grad_w = None
        if ctx.weight_trains:  # (out, tokens) @ (tokens, in)
            grad_w = torch._scaled_mm(g8.t().contiguous(), column_major(x8), scale_a=g_inverse, scale_b=x_inverse,
                                      out_dtype=grad.dtype)
        return grad_x, grad_w, None


class Float8Linear(torch.nn.Linear):
    """An `nn.Linear` whose product runs in FP8 (PEFT adapts it as the Linear it is). `weight_fp8`: a frozen
    weight's kept cast and `weight_inverse_scale` its scale, set by `keep_frozen_casts` (plain attributes, not
    buffers: no state dict carries them, no module move or broadcast touches them)."""

    weight_fp8: torch.Tensor | None = None
    weight_inverse_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        tokens = flat.shape[0]
        # `_scaled_mm` takes whole tiles of 16 rows (an evaluation batch, a generated token may leave fewer): zero
        # rows added change no scale and no product, and are cut from the result
        if tokens % FP8_ALIGNMENT:
            flat = torch.nn.functional.pad(flat, (0, 0, 0, -tokens % FP8_ALIGNMENT))
        if self.weight_fp8 is not None:
            out = _Float8Matmul.apply(flat, self.weight_fp8, self.weight_inverse_scale)
        else:
            out = _Float8Matmul.apply(flat, self.weight, None)
        out = out[:tokens]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def fp8_able(module: torch.nn.Linear) -> bool:
    return module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0


def convert_blocks_to_fp8(blocks: list[torch.nn.Module]) -> int:
    """Every linear layer of the decoder blocks whose shape FP8 products take, made a `Float8Linear` in place (its
    parameters kept); returns how many."""
    converted = 0
    for block in blocks:
        for module in block.modules():
            if type(module) is torch.nn.Linear and fp8_able(module):
                module.__class__ = Float8Linear
                converted += 1
    return converted


@torch.no_grad()
def keep_frozen_casts(blocks: list[torch.nn.Module], device: torch.device) -> int:
    """Each FP8 layer whose weight is frozen and a plain tensor on `device` (not one FSDP shards, gathers and
    offloads: a DTensor), cast once and kept as that cast alone: the module's weight becomes a meta parameter of
    the same shape and dtype, and the old one's storage is freed where it owns it whole (a view of a storage shared
    with other weights is left to them); returns how many."""
    kept = 0
    for block in blocks:
        for module in block.modules():
            weight = module.weight if isinstance(module, Float8Linear) else None
            if weight is None or weight.requires_grad or type(weight.data) is not torch.Tensor \
                    or weight.device != device:
                continue
            module.weight_fp8, module.weight_inverse_scale = to_fp8(weight, E4M3)
            module.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            if weight.storage_offset() == 0 and weight.untyped_storage().nbytes() == weight.nbytes:
                weight.untyped_storage().resize_(0)  # what else holds the old one (FSDP's ignored set) holds no bytes
            kept += 1
    return kept
