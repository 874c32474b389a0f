"""The fused output head + cross-entropy, forward + backward, on the benchmark's shapes: the runtime's chunk
arithmetic against the one it replaced, and Liger's fused linear cross-entropy where it is installed.

Times, on one GPU, in one process, `kernels.fused_linear_cross_entropy` over the same bf16 hidden states,
head and labels (10% of them ignored), with:
- `runtime`: the chunk's gradient written as one elementwise expression (softmax - one-hot);
- `scatter (before)`: the previous arithmetic (an fp32 softmax, a scatter-add of -1, then the mask and the
  cast), compiled as it was (dynamic shapes);
- `liger`: `LigerFusedLinearCrossEntropyLoss(reduction="sum")` (its own Triton kernel);
and checks each loss and gradient against the runtime's. Prints ms per forward+backward, writes JSON.

  python benchmarks/fused_loss_kernels.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from tunewright_jobs import kernels  # noqa: E402
from tunewright_jobs.data import IGNORE_INDEX  # noqa: E402

SHAPES = {  # name: (tokens of a micro-batch, hidden, vocabulary): the vs_hf cases' heads
    "gpt2-124m mb32 s1024": (32 * 1024, 768, 50257),
    "llama-1b mb8 s2048": (8 * 2048, 2048, 128256),
    "llama-8b mb4 s1024": (4 * 1024, 4096, 128256),
}


def scatter_chunk(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's chunk arithmetic before this benchmark (the baseline)."""
    dtype, logits = logits.dtype, logits.float()
    if logits.shape[-1] > vocab:
        column = torch.arange(logits.shape[-1], device=logits.device)
        logits = torch.where(column < vocab, logits, float("-inf"))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(-1, target[:, None]).squeeze(-1)) * valid).sum()
    grad = torch.exp(logits - lse[:, None])
    grad.scatter_add_(-1, target[:, None], -torch.ones_like(grad[:, :1]))
    return loss, (grad * valid[:, None]).to(dtype)


def with_chunk(chunk_fn):
    def call(hidden, weight, labels):
        kernels._compiled_chunk = chunk_fn
        return kernels.fused_linear_cross_entropy(hidden, weight, labels)
    return call


def liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", ignore_index=IGNORE_INDEX)
    return lambda hidden, weight, labels: loss(weight, hidden, labels)


def time_ms(fn, hidden, weight, labels, repeats: int = 10) -> float:
    for _ in range(3):
        fn(hidden, weight, labels).backward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(hidden, weight, labels).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    variants = {"runtime": torch.compile(kernels._chunk_loss_and_logit_grad, dynamic=False),
                "scatter (before)": torch.compile(scatter_chunk, dynamic=True)}
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "shapes": {}}
    print(f"{'shape':24} {'variant':18} {'ms fwd+bwd':>10} {'vs before':>9} {'|loss diff|':>11} {'max |grad diff|':>15}")
    for name, (tokens, hidden_size, vocab) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        weight = (torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
        labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        labels[torch.rand(tokens, device="cuda", generator=gen) < 0.1] = IGNORE_INDEX
        calls = {label: with_chunk(fn) for label, fn in variants.items()}
        try:
            calls["liger"] = liger()
        except ImportError as exc:
            results.setdefault("liger", f"not run: {exc}")
        rows, reference = {}, None
        for label, fn in calls.items():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            try:
                loss = fn(h, w, labels)
                loss.backward()
                values = [loss.detach().float(), h.grad.float(), w.grad.float()]
                reference = reference or values
                loss_diff = (values[0] - reference[0]).abs().item() / max(reference[0].abs().item(), 1e-9)
                grad_diff = max((a - r).abs().max().item() for a, r in zip(values[1:], reference[1:], strict=True))
                h.grad = w.grad = None
                ms = time_ms(fn, h, w, labels)
                rows[label] = {"ms": ms, "loss_rel_diff": loss_diff, "max_abs_grad_diff": grad_diff}
            except Exception as exc:  # a variant that cannot run here: say why
                rows[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        before = rows.get("scatter (before)", {}).get("ms")
        for label, row in rows.items():
            if "error" in row:
                print(f"{name:24} {label:18} {row['error'][:80]}")
                continue
            print(f"{name:24} {label:18} {row['ms']:>10.2f} {(before / row['ms'] if before else float('nan')):>8.2f}x "
                  f"{row['loss_rel_diff']:>11.2e} {row['max_abs_grad_diff']:>15.2e}")
        results["shapes"][name] = {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "variants": rows}
        del hidden, weight
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
