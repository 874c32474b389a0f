"""`make demo`: the whole path a user takes, on this machine.

Starts the API (SQLite, local backend), builds the tiny model kit, creates a tenant token, uploads the
dataset, submits a LoRA job through the REST API, watches it with a progress bar (and prints the link to its
page on the web dashboard), prints a summary, and shuts the API down, saying how to serve it again.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from tunewright_api.backends.local_folder import serving_url
from tunewright_api.cli import RequestFailed, ended, render, run_on
from tunewright_api.cli.local import LocalApi, serve_again

DEMO_SPEC = {
    "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "dropout": 0.0}},
    "dataset": {"format": "chat"},
    "hyperparameters": {"epochs": 8, "learningRate": 5e-3, "warmupRatio": 0.05, "globalBatchSize": 8,
                        "seqLen": 256, "seed": 0},
    "checkpoint": {"everySteps": 50},
    "evaluation": {"exactMatch": True, "maxNewTokens": 4},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-output"))
    args = parser.parse_args()
    out = args.out.resolve()
    served = serving_url(out / "api")
    if served:  # the demo's last lines say how to serve its folder: one doing so now would lose its database
        print(f"error: {out / 'api'} is served by the API at {served} (tunewright serve): stop it first; the demo "
              "starts that folder afresh", file=sys.stderr)
        return 1
    shutil.rmtree(out / "api", ignore_errors=True)  # a fresh service and job each time
    out.mkdir(parents=True, exist_ok=True)
    print("building the tiny model kit (random-init GPT-2, local tokenizer)...", flush=True)
    subprocess.run([sys.executable, "-m", "tunewright_jobs.tiny", "build", "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kit = json.loads((out / "job.json").read_text())  # the kit's own job config names its model and data

    try:
        with LocalApi(out / "api", "tw-" + secrets.token_urlsafe(24), out / "api.log") as api:
            print(f"API up at {api.url} (log {out / 'api.log'})", flush=True)
            token = api.tenant_token("demo")
            spec = {**DEMO_SPEC, "model": {"source": kit["model"]["source"]},
                    "dataset": {**DEMO_SPEC["dataset"], "train": kit["dataset"]["train"],
                                "validation": kit["dataset"]["validation"]}}
            job, metrics = run_on(api, token, spec)
    except RequestFailed as err:
        print(f"error: {err}\n(API log: {out / 'api.log'})", file=sys.stderr)
        return 1
    if job["status"] != "succeeded":
        print(serve_again(out / "api", token, job["id"]))
        return ended(job)  # one line naming why, and where the run's output is
    print("\n=== tunewright demo: LoRA fine-tune through the REST API, on local Ray ===")
    print(render.run_summary(job, metrics))
    print(f"adapter            {job['result']['export']['adapter']}")
    print(serve_again(out / "api", token, job["id"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
