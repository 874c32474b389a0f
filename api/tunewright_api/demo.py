"""`make demo`: the whole path a user takes, on this machine.

Starts the API (SQLite, local backend), builds the tiny model kit, creates a tenant token, uploads the
dataset, submits a LoRA job through the REST API, watches it with a progress bar (and prints the link to its
page on the web dashboard), prints a summary, and shuts the API down, saying how to serve it again.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from tunewright_api.cli import Client, RequestFailed, ended, watch

DEMO_SPEC = {
    "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
    "dataset": {"format": "chat"},
    "hyperparameters": {"epochs": 8, "learningRate": 5e-3, "warmupRatio": 0.05, "globalBatchSize": 8,
                        "seqLen": 256, "seed": 0},
    "checkpoint": {"everySteps": 50},
    "evaluation": {"exactMatch": True, "maxNewTokens": 4},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api(data_dir: Path, port: int, admin_token: str, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TUNEWRIGHT_DATA_DIR": str(data_dir), "TUNEWRIGHT_ADMIN_TOKEN": admin_token,
           "TUNEWRIGHT_PUBLIC_URL": f"http://127.0.0.1:{port}", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "tunewright_api.cli", "serve", "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(client: Client, server: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.request("GET", "/healthz")
            return
        except RequestFailed:
            if server.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def dashboard_url(url: str, token: str, job_id: str) -> str:
    """The job's page on the dashboard, signed in: the token rides in the fragment, which the browser never sends
    (the page moves it to the tab's storage and clears it from the address bar)."""
    return f"{url}/ui/#token={token}&to=/jobs/{job_id}"


def serve_again(data_dir: Path, token: str, job_id: str) -> str:
    """How to look at the finished job after the demo: its API, on the same data, and the page's link."""
    tunewright = Path(sys.executable).with_name("tunewright")
    command = shlex.quote(str(tunewright)) if tunewright.exists() else f"{shlex.quote(sys.executable)} -m tunewright_api.cli"
    return (f"dashboard, later   the demo's API has stopped; to open the job again, serve its data:\n"
            f"                   TUNEWRIGHT_DATA_DIR={shlex.quote(str(data_dir))} {command} serve --port 8000\n"
            f"                   then open {dashboard_url('http://127.0.0.1:8000', token, job_id)}")


def communication(telemetry: dict) -> str:
    if telemetry["commShare"] is None:
        return "communication      not measured (the run was too short for a profiler window)"
    return (f"communication      {telemetry['commShare']:.1%} of the step in collectives, "
            f"{telemetry['commShareExposed']:.1%} not hidden by compute (measured at step "
            f"{telemetry['commMeasuredAtStep']}, gloo)")


def summary(job: dict, metrics: list[dict]) -> str:
    result, plan = job["result"], job["plan"]
    before, after = result["eval_before"], result["eval_after"]
    speeds = [m["tokens_per_second"] for m in metrics]
    elapsed = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])).total_seconds()
    return "\n".join([
        f"job                {job['id']} ({job['status']})",
        f"plan               {plan['explanation']}",
        f"optimizer steps    {result['steps']}, training loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}",
        f"validation loss    {before['val_loss']:.3f} -> {after['val_loss']:.3f}",
        f"token accuracy     {before['val_token_accuracy']:.1%} -> {after['val_token_accuracy']:.1%}",
        f"exact match        {before['exact_match']:.1%} -> {after['exact_match']:.1%}"
        f"  ({after['exact_match_examples']} held-out reviews)",
        f"trained tokens/s   {statistics.median(speeds):,.0f} (median), {job['progress']['trainedTokens']:,} tokens",
        communication(job["telemetry"]),
        f"cost               $0.00: the local pool has no price ({plan['workers']} CPU workers held {elapsed:.0f} s)",
        f"adapter            {result['export']['adapter']}",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-output"))
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out / "api", ignore_errors=True)  # a fresh service and job each time
    out.mkdir(parents=True, exist_ok=True)
    print("building the tiny model kit (random-init GPT-2, local tokenizer)...", flush=True)
    subprocess.run([sys.executable, "-m", "tunewright_jobs.tiny", "build", "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kit = json.loads((out / "job.json").read_text())  # the kit's own job config names its model and data

    port, admin = free_port(), "tw-" + secrets.token_urlsafe(24)
    server = start_api(out / "api", port, admin, out / "api.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(Client(url, None), server)
        print(f"API up at {url} (log {out / 'api.log'})", flush=True)
        token = Client(url, admin).request("POST", "/v1/tokens", json={"tenant": "demo"})["token"]
        client = Client(url, token)
        spec = {**DEMO_SPEC, "model": {"source": kit["model"]["source"]},
                "dataset": {**DEMO_SPEC["dataset"], "train": kit["dataset"]["train"],
                            "validation": kit["dataset"]["validation"]}}
        job = client.submit(spec)
        print(f"submitted {job['id']} through POST /v1/jobs\n{job['plan']['explanation']}", flush=True)
        print(f"dashboard          {dashboard_url(url, token, job['id'])}\n"
              "                   (open it now: the loss, tokens/s and communication share as the job runs)", flush=True)
        job = watch(client, job["id"])
        if job["status"] != "succeeded":
            print(serve_again(out / "api", token, job["id"]))
            return ended(job)  # one line naming why, and where the run's output is
        metrics = client.request("GET", f"/v1/jobs/{job['id']}/metrics")["data"]
        print("\n=== tunewright demo: LoRA fine-tune through the REST API, on local Ray ===")
        print(summary(job, metrics))
        print(serve_again(out / "api", token, job["id"]))
        return 0
    except RequestFailed as err:
        print(f"error: {err}\n(API log: {out / 'api.log'})", file=sys.stderr)
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
