"""Where a profiled window's GPU time went: kernels grouped by kind, the top kernels, and the share of the
window the GPU was idle (launch-bound or waiting on the host). Reads the Chrome traces the runtime writes
with `metrics.profile.trace_dir` (vs_hf.py --trace).

  python benchmarks/trace_summary.py TRACE.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "core"))
from tunewright_jobs.commshare import chrome_trace_events, covered, kernel_kind  # noqa: E402


def summarize(trace: dict, top: int) -> str:
    gpu = [e for e in chrome_trace_events(trace) if e.kind in ("kernel", "gpu_memcpy")]
    if not gpu:
        return "no GPU kernels in this trace"
    window = (max(e.end_ns for e in gpu) - min(e.start_ns for e in gpu)) / 1e6  # ms
    busy = covered([(e.start_ns, e.end_ns) for e in gpu]) / 1e6
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in gpu:
        ms = (e.end_ns - e.start_ns) / 1e6
        by_kind[kernel_kind(e.name)] += ms
        by_name[e.name][0] += ms
        by_name[e.name][1] += 1
    lines = [f"window {window:.1f} ms, GPU busy {busy / window:.1%} (idle {1 - busy / window:.1%}), "
             f"{len(gpu)} kernels", "", f"{'kind':28} {'ms':>9} {'share':>7}"]
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"{kind:28} {ms:>9.1f} {ms / window:>7.1%}")
    lines += ["", f"{'kernel':90} {'ms':>8} {'calls':>6}"]
    for name, (ms, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{name[:90]:90} {ms:>8.2f} {calls:>6}")
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
