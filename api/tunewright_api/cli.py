"""`tunewright`: the command line. Everything but `serve` talks to the REST API.

  tunewright serve                              run the API (SQLite and the local backend by default)
  tunewright tokens create TENANT [--admin]     a token for a tenant (needs an admin token)
  tunewright tokens list [TENANT] | revoke ID   tokens (never their secrets); revoke one
  tunewright submit job.yaml | --model M --train FILE ...   upload local data files, submit, print the job
  tunewright plan job.yaml --pool NAME           dry run on a GPU pool: plan, predictions, rejected options
  tunewright jobs | get ID | cancel ID | events ID | metrics ID
  tunewright watch ID                           live progress: step, loss, tokens/s, ETA

API address and token: --url / TUNEWRIGHT_URL (default http://127.0.0.1:8000), --token / TUNEWRIGHT_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import yaml

from tunewright_api.states import TERMINAL


class RequestFailed(RuntimeError):
    """The API answered with an error, or could not be reached (the message says which, for a human)."""


class Client:
    def __init__(self, url: str, token: str | None, timeout: float = 60):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise RequestFailed(f"cannot reach the API at {self.http.base_url}: {err}") from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                where = f" ({error['param']})" if error.get("param") else ""
                raise RequestFailed(f"{response.status_code}{where}: {error['message']}")
            except (ValueError, KeyError):
                raise RequestFailed(f"{response.status_code}: {response.text[:500]}") from None
        return response.json() if response.content else {}

    def upload(self, path: Path) -> dict:
        with path.open("rb") as fh:
            return self.request("POST", "/v1/files", files={"file": (path.name, fh)}, data={"purpose": "fine-tune"})

    def submit(self, spec: dict) -> dict:
        """Upload dataset entries that are local files, make a local model path absolute, then submit."""
        spec = json.loads(json.dumps(spec))
        for key in ("train", "validation"):
            value = spec.get("dataset", {}).get(key)
            if value and not value.startswith("file-") and Path(value).is_file():
                spec["dataset"][key] = self.upload(Path(value))["id"]
        source = spec.get("model", {}).get("source", "")
        if source and not Path(source).is_absolute() and Path(source).is_dir():  # the server wants it absolute
            spec["model"]["source"] = str(Path(source).resolve())
        return self.request("POST", "/v1/jobs", json=spec)


def spec_from_args(args) -> dict:
    if getattr(args, "spec", None):
        text = Path(args.spec).read_text()
        spec = yaml.safe_load(text)
        if isinstance(spec, dict) and spec.get("kind") == "FineTuneJob":  # a whole manifest: take its spec
            spec = spec["spec"]
        return spec
    if not (args.model and args.train):
        raise SystemExit("submit: give a spec file, or at least --model and --train")
    hyper = {k: v for k, v in {"epochs": args.epochs, "maxSteps": args.max_steps, "learningRate": args.learning_rate,
                               "globalBatchSize": args.batch_size, "seqLen": args.seq_len}.items() if v is not None}
    return {"model": {"source": args.model}, "method": {"type": args.method},
            "dataset": {"train": args.train, "validation": args.validation, "format": args.format},
            "hyperparameters": hyper, "resources": {"strategy": args.strategy}}


def plan_text(answer: dict) -> str:
    plan, p = answer["plan"], answer["plan"]["predicted"]
    lines = [f"{answer['model']['name']} ({answer['model']['parameters'] / 1e9:.2f}B) on pool {answer['pool']}",
             f"plan:      {plan['strategy']} on {plan['gpus']} GPUs ({plan['nodes']} node(s)), micro-batch "
             f"{plan['microBatch']} x {plan['gradAccum']}"
             f"{', activation checkpointing' if plan['activationCheckpointing'] else ''}"
             f"{', CPU offload' if plan['cpuOffload'] else ''}",
             f"predicted: {p['peakMemoryGiB']:.1f} GiB/GPU, step {p['stepSeconds']:.3f} s, "
             f"{p['tokensPerSecond']:,.0f} tokens/s, MFU {p['mfu']:.0%}, communication {p['commShare']:.0%} "
             f"({p['exposedCommShare']:.0%} exposed), {p['durationSeconds'] / 3600:.2f} h, ${p['costUSD']:,.2f}",
             f"why:       {plan['explanation']}"]
    lines += [f"rejected:  {r['strategy']}: {r['reason']}" for r in plan["rejected"]]
    return "\n".join(lines)


def progress_line(job: dict) -> str:
    p = job["progress"]
    total, step = p.get("totalSteps"), p.get("step") or 0
    width = 30
    filled = int(width * step / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    loss = f"{p['loss']:.4f}" if p.get("loss") is not None else "-"
    speed = f"{p['tokensPerSecond']:,.0f}" if p.get("tokensPerSecond") else "-"
    eta = f"{p['etaSeconds']:.0f}s" if p.get("etaSeconds") is not None else "-"
    line = f"{job['status']:9} [{bar}] step {step}/{total or '?'}  loss {loss}  tokens/s {speed}  ETA {eta}"
    measured = job.get("telemetry") or {}
    if measured.get("mfu") is not None:
        line += f"  MFU {measured['mfu']:.0%}"
    if measured.get("commShare") is not None:
        line += f"  comm {measured['commShare']:.0%} ({measured['commShareExposed']:.0%} exposed)"
    return line


def watch(client: Client, job_id: str, out=None, poll: float = 1.0) -> dict:
    out = out or sys.stdout  # looked up per call: stdout can be replaced (tests, redirection)
    interactive = out.isatty()
    last = ""
    while True:
        job = client.request("GET", f"/v1/jobs/{job_id}")
        line = progress_line(job)
        if line != last:
            out.write(("\r" + line.ljust(110)) if interactive else line + "\n")
            out.flush()
            last = line
        if job["status"] in TERMINAL:
            if interactive:
                out.write("\n")
            return job
        time.sleep(poll)


def serve(args) -> int:
    import secrets

    import uvicorn

    from tunewright_api.main import create_app
    from tunewright_api.settings import Settings

    settings = Settings()
    if os.environ.get("TMPDIR"):  # uploads spool there (the chart points it at the data volume): it must exist
        Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    if not settings.admin_token:
        token_file = settings.data_dir / "admin.token"
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        if not token_file.exists():
            token_file.touch(mode=0o600)
            token_file.write_text("tw-" + secrets.token_urlsafe(32))
        settings.admin_token = token_file.read_text().strip()
        print(f"admin token in {token_file} (export TUNEWRIGHT_TOKEN=$(cat {token_file}))", flush=True)
    settings.public_url = settings.public_url if "TUNEWRIGHT_PUBLIC_URL" in os.environ else \
        f"http://{args.host}:{args.port}"
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tunewright", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("TUNEWRIGHT_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--token", default=os.environ.get("TUNEWRIGHT_TOKEN"))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p = sub.add_parser("tokens", help="API tokens (needs an admin token): create, list or revoke")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("name", nargs="?", help="create: the tenant; list: only this tenant's; revoke: the token id")
    p.add_argument("--admin", action="store_true", help="create: an admin token")
    p = sub.add_parser("submit", help="submit a job (spec file or flags)")
    p.add_argument("spec", nargs="?", help="FineTuneJob spec or manifest (YAML or JSON)")
    p.add_argument("--model")
    p.add_argument("--train")
    p.add_argument("--validation")
    p.add_argument("--format", default="chat", choices=["chat", "prompt_completion", "text"])
    p.add_argument("--method", default="lora", choices=["lora", "full"])
    p.add_argument("--epochs", type=int)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--strategy", default="auto", choices=["auto", "single", "ddp", "fsdp", "hsdp"])
    p.add_argument("--watch", action="store_true", help="then watch it to the end")
    p = sub.add_parser("plan", help="dry run: what tunewright would run on a GPU pool, and why")
    p.add_argument("spec", help="FineTuneJob spec or manifest (YAML or JSON)")
    p.add_argument("--pool", required=True, help="a pool listed by GET /v1/pools")
    p.add_argument("--dataset-tokens", type=int, help="tokens in the training set (needed for epochs)")
    sub.add_parser("jobs", help="list jobs")
    for name in ("get", "cancel", "events", "metrics", "watch"):
        sub.add_parser(name, help=f"{name} a job").add_argument("job_id")
    args = parser.parse_args(argv)

    if args.command == "serve":
        return serve(args)
    client = Client(args.url, args.token)
    try:
        if args.command == "tokens" and args.action == "list":
            query = f"?tenant={args.name}" if args.name else ""
            for token in client.request("GET", f"/v1/tokens{query}")["data"]:
                print(f"{token['id']}  {token['tenant']:20}  {'admin' if token['admin'] else '-':5}  "
                      f"{token['created_at']}  {token['name']}")
            return 0
        elif args.command == "tokens" and not args.name:
            parser.error(f"tokens {args.action}: needs {'the tenant' if args.action == 'create' else 'the token id'}")
        elif args.command == "tokens" and args.action == "revoke":
            result = client.request("DELETE", f"/v1/tokens/{args.name}")
        elif args.command == "tokens":
            result = client.request("POST", "/v1/tokens", json={"tenant": args.name, "admin": args.admin})
        elif args.command == "submit":
            result = client.submit(spec_from_args(args))
            if args.watch:
                print(f"submitted {result['id']}: {result['plan']['explanation']}", flush=True)
                result = watch(client, result["id"])
                return 0 if result["status"] == "succeeded" else 1
        elif args.command == "plan":
            body = {"spec": spec_from_args(args), "pool": args.pool}
            if args.dataset_tokens:
                body["datasetTokens"] = args.dataset_tokens
            answer = client.request("POST", "/v1/plans", json=body)
            print(plan_text(answer))
            return 0
        elif args.command == "jobs":
            for job in client.request("GET", "/v1/jobs")["data"]:
                print(f"{job['id']}  {job['status']:9}  {job['model']}  step {job['progress']['step']}")
            return 0
        elif args.command == "get":
            result = client.request("GET", f"/v1/jobs/{args.job_id}")
        elif args.command == "cancel":
            result = client.request("POST", f"/v1/jobs/{args.job_id}/cancel")
        elif args.command == "events":
            for event in reversed(client.request("GET", f"/v1/jobs/{args.job_id}/events")["data"]):
                print(f"{time.strftime('%H:%M:%S', time.localtime(event['created_at']))} {event['level']:5} "
                      f"{event['message']}")
            return 0
        elif args.command == "metrics":
            for point in client.request("GET", f"/v1/jobs/{args.job_id}/metrics")["data"]:
                print(json.dumps(point))
            return 0
        else:  # watch
            job = watch(client, args.job_id)
            return 0 if job["status"] == "succeeded" else 1
    except RequestFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
