"""Goodput of small local jobs: each job starting a Ray of its own, against the server's one Ray (issue 37).

For each mode, `tunewright serve` on a fresh data folder (the local backend, as users run it), then the
quickstart's tiny LoRA job (the tiny kit, no download) submitted N times one after the other, as `submit
--watch` would. Per job: the wait from submit to the run starting, from starting to its first step, the time
the workers were held, the time in training steps, and goodput (the API's: steps over held time). Prints a
table and the ratio of the modes' median goodput; writes the raw figures as JSON.

  python benchmarks/local_goodput.py --jobs 3 --steps 30 --out benchmarks/results/local_goodput_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "tw-goodput-benchmark-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(data_dir: Path, shared_ray: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "TUNEWRIGHT_DATA_DIR": str(data_dir), "TUNEWRIGHT_ADMIN_TOKEN": ADMIN,
           "TUNEWRIGHT_LOCAL_SHARED_RAY": "true" if shared_ray else "false", "TOKENIZERS_PARALLELISM": "false"}
    log = (data_dir / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tunewright_api.cli", "serve", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit(f"the API did not start: {data_dir / 'serve.log'}")


def unix(moment: str | None) -> float | None:
    """An API time (ISO 8601; UTC where it names no zone) as Unix seconds."""
    if not moment:
        return None
    parsed = datetime.fromisoformat(moment)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def since(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def run_mode(shared_ray: bool, kit: Path, jobs: int, steps: int) -> list[dict]:
    data_dir = Path(tempfile.mkdtemp(prefix="tw-goodput-"))
    proc, url = serve(data_dir, shared_ray)
    try:
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        token = admin.post("/v1/tokens", json={"tenant": "bench"}).json()["token"]
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        with (kit / "data" / "train.jsonl").open("rb") as f:
            uploaded = client.post("/v1/files", files={"file": ("train.jsonl", f)}, data={"purpose": "fine-tune"})
        if uploaded.status_code not in (200, 201):
            raise SystemExit(f"upload refused: {uploaded.text}")
        train = uploaded.json()
        spec = {"model": {"source": str(kit / "tiny-gpt2")}, "method": {"type": "lora"},
                "dataset": {"train": train["id"], "format": "chat"},
                "hyperparameters": {"maxSteps": steps, "learningRate": 0.005, "globalBatchSize": 8, "seqLen": 256}}
        out = []
        for _ in range(jobs):
            submitted = time.time()
            submitted_response = client.post("/v1/jobs", json=spec)
            if submitted_response.status_code != 201:
                raise SystemExit(f"refused: {submitted_response.text}")
            job = submitted_response.json()
            while (job := client.get(f"/v1/jobs/{job['id']}").json())["status"] not in ("succeeded", "failed",
                                                                                          "cancelled"):
                time.sleep(0.5)
            events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
            first_step = min((e["createdAt"] for e in events if e.get("type") == "metrics"
                              and (e.get("data") or {}).get("trainLoss") is not None), default=None)
            diagnosis = client.get(f"/v1/jobs/{job['id']}/diagnosis").json()
            out.append({"shared_ray": shared_ray, "job": job["id"], "status": job["status"],
                        "queued_seconds": since(submitted, unix(job.get("startedAt"))),
                        "start_to_first_step_seconds": since(unix(job.get("startedAt")), first_step),
                        "held_seconds": since(unix(job.get("startedAt")), unix(job.get("finishedAt"))),
                        "step_seconds": diagnosis.get("measuredStepSeconds"), "steps": steps,
                        "goodput": diagnosis.get("goodput")})
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kit = Path(tempfile.mkdtemp(prefix="tw-kit-")) / "kit"
    subprocess.run([sys.executable, "-m", "tunewright_jobs.tiny", "build", "--out", str(kit)], check=True,
                   capture_output=True)
    rows = [*run_mode(False, kit, args.jobs, args.steps), *run_mode(True, kit, args.jobs, args.steps)]
    print(f"{'mode':14} {'job':32} {'status':10} {'queued':>7} {'to 1st step':>11} {'held':>7} {'goodput':>8}")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{'server Ray' if r['shared_ray'] else 'Ray per job':14} {r['job']:32} {r['status']:10} "
              f"{fmt(r['queued_seconds']):>7} {fmt(r['start_to_first_step_seconds']):>11} {fmt(r['held_seconds']):>7} "
              f"{'-' if r['goodput'] is None else format(r['goodput'], '.0%'):>8}")
    medians = {mode: statistics.median([r["goodput"] for r in rows if r["shared_ray"] == mode and r["goodput"]])
               for mode in (False, True)}
    print(f"median goodput: Ray per job {medians[False]:.0%}, server Ray {medians[True]:.0%} "
          f"({medians[True] / medians[False]:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(),
                                        "date": datetime.now().isoformat(timespec="seconds"), "jobs": args.jobs,
                                        "steps": args.steps, "rows": rows,
                                        "median_goodput": {"ray_per_job": medians[False],
                                                           "server_ray": medians[True]}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
