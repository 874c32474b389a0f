"""`tunewright`: the command line. All but `serve`, `train` and `explain-spec` talk to the REST API at --url.

  tunewright train job.yaml                          a fine-tune on this machine, start to end: serves its own API
                                                     (the data `serve` uses), submits, follows, downloads the adapter
  tunewright serve                                   the API on this machine (SQLite, local backend)
  tunewright status [--wait S]                       is it up?
  tunewright submit job.yaml [--watch]               upload local data, submit, print the job (or watch it)
  tunewright jobs [--status S] | get | watch | logs [-f] | events [--all] | metrics | checkpoints JOB
  tunewright cancel | delete | download JOB          stop, forget, fetch the trained adapter or model
  tunewright explain JOB                             why is it slow: predicted vs measured, what to do
  tunewright files upload|list|get|delete            datasets
  tunewright plan job.yaml --pool NAME               dry run on a GPU pool: plan, predictions, rejected options
  tunewright explain-spec [FIELD]                    the spec's fields: type, default, bounds, description
  tunewright pools list|get|create                   GPU pools the planner plans on
  tunewright tokens create|list|revoke               API tokens (admin)
  tunewright completion bash                         shell completion: source <(tunewright completion bash)

The API and token: --url / TUNEWRIGHT_URL (default http://127.0.0.1:8000), --token / TUNEWRIGHT_TOKEN.
Output: tables for people; -o json or -o yaml for programs. Exit codes: 0 done; 1 refused by the API, or the
job watched did not succeed; 2 the command line is wrong; 3 the API cannot be reached or failed; 130 stopped
with Ctrl-C (`train`: its job cancelled).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from tunewright_api.backends.local_folder import serving_url
from tunewright_api.cli import render, spec_fields
from tunewright_api.cli.client import OK, REFUSED, USAGE, Client, RequestFailed, with_local_paths_checked
from tunewright_api.cli.local import LocalApi, admin_token_file, dashboard_url, serve_again
from tunewright_core.planner.hardware import GPUS, LINKS

__all__ = ["Client", "RequestFailed", "ended", "main", "run_on", "watch"]
INTERRUPTED = 130  # the shell's code for a command stopped with Ctrl-C (128 + SIGINT)
OUTPUTS = ["table", "json", "yaml", "id"]  # -o, before the command or after it

def spec_from_args(args) -> dict:
    """The job spec: a file (a FineTuneJob manifest or its spec, YAML or JSON), or the flags; flags given with a
    file override it."""
    spec: dict = {}
    if getattr(args, "spec", None):
        try:
            spec = yaml.safe_load(Path(args.spec).read_text())
        except FileNotFoundError:  # the command line names a file that is not there: a usage error (exit 2)
            raise SystemExit(f"{args.spec}: no such file (give the path of a spec file, YAML or JSON: see "
                             "examples/)") from None
        except (OSError, yaml.YAMLError) as err:
            raise SystemExit(f"{args.spec}: {err}".splitlines()[0]) from None
        if isinstance(spec, dict) and spec.get("kind") == "FineTuneJob":  # a whole manifest: take its spec
            spec = spec.get("spec") or {}
        if not isinstance(spec, dict):
            raise RequestFailed(f"{args.spec}: not a FineTuneJob spec (a mapping of model, method, dataset...)", 422)
    elif not (args.model and args.train):
        raise SystemExit(f"tunewright {args.command}: give a spec file (see examples/), or at least --model and "
                         "--train")
    flags = {("model", "source"): args.model, ("method", "type"): args.method,
             ("method", "objective"): args.objective, ("method", "lora", "quantization"): args.quantization, ("method", "dpo", "beta"): args.beta,
             ("method", "dpo", "labelSmoothing"): args.label_smoothing, ("method", "dpo", "reference"): args.reference,
             ("dataset", "train"): args.train, ("dataset", "validation"): args.validation,
             ("dataset", "format"): args.format, ("hyperparameters", "epochs"): args.epochs,
             ("hyperparameters", "maxSteps"): args.max_steps, ("hyperparameters", "learningRate"): args.learning_rate,
             ("hyperparameters", "globalBatchSize"): args.batch_size, ("hyperparameters", "seqLen"): args.seq_len,
             ("hyperparameters", "optimizerState"): args.optimizer_state,
             ("resources", "strategy"): args.strategy}
    for (*sections, key), value in flags.items():
        if value is not None:
            where = spec
            for section in sections:
                where = where.setdefault(section, {})
            where[key] = value
    # dpo trains on preference pairs and nothing else does: a command line that says one means the other,
    # unless the spec says otherwise (then the spec's check names the field)
    method, dataset = spec.get("method") or {}, spec.get("dataset") or {}
    if isinstance(method, dict) and isinstance(dataset, dict):
        if method.get("objective") == "dpo" and "format" not in dataset and args.objective:
            spec.setdefault("dataset", {})["format"] = "preference"
        if dataset.get("format") == "preference" and "objective" not in method and args.format:
            spec.setdefault("method", {})["objective"] = "dpo"
    return spec


def watch(client: Client, job_id: str, out=None, poll: float = 1.0) -> dict:
    """Progress until the job ends; the job as it ended."""
    out = out or sys.stdout  # looked up per call: stdout can be replaced (tests, redirection)
    interactive = out.isatty()
    last = ""
    while True:
        job = client.request("GET", f"/v1/jobs/{job_id}")
        line = render.progress_line(job)
        if line != last:
            out.write(("\r" + line.ljust(120)) if interactive else line + "\n")
            out.flush()
            last = line
        if render.is_finished(job):
            if interactive:
                out.write("\n")
            return job
        time.sleep(poll)


def ended(job: dict) -> int:
    """How a watched job ended, for the exit code; why, on stderr, when it did not succeed."""
    if job["status"] == "succeeded":
        return OK
    why = (job.get("error") or {}).get("message") or job["status"]
    print(f"error: job {job['id']} {job['status']}: {why.splitlines()[0]}\n"
          f"       the run's output: tunewright logs {job['id']}", file=sys.stderr)
    return REFUSED


def run_on(api: LocalApi, token: str, spec: dict) -> tuple[dict, list[dict]]:
    """A job through an API this command started (`train`, `make demo`): submitted, announced with its page on
    the dashboard, followed to its end; the job as it ended, and its metrics. Ctrl-C cancels the job (its run
    would go on without an API otherwise), then goes on up."""
    client = Client(api.url, token)
    job = client.submit(spec)
    print(f"submitted {job['id']}: {job['plan']['explanation']}\n"
          f"dashboard          {dashboard_url(api.url, token, job['id'])}\n"
          "                   (open it now: the loss, tokens/s and communication share as the job runs)", flush=True)
    try:
        job = watch(client, job["id"])
    except KeyboardInterrupt:
        print(f"\ncancelling {job['id']} (Ctrl-C)", file=sys.stderr, flush=True)
        try:
            client.request("POST", f"/v1/jobs/{job['id']}/cancel")
        except RequestFailed as err:  # it ended meanwhile (409), or the API is gone: nothing is left to stop
            print(f"error: {err}", file=sys.stderr)
        raise
    return job, client.request("GET", f"/v1/jobs/{job['id']}/metrics")["data"]


def checked_spec(spec: dict, where: str) -> dict:
    """The spec, checked on this machine as the API would check it (the model's fields, the local files it
    names), with a local model path made absolute: a mistake is a usage error (exit 2) naming each field, found
    before anything is started."""
    from pydantic import ValidationError

    from tunewright_core.spec import FineTuneJobSpec, described_errors

    try:
        FineTuneJobSpec.model_validate(spec)
        return with_local_paths_checked(spec)
    except ValidationError as err:
        said = "; ".join(f"{where or 'spec'}: {what}" for where, what in described_errors(err.errors(), FineTuneJobSpec))
    except RequestFailed as err:
        said = str(err)
    raise SystemExit(f"{where}: {said}")


def follow_logs(client: Client, job_id: str, lines: int, poll: float = 1.0) -> None:
    """The last `lines` lines, then new ones as the run prints them, until the job ends."""
    shown: list[str] = []
    while True:
        finished = render.is_finished(client.request("GET", f"/v1/jobs/{job_id}"))
        latest = client.request("GET", f"/v1/jobs/{job_id}/logs", params={"lines": 10000 if shown else lines})["data"]
        # the new lines are those after the longest overlap of what was shown with the start of the latest
        overlap = next((k for k in range(min(len(shown), len(latest)), 0, -1) if shown[-k:] == latest[:k]), 0)
        for line in latest[overlap:] if shown else latest:
            print(line, flush=True)
        shown = (shown + latest[overlap:])[-10000:] if shown else latest
        if finished:
            return
        time.sleep(poll)


def download(client: Client, job_id: str, into: Path) -> dict[str, Path]:
    """Every file the job exported, into `into`, each written whole before it takes its name; the folders the
    export holds, by name: `adapter` (LoRA), `merged`, `model` (full fine-tuning)."""
    listed = client.request("GET", f"/v1/jobs/{job_id}/artifacts")["data"]
    for item in listed:
        target = into / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with client.http.stream("GET", f"/v1/jobs/{job_id}/artifacts/{item['path']}") as response:
            if response.status_code >= 400:
                response.read()
                client.send("GET", f"/v1/jobs/{job_id}/artifacts/{item['path']}")  # raises with the API's words
            with partial.open("wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
        partial.replace(target)
    names = dict.fromkeys(item["path"].split("/", 1)[0] for item in listed if "/" in item["path"])
    return {name: into / name for name in names}


def job_id_of(value: str) -> str:
    """A job id, or an OpenAI fine-tuned model name (ft:base[:suffix]:ftjob-...) whose last part is one."""
    return value.rsplit(":", 1)[-1] if value.startswith("ft:") else value


def reachable_url(host: str, port: int) -> str:
    """Where a server listening on `host` is reached from this machine: a wildcard host is where it listens, not an
    address (loopback is); an IPv6 address goes in brackets."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cmd_serve(args, client: Client) -> int:
    import uvicorn

    from tunewright_api.main import create_app
    from tunewright_api.settings import Settings

    settings = Settings()
    served = serving_url(settings.data_dir) if settings.backend == "local" else None
    if served:  # said before anything starts (the API's own claim on the folder is what holds under a race)
        print(f"error: the data folder {settings.data_dir} is already served by the API at {served}: use it "
              "(tunewright --url ...), or give this one a folder of its own (TUNEWRIGHT_DATA_DIR)", file=sys.stderr)
        return REFUSED
    if os.environ.get("TMPDIR"):  # uploads spool there (the chart points it at the data volume): it must exist
        Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    if not settings.admin_token:
        token_file = admin_token_file(settings.data_dir)
        settings.admin_token = token_file.read_text().strip()
        print(f"admin token in {token_file} (export TUNEWRIGHT_TOKEN=$(cat {token_file}))", flush=True)
    settings.public_url = settings.public_url if "TUNEWRIGHT_PUBLIC_URL" in os.environ else \
        reachable_url(args.host, args.port)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    return OK


