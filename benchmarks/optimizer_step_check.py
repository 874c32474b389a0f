"""The optimizer step of full fine-tuning on one GPU, alone: Bf16AdamW's fused kernel against its eager update,
and torch's fused fp32 AdamW (the fp32-masters path) beside them, on the parameter tensors of a Llama model
(random values, gradients set). Prints seconds a step, the bytes a parameter each moves at the GPU's measured
copy bandwidth, and the fused kernel's ratio to the eager update; the planner counts 14 bytes a parameter for the
fused step (`BF16_STATE_ADAMW_BYTES_PER_PARAM`).

  python benchmarks/optimizer_step_check.py --model llama-8b --out benchmarks/results/optimizer_step_h200_<date>.json
  TRITON_INTERPRET=1 python benchmarks/optimizer_step_check.py --smoke --out /tmp/o.json   # CPU: the code paths
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tunewright_jobs.bf16_adamw import Bf16AdamW

SHAPES = {  # hidden, key/value width, intermediate, layers, vocab, tied head: as the GPU benchmarks' Llama configs
    "llama-1b": (2048, 512, 8192, 16, 128256, True),
    "llama-8b": (4096, 1024, 14336, 32, 128256, False),
    "smoke": (64, 32, 128, 2, 256, False),
}


def parameters(model: str, dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    """A Llama's parameter tensors, gradients set."""
    hidden, kv, intermediate, layers, vocab, tied = SHAPES[model]
    shapes = [(vocab, hidden)] * (1 if tied else 2) + [(hidden,)]
    shapes += layers * [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (intermediate, hidden),
                        (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device) * 0.02)
        p.grad = torch.randn(shape, dtype=dtype, device=device) * 1e-3
        params.append(p)
    return params


def seconds_per_step(optimizer: torch.optim.Optimizer, device: str, repeats: int) -> float:
    optimizer.step()  # the states are made (and kernels compiled) outside the timing
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str) -> float:
    """Bytes a second a device-to-device copy of 2 GiB moves (read + write)."""
    source = torch.empty(1 << 30, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    if device == "cuda":
        torch.cuda.synchronize()
    return 5 * 2 * source.numel() * 2 / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-8b", choices=[m for m in SHAPES if m != "smoke"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (fused: Triton's interpreter)")
    args = parser.parse_args()
    model, device = ("smoke", "cpu") if args.smoke else (args.model, "cuda")
    bandwidth = copy_bandwidth(device) if device == "cuda" else None
    rows = []
    for name, dtype, make in (
            ("bf16-fused", torch.bfloat16, lambda ps: Bf16AdamW(ps, lr=1e-5, weight_decay=0.01, fused=True)),
            ("bf16-eager", torch.bfloat16, lambda ps: Bf16AdamW(ps, lr=1e-5, weight_decay=0.01, fused=False)),
            ("fp32-torch-fused", torch.float32,
             lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, fused=device == "cuda"))):
        params = parameters(model, dtype, device)
        count = sum(p.numel() for p in params)
        seconds = seconds_per_step(make(params), device, args.repeats)
        row = {"name": name, "parameters": count, "seconds_per_step": seconds}
        if bandwidth:
            row["bytes_per_parameter_at_copy_bandwidth"] = seconds * bandwidth / count
        rows.append(row)
        print(f"{name:18} {count / 1e6:9.1f}M parameters  {seconds * 1e3:9.1f} ms/step"
              + (f"  {row['bytes_per_parameter_at_copy_bandwidth']:6.1f} B/param" if bandwidth else ""), flush=True)
        del params
        if device == "cuda":
            torch.cuda.empty_cache()
    by_name = {r["name"]: r for r in rows}
    ratio = by_name["bf16-eager"]["seconds_per_step"] / by_name["bf16-fused"]["seconds_per_step"]
    print(f"fused over eager: {ratio:.2f}x" + (" (the interpreter: code paths, not a speed)" if args.smoke else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": model, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "runs": rows,
        "fused_over_eager": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
