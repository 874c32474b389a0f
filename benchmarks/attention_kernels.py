"""Causal attention, forward + backward, on the benchmark's shapes: which kernel the runtime should call for
rows of one document each (fixed length) and for packed rows (issue 12's attention lever).

Times, on one GPU, in one process, the same bf16 q/k/v through:
- `varlen`: torch.nn.attention.varlen.varlen_attn over the row offsets (FlashAttention-2; what the
  runtime calls today for every row);
- `sdpa-flash`, `sdpa-cudnn`, `sdpa-efficient`: scaled_dot_product_attention with is_causal, one backend
  forced each;
and checks each output and gradient against `varlen`'s (max abs difference). Then packed rows (documents of
many lengths) through the varlen kernels only: the runtime's call, the kernel given fewer key/value heads
as they are, and torch's cuDNN branch of varlen_attn. Prints tables of ms per forward+backward and TFLOP/s
(causal: half the square), writes JSON.

  python benchmarks/attention_kernels.py --out OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (batch, seq, heads, kv_heads, head_dim): the vs_hf cases' attention
    "gpt2-124m mb32 s1024": (32, 1024, 12, 12, 64),
    "llama-1b mb8 s2048": (8, 2048, 32, 8, 64),
    "llama-8b mb4 s1024": (4, 1024, 32, 8, 128),
}


def flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    # forward 2 matmuls of 2*s*s*d per head, backward 2.5x that; causal: half
    return 3.5 * 4 * batch * heads * seq * seq * head_dim / 2


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v):  # q: [b, s, h, d] as the models hold it before the transpose
        with sdpa_kernel(backend):
            gqa = q.shape[2] != k.shape[2]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)
    return call


def varlen(q, k, v):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
    from tunewright_jobs.kernels import _varlen_call

    b, s = q.shape[:2]
    offsets = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    return _varlen_call()(*flat, offsets, s, q.shape[-1] ** -0.5).reshape(q.shape)


# Packed rows: documents of these lengths, in turn, filling rows of the shape's length (the rest of a row a
# document of its own, as the runtime packs): the varlen kernels only
PACKED_LENGTHS = (956, 310, 1500, 77, 640, 2048, 1200, 420)


def packed_offsets(batch: int, seq: int) -> torch.Tensor:
    offsets, lengths = [0], iter(PACKED_LENGTHS * 100)
    for row in range(batch):
        at = 0
        while at < seq:
            at = min(seq, at + min(next(lengths), seq))
            offsets.append(row * seq + at)
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def varlen_packed(kind: str):
    """Flattened [tokens, heads, dim] q/k/v over `offsets`: the runtime's call (`runtime`), the kernel given
    fewer key/value heads without repeating them (`native-gqa`), or torch's cuDNN branch of varlen_attn
    (`cudnn`, switched on here; it takes no GQA, so the heads are repeated)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
    from torch.nn.attention import varlen as varlen_module

    from tunewright_jobs.kernels import _varlen_call

    runtime = _varlen_call()

    def call(q, k, v, offsets, longest):
        scale = q.shape[-1] ** -0.5
        if kind == "runtime":
            return runtime(q, k, v, offsets, longest, scale)
        causal = ({"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_module.varlen_attn).parameters
                  else {"is_causal": True})
        if kind == "cudnn":
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            saved = varlen_module._should_use_cudnn
            varlen_module._should_use_cudnn = lambda index: True
            try:
                return varlen_module.varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale, **causal)
            finally:
                varlen_module._should_use_cudnn = saved
        return varlen_module.varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale, **causal)
    return call


def packed_flops(offsets: torch.Tensor, heads: int, head_dim: int) -> float:
    lengths = (offsets[1:] - offsets[:-1]).double()
    return float(3.5 * 4 * heads * head_dim * (lengths * lengths).sum() / 2)


def time_ms(fn, q, k, v, grad, iters: int = 20) -> float:
    for _ in range(3):
        torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend

    kernels = {"varlen": varlen, "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
               "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
               "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
               "cudnn": torch.backends.cudnn.version(), "shapes": {}}
    print(f"{'shape':24} {'kernel':15} {'ms fwd+bwd':>10} {'TFLOP/s':>8} {'vs varlen':>9} {'max |diff|':>10}")
    for name, (b, s, h, kv, d) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        k = torch.randn(b, s, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        v = torch.randn(b, s, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        reference = None
        rows = {}
        for fn in kernels.values():  # every kernel warmed up (clocks, autotuning) before any is timed
            with contextlib.suppress(Exception):
                time_ms(fn, q, k, v, grad, iters=5)
        for kernel, fn in kernels.items():
            try:
                out = fn(q, k, v)
                grads = torch.autograd.grad(out, (q, k, v), grad)
                values = [out, *grads]
                if reference is None:
                    reference = values
                diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(values, reference, strict=True))
                ms = time_ms(fn, q, k, v, grad)
                rows[kernel] = {"ms": ms, "tflops": flops(b, s, h, d) / ms / 1e9, "max_abs_diff": diff}
            except Exception as exc:  # a backend that cannot run this shape: say why
                rows[kernel] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        base = rows.get("varlen", {}).get("ms")
        for kernel, row in rows.items():
            if "error" in row:
                print(f"{name:24} {kernel:15} {row['error'][:80]}")
                continue
            print(f"{name:24} {kernel:15} {row['ms']:>10.3f} {row['tflops']:>8.0f} "
                  f"{(base / row['ms'] if base else float('nan')):>8.2f}x {row['max_abs_diff']:>10.4f}")
        results["shapes"][name] = {"batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d, "kernels": rows}
    print(f"\n{'packed rows':24} {'kernel':15} {'ms fwd+bwd':>10} {'TFLOP/s':>8} {'vs runtime':>10} {'max |diff|':>10}")
    for name, (b, s, h, kv, d) in SHAPES.items():
        if s < 2048:
            continue
        offsets = packed_offsets(b, s)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        k = torch.randn(b * s, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        v = torch.randn(b * s, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        grad = torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        rows, reference = {}, None
        for kind in ("runtime", "native-gqa", "cudnn"):
            fn = varlen_packed(kind)
            bound = lambda q, k, v, fn=fn, offsets=offsets, s=s: fn(q, k, v, offsets, s)  # noqa: E731
            try:
                values = [bound(q, k, v), *torch.autograd.grad(bound(q, k, v), (q, k, v), grad)]
                reference = reference or values
                diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(values, reference, strict=True))
                ms = time_ms(bound, q, k, v, grad)
                rows[kind] = {"ms": ms, "tflops": packed_flops(offsets, h, d) / ms / 1e9, "max_abs_diff": diff}
                print(f"{name:24} {kind:15} {ms:>10.3f} {rows[kind]['tflops']:>8.0f} "
                      f"{rows['runtime']['ms'] / ms:>9.2f}x {diff:>10.4f}")
            except Exception as exc:
                rows[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"{name:24} {kind:15} {rows[kind]['error'][:80]}")
        results["packed"] = results.get("packed", {}) | {name: {"documents": len(offsets) - 1, "kernels": rows}}
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