def cmd_train(args, client: Client) -> int:
    """One job on an API of its own on this machine, on the data folder `serve` uses: submitted as tenant
    `local`, followed, summed up and downloaded; the API stops with the command (a later `serve` shows the job).
    Where `serve` is running on that folder, the job goes to it, which stays up."""
    from tunewright_api.settings import Settings

    spec = checked_spec(spec_from_args(args), args.spec or "the flags")
    settings = Settings()  # serve's: its data folder (TUNEWRIGHT_DATA_DIR, else ./.tunewright) and admin token
    data_dir = settings.data_dir.resolve()
    served = serving_url(data_dir)
    if served:
        print(f"using the API already serving {data_dir} at {served}", flush=True)
    # the folder's admin token (made here for an API of its own; a running API's file is only read: one started
    # with TUNEWRIGHT_ADMIN_TOKEN has none, and check_admin says so)
    kept = data_dir / "admin.token"
    admin = settings.admin_token or (kept.read_text().strip() if served and kept.is_file() else
                                     "" if served else admin_token_file(data_dir).read_text().strip())
    folders: dict[str, Path] = {}
    try:
        with LocalApi(data_dir, admin, data_dir / "api.log", serving=served) as api:
            token = api.tenant_token("local", kept_in=data_dir / "local.token")
            job, metrics = run_on(api, token, spec)
            if job["status"] == "succeeded":
                print(render.run_summary(job, metrics))
                folders = download(Client(api.url, token), job["id"], (args.dir or Path(job["id"])).resolve())
    except KeyboardInterrupt:
        print("stopped (Ctrl-C); " + (f"the API at {served} goes on" if served else
                                      "the API this command started is down"), file=sys.stderr)
        return INTERRUPTED
    print(f"dashboard          {dashboard_url(served, token, job['id'])}" if served else
          serve_again(data_dir, token, job["id"]))
    if job["status"] != "succeeded":
        return ended(job)
    for name, folder in folders.items():  # last: what a script reads (`tail -1`), the folder to load
        print(f"{name:18} {folder}")
    return OK


