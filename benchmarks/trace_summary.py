"""Where a profiled window's GPU time went: kernels grouped by kind, the top kernels, and the share of the
window the GPU was idle (launch-bound or waiting on the host). Reads the Chrome traces the runtime writes
with `metrics.profile.trace_dir` (vs_hf.py --trace).

  python benchmarks/trace_summary.py TRACE.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
from tunewright_jobs.commshare import covered, merge  # noqa: E402

KINDS = [  # first match wins
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cutlass.*attn", re.I)),
    ("matmul", re.compile(r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul|wgmma", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat|chunk_cat|split_with_sizes", re.I)),
    ("compiled (triton)", re.compile(r"^triton_", re.I)),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other elementwise/reduction")


def summarize(trace: dict, top: int) -> str:
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                       "gpu_memset")]
    if not kernels:
        return "no GPU kernels in this trace"
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = covered(merge([(int(e["ts"] * 1000), int((e["ts"] + e["dur"]) * 1000)) for e in kernels])) / 1000
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    window = end - start
    lines = [f"window {window / 1000:.1f} ms, GPU busy {busy / window:.1%} (idle {1 - busy / window:.1%}), "
             f"{len(kernels)} kernels", "", f"{'kind':28} {'ms':>9} {'share':>7}"]
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"{kind:28} {dur / 1000:>9.1f} {dur / window:>7.1%}")
    lines += ["", f"{'kernel':90} {'ms':>8} {'calls':>6}"]
    for name, (dur, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{name[:90]:90} {dur / 1000:>8.2f} {calls:>6}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.traces:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as fh:
            print(f"== {path}\n{summarize(json.load(fh), args.top)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