def cmd_status(args, client: Client) -> int:
    deadline = time.monotonic() + args.wait
    while True:
        try:
            ready = client.request("GET", "/readyz")
            break
        except RequestFailed:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    render.emit({"url": args.url, **ready}, args.output, lambda r: f"{r['status']}: {r['url']} ({r['backend']} backend)")
    return OK


def cmd_submit(args, client: Client) -> int:
    job = client.submit(spec_from_args(args))
    if not args.watch:
        render.emit(job, args.output, render.job_text)
        return OK
    print(f"submitted {job['id']}: {job['plan']['explanation'] if job.get('plan') else ''}", flush=True)
    return ended(watch(client, job["id"]))


def cmd_plan(args, client: Client) -> int:
    made: list[str] = []
    spec = client.with_local_files(spec_from_args(args), made)
    body = {"spec": spec, "pool": args.pool, **({"datasetTokens": args.dataset_tokens} if args.dataset_tokens else {})}
    try:
        answer = client.request("POST", "/v1/plans", json=body)
    except RequestFailed as err:
        if err.param and err.param.endswith("maxSteps"):
            raise RequestFailed(f"{err} (give --dataset-tokens N, --train FILE, or --max-steps N)",
                                err.status, err.param) from None
        raise
    render.emit(answer, args.output, render.plan_text)
    return OK


def cmd_explain_spec(args, client: Client) -> int:
    schema = spec_fields.spec_schema()
    if not args.field:
        render.emit(schema, args.output, spec_fields.spec_text)
        return OK
    field, required = spec_fields.field_at(schema, args.field)
    render.emit(field, args.output, lambda f: spec_fields.field_text(args.field, f, required))
    return OK


def cmd_jobs(args, client: Client) -> int:
    params = {"limit": min(args.limit, 100), **({"status": args.status} if args.status else {})}
    jobs = client.request("GET", "/v1/jobs", params=params)["data"]
    render.emit(jobs, args.output, render.jobs_table,
                empty="No jobs." + (f" (none {args.status})" if args.status else ""))
    return OK


def cmd_get(args, client: Client) -> int:
    render.emit(client.request("GET", f"/v1/jobs/{job_id_of(args.job_id)}"), args.output, render.job_text)
    return OK


def cmd_watch(args, client: Client) -> int:
    return ended(watch(client, job_id_of(args.job_id)))


def cmd_cancel(args, client: Client) -> int:
    render.emit(client.request("POST", f"/v1/jobs/{args.job_id}/cancel"), args.output, render.job_text)
    return OK


def cmd_delete(args, client: Client) -> int:
    render.emit(client.request("DELETE", f"/v1/jobs/{args.job_id}"), args.output, lambda d: f"deleted {d['id']}")
    return OK


def cmd_explain(args, client: Client) -> int:
    render.emit(client.request("GET", f"/v1/jobs/{job_id_of(args.job_id)}/diagnosis"), args.output,
                render.diagnosis_text)
    return OK


def cmd_checkpoints(args, client: Client) -> int:
    render.emit(client.pages(f"/v1/jobs/{args.job_id}/checkpoints"), args.output, render.checkpoints_table,
                empty="No checkpoints (none committed yet, or the job kept none).")
    return OK


def cmd_logs(args, client: Client) -> int:
    if args.follow:
        follow_logs(client, args.job_id, args.lines)
        return OK
    lines = client.request("GET", f"/v1/jobs/{args.job_id}/logs", params={"lines": args.lines})["data"]
    render.emit(lines, args.output, "\n".join, empty="No output yet (the run has not started).")
    return OK


def cmd_events(args, client: Client) -> int:
    if args.all:
        events = client.pages(f"/v1/jobs/{args.job_id}/events", limit=1000)
    else:
        page = client.request("GET", f"/v1/jobs/{args.job_id}/events", params={"limit": 100})
        events = page["data"]
        if page.get("hasMore") and args.output == "table":
            print("(the newest 100; every event: --all)", file=sys.stderr)
    render.emit(events[::-1], args.output, render.events_table)
    return OK


def cmd_metrics(args, client: Client) -> int:
    points = client.request("GET", f"/v1/jobs/{args.job_id}/metrics", params={"maxPoints": args.max_points})["data"]
    render.emit(points, args.output, render.metrics_table,
                empty=f"No metrics: job {args.job_id} has not finished a step (tunewright get {args.job_id}).")
    return OK


def cmd_download(args, client: Client) -> int:
    job_id = job_id_of(args.job_id)
    into = (args.dir or Path(job_id)).resolve()
    folders = download(client, job_id, into)
    # the folder to load (the adapter's own, which holds adapter_config.json; else the merged or full model)
    load = next((folders[name] for name in ("adapter", "merged", "model") if name in folders), into)
    render.emit({"job": job_id, "dir": str(into), **{name: str(folder) for name, folder in folders.items()}},
                args.output, lambda _: str(load))
    return OK


def cmd_files(args, client: Client) -> int:
    out = args.output
    if args.action == "list":
        render.emit(client.request("GET", "/v1/files")["data"], out, render.files_table, empty="No files.")
        return OK
    if not args.target:
        args.parser.error(f"files {args.action}: needs {'local files' if args.action == 'upload' else 'file ids'}")
    done = []
    for target in args.target:
        if args.action == "upload":
            if not Path(target).is_file():
                raise RequestFailed(f"no file {target} here", 422)
            done.append(client.upload_once(Path(target))[0])
        elif args.action == "get":
            done.append(client.request("GET", f"/v1/files/{target}"))
        else:
            done.append(client.request("DELETE", f"/v1/files/{target}"))
    if args.action == "delete":
        render.emit(done, out, lambda items: "\n".join(f"deleted {d['id']}" for d in items))
    else:
        render.emit(done, out, render.files_table)
    return OK


def cmd_pools(args, client: Client) -> int:
    if args.action == "list":
        render.emit(client.request("GET", "/v1/pools")["data"], args.output, render.pools_table)
        return OK
    if not args.name:
        args.parser.error(f"pools {args.action}: needs the pool's name")
    if args.action == "get":
        pool = client.request("GET", f"/v1/pools/{args.name}")
    else:
        missing = [flag for flag, value in (("--gpu", args.gpu), ("--gpus-per-node", args.gpus_per_node),
                                            ("--max-nodes", args.max_nodes), ("--intra-node", args.intra_node),
                                            ("--price", args.price)) if value is None]
        if missing:
            args.parser.error(f"pools create: needs {', '.join(missing)}")
        pool = client.request("POST", "/v1/pools", json={
            "name": args.name, "gpu": args.gpu, "gpusPerNode": args.gpus_per_node, "maxNodes": args.max_nodes,
            "intraNode": args.intra_node, "interNode": args.inter_node, "pricePerGPUHour": args.price,
            "hostMemoryGiB": args.host_memory_gib, "learnLinks": args.learn_links})
    render.emit(pool, args.output, lambda p: render.pools_table([p]))
    return OK


def cmd_tokens(args, client: Client) -> int:
    if args.action == "list":
        params = {"tenant": args.name} if args.name else {}
        render.emit(client.request("GET", "/v1/tokens", params=params)["data"], args.output, render.tokens_table,
                    empty="No tokens.")
        return OK
    if not args.name:
        args.parser.error(f"tokens {args.action}: needs {'the tenant' if args.action == 'create' else 'the token id'}")
    if args.action == "revoke":
        render.emit(client.request("DELETE", f"/v1/tokens/{args.name}"), args.output, lambda d: f"revoked {d['id']}")
    else:
        token = client.request("POST", "/v1/tokens", json={"tenant": args.name, "admin": args.admin})
        if args.output == "table":  # the secret alone on stdout: export TUNEWRIGHT_TOKEN=$(tunewright tokens create t)
            print(f"token {token['id']} for tenant {token['tenant']}: shown once, keep it", file=sys.stderr)
        render.emit(token, args.output, lambda t: t["token"])
    return OK


def cmd_completion(args, client: Client) -> int:
    print(completion_script(args.parser))
    return OK


def completion_script(parser: argparse.ArgumentParser) -> str:
    """bash completion of commands, their actions and options, read from the parser itself."""
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps them only here)
    cases = []
    for name, sub in commands.items():
        words = [o for a in sub._actions for o in a.option_strings]  # noqa: SLF001
        words += [c for a in sub._actions if a.choices and not a.option_strings for c in a.choices]  # noqa: SLF001
        cases.append(f"    {name}) words=\"{' '.join(sorted(set(words)))}\" ;;")
    return "\n".join([
        "# tunewright bash completion: source <(tunewright completion bash)",
        "_tunewright() {",
        "  local cur=${COMP_WORDS[COMP_CWORD]} words",
        "  if [ \"$COMP_CWORD\" -eq 1 ]; then",
        f"    words=\"{' '.join(commands)} --url --token --output --version --help\"",
        "  else",
        "    case ${COMP_WORDS[1]} in",
        *cases,
        "    esac",
        "  fi",
        "  COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))",
        "  if [ ${#COMPREPLY[@]} -eq 0 ]; then COMPREPLY=($(compgen -f -- \"$cur\")); fi",
        "}",
        "complete -F _tunewright tunewright",
    ])


def spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="a FineTuneJob manifest or its spec (YAML or JSON); see examples/")
    p.add_argument("--model", help="model.source: a catalog or hub name (org/name), a local folder, pvc://claim/path")
    p.add_argument("--train", help="dataset.train: a local JSONL file (uploaded once) or an uploaded file id")
    p.add_argument("--validation", help="dataset.validation: as --train")
    p.add_argument("--format", choices=["chat", "prompt_completion", "text", "preference"],
                   help="dataset.format (default chat; preference with --objective dpo)")
    p.add_argument("--method", choices=["lora", "full"], help="method.type (default lora)")
    p.add_argument("--quantization", choices=["none", "nf4", "auto"],
                   help="method.lora.quantization: nf4 trains LoRA on a 4-bit base (QLoRA: a quarter of the memory, "
                        "slower steps); auto only where bf16 would need CPU offload (default none)")
    p.add_argument("--objective", choices=["sft", "dpo"],
                   help="method.objective (default sft); dpo trains on preference pairs (--format preference)")
    p.add_argument("--beta", type=float, help="method.dpo.beta: how strongly dpo holds the model near the "
                                              "reference (default 0.1)")
    p.add_argument("--label-smoothing", type=float, help="method.dpo.labelSmoothing (default 0)")
    p.add_argument("--reference", help="method.dpo.reference: the model dpo starts from and is held near "
                                       "(default: --model)")
    p.add_argument("--epochs", type=int, help="hyperparameters.epochs")
    p.add_argument("--max-steps", type=int, help="hyperparameters.maxSteps (overrides epochs)")
    p.add_argument("--learning-rate", type=float, help="hyperparameters.learningRate")
    p.add_argument("--batch-size", type=int, help="hyperparameters.globalBatchSize (sequences per optimizer step)")
    p.add_argument("--seq-len", type=int, help="hyperparameters.seqLen (tokens per packed sequence)")
    p.add_argument("--optimizer-state", choices=["fp32", "bf16", "auto"],
                   help="hyperparameters.optimizerState, full fine-tuning: bf16 weights and moments (half the memory, "
                        "a little quality); auto only where fp32 would need CPU offload (default fp32)")
    p.add_argument("--strategy", choices=["auto", "single", "ddp", "fsdp", "hsdp"],
                   help="resources.strategy (default auto: the planner picks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunewright", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        installed = version("tunewright")
    except PackageNotFoundError:
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"tunewright {installed}")
    parser.add_argument("--url", default=os.environ.get("TUNEWRIGHT_URL", "http://127.0.0.1:8000"),
                        help="the API (default: TUNEWRIGHT_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--token", default=os.environ.get("TUNEWRIGHT_TOKEN"),
                        help="an API token (default: TUNEWRIGHT_TOKEN)")
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                        help="table for people (default), json or yaml for programs, id: only the ids")
    # each command is a function cmd_NAME(args, client) -> exit code; those that find the command line wrong
    # after parsing say so as argparse does, through args.parser (completion reads it too)
    parser.set_defaults(parser=parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="a job on this machine from submit to the downloaded adapter, in the "
                                     "foreground (an API of its own; --url and --token are not used)")
    spec_flags(p)
    p.add_argument("-d", "--dir", type=Path, help="where to put the trained adapter or model (default ./JOB)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="run the API on this machine")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="is the API up and ready? (exit 3 if not)")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait up to this long for it")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("submit", help="submit a job from a spec file or flags")
    spec_flags(p)
    p.add_argument("--watch", action="store_true", help="then follow it to the end (exit 1 unless it succeeds)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("plan", help="dry run: what tunewright would run on a GPU pool, and why")
    spec_flags(p)
    p.add_argument("--pool", required=True, help="a GPU pool (tunewright pools list)")
    p.add_argument("--dataset-tokens", type=int,
                   help="tokens in the training set, for epochs (default: estimated from --train's file)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("explain-spec", help="the FineTuneJob spec's fields; one field's type, default, bounds "
                                            "and fields (no API needed)")
    p.add_argument("field", nargs="?", help="a dotted camelCase path, e.g. hyperparameters.learningRate")
    p.set_defaults(func=cmd_explain_spec)

    p = sub.add_parser("jobs", help="list jobs, newest first")
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"],
                   help="only jobs in this state")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    p.set_defaults(func=cmd_jobs)
    for name, text, func in (
            ("get", "show a job: status, plan, progress, cost, error, where its model is", cmd_get),
            ("watch", "follow a job's progress until it ends (exit 1 unless it succeeds)", cmd_watch),
            ("cancel", "stop a queued or running job", cmd_cancel),
            ("delete", "forget a finished job: its records, run folder, checkpoints and export", cmd_delete),
            ("checkpoints", "a job's committed checkpoints, newest first", cmd_checkpoints),
            ("explain", "why is it slow? predicted and measured per part of a step, and what to do", cmd_explain)):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id", metavar="JOB", help="a job id")
        p.set_defaults(func=func)
    p = sub.add_parser("logs", help="what a job's run printed")
    p.add_argument("job_id", metavar="JOB", help="a job id")
    p.add_argument("-n", "--lines", type=int, default=200, help="the last N lines (default 200)")
    p.add_argument("-f", "--follow", action="store_true", help="then print new lines until the job ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("events", help="what happened to a job, oldest first")
    p.add_argument("job_id", metavar="JOB", help="a job id")
    p.add_argument("--all", action="store_true", help="every event (default: the newest 100)")
    p.set_defaults(func=cmd_events)
    p = sub.add_parser("metrics", help="a job's per-step metrics")
    p.add_argument("job_id", metavar="JOB", help="a job id")
    p.add_argument("--max-points", type=int, default=500, help="downsampled to at most N points (default 500)")
    p.set_defaults(func=cmd_metrics)
    p = sub.add_parser("download", help="fetch the adapter or model a job exported, file by file")
    p.add_argument("job_id", metavar="JOB", help="a job id, or its fine-tuned model name (ft:...)")
    p.add_argument("-d", "--dir", type=Path, help="where to put it (default ./JOB)")
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("files", help="datasets: upload, list, get, delete")
    p.add_argument("action", choices=["upload", "list", "get", "delete"])
    p.add_argument("target", nargs="*", help="upload: local JSONL files; get, delete: file ids")
    p.set_defaults(func=cmd_files)

    p = sub.add_parser("pools", help="GPU pools the planner plans on: list, get, create (admin)")
    p.add_argument("action", choices=["list", "get", "create"])
    p.add_argument("name", nargs="?", help="get, create: the pool's name")
    p.add_argument("--gpu", choices=list(GPUS), help="create (required): the GPU model")
    p.add_argument("--gpus-per-node", type=int, help="create (required): GPUs in each node")
    p.add_argument("--max-nodes", type=int, help="create (required): nodes a job may use")
    p.add_argument("--intra-node", choices=list(LINKS), help="create (required): the link between a node's GPUs")
    p.add_argument("--inter-node", choices=list(LINKS), help="create: the link between nodes (none: one node)")
    p.add_argument("--price", type=float, help="create (required): price per GPU-hour in USD (0: priced nowhere)")
    p.add_argument("--host-memory-gib", type=float, help="create: host memory per node, for CPU offload plans "
                                                           "(default: twice the node's GPU memory)")
    p.add_argument("--learn-links", action="store_true", help="create: plan on the links and GPU efficiency its "
                                                                 "jobs measure")
    p.set_defaults(func=cmd_pools)

    p = sub.add_parser("tokens", help="API tokens (admin): create, list, revoke")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("name", nargs="?", help="create: the tenant; list: only this tenant's; revoke: the token id")
    p.add_argument("--admin", action="store_true", help="create: an admin token")
    p.set_defaults(func=cmd_tokens)

    p = sub.add_parser("completion", help="a shell completion script")
    p.add_argument("shell", choices=["bash"])
    p.set_defaults(func=cmd_completion)
    for command in sub.choices.values():  # -o after the command too (`tunewright plan job.yaml -o json`)
        command.add_argument("-o", "--output", choices=OUTPUTS, default=argparse.SUPPRESS,
                             help="as before the command: table, json, yaml or id")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # `files upload a.jsonl -o json b.jsonl`: argparse ends a list at its first option; what is left joins it
    # (after a `--`, whatever it starts with)
    dashes = rest.index("--") if "--" in rest else len(rest)
    options, plain = [a for a in rest[:dashes] if a.startswith("-")], rest[:dashes] + rest[dashes + 1:]
    if plain and not options and isinstance(getattr(args, "target", None), list):
        args.target += plain
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        code = args.func(args, Client(args.url, args.token))
        sys.stdout.flush()  # inside the try: a reader that left shows here, not at the interpreter's exit
        return code
    except RequestFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # `tunewright jobs | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return OK
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # a usage problem found after parsing
            print(f"error: {exit_.code}", file=sys.stderr)
            return USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
