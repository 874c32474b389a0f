"""What the CLI prints: tables and summaries for people, JSON or YAML for programs (--output)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

import yaml

from tunewright_api.states import TERMINAL


def emit(data, output: str, table: Callable[[object], str], empty: str | None = None) -> None:
    """`data` as JSON, YAML or (for people) the table; an empty list says so on stderr, so pipes get nothing."""
    if output == "id":  # for scripts: JOB=$(tunewright -o id jobs --limit 1)
        for item in data if isinstance(data, list) else [data]:
            print(item.get("id") or item.get("name") if isinstance(item, dict) else item)
    elif output == "json":
        print(json.dumps(data, indent=2))
    elif output == "yaml":
        print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), end="")
    elif empty is not None and not data:
        print(empty, file=sys.stderr)
    else:
        print(table(data))


def columns(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def age(created: str | int | None) -> str:
    if created is None:
        return "-"
    when = datetime.fromtimestamp(created, UTC) if isinstance(created, int) else datetime.fromisoformat(created)
    seconds = (datetime.now(UTC) - (when if when.tzinfo else when.replace(tzinfo=UTC))).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


def plan_cell(plan: dict | None) -> str:
    if not plan:
        return "-"
    where = f"{plan['gpus']} GPU" + ("s" if plan["gpus"] != 1 else "") if plan.get("gpus") else \
        f"{plan['workers']} CPU worker" + ("s" if plan["workers"] != 1 else "")
    return f"{plan['strategy']} x {where}"


def method_cell(method: dict) -> str:
    """lora (qlora on a 4-bit base) or full, and the objective where it is not sft (the default; absent from jobs
    before dpo)."""
    objective = method.get("objective", "sft")
    kind = "qlora" if (method.get("lora") or {}).get("quantization") == "nf4" and method["type"] == "lora" \
        else method["type"]
    return kind if objective == "sft" else f"{kind} {objective}"


def method_text(method: dict) -> str:
    """`get`'s: lora or full, the objective, and dpo's settings."""
    objective = method.get("objective", "sft")
    said = [method["type"], f"objective {objective}"]
    quantization = (method.get("lora") or {}).get("quantization", "none")
    if method["type"] == "lora" and quantization != "none":
        said.append(f"base {quantization}" + (" (4-bit, QLoRA)" if quantization == "nf4" else " (nf4 where bf16 "
                                                                                             "needs offload)"))
    if objective == "dpo":
        dpo = method.get("dpo") or {}
        said.append(f"beta {dpo.get('beta', 0.1):g}")
        if dpo.get("labelSmoothing"):
            said.append(f"label smoothing {dpo['labelSmoothing']:g}")
        if dpo.get("reference"):
            said.append(f"reference {dpo['reference']}")
    return ", ".join(said)


def jobs_table(jobs: list[dict]) -> str:
    rows = []
    for job in jobs:
        p, cost = job["progress"], (job.get("telemetry") or {}).get("costUSD")
        done = f"{p['step']}/{p['totalSteps']}" if p.get("totalSteps") else str(p.get("step") or 0)
        if p.get("percent") is not None:
            done += f" ({p['percent']:.0f}%)"
        rows.append([job["id"], job["status"], job["model"].rstrip("/").rsplit("/", 1)[-1][:40],
                     method_cell(job["spec"]["method"]), plan_cell(job.get("plan")), done,
                     f"{p['loss']:.4f}" if p.get("loss") is not None else None,
                     duration(p.get("etaSeconds")) if job["status"] == "running" else None,
                     f"${cost:,.2f}" if cost is not None else None, age(job["createdAt"])])
    return columns(["ID", "STATUS", "MODEL", "METHOD", "PLAN", "STEP", "LOSS", "ETA", "COST", "AGE"], rows)


def job_text(job: dict) -> str:
    t, plan = job.get("telemetry") or {}, job.get("plan")
    lines = [f"{job['id']}  {job['status']}", f"model:     {job['model']} ({method_text(job['spec']['method'])})"]
    if plan:
        lines.append(f"plan:      {plan_cell(plan)}, micro-batch {plan['microBatch']} x {plan['gradAccum']}: "
                     f"{plan['explanation']}")
    lines.append(f"progress:  {progress_line(job)}")
    if t.get("costUSD") is not None:
        lines.append(f"cost:      ${t['costUSD']:,.2f} so far")
    if evaluated := evaluation(job.get("result")):
        lines.append("evaluation (validation set, before -> after training):")
        lines += [f"  {name:16} {said}" for name, said in evaluated]
    if job.get("error"):
        lines.append(f"error:     {job['error']['message']}")
        lines.append(f"           (the run's output: tunewright logs {job['id']}; what happened: tunewright events "
                     f"{job['id']})")
    export = {k: v for k, v in ((job.get("result") or {}).get("export") or {}).items() if v}
    for name, where in export.items():
        lines.append(f"{name + ':':10} {where}")
    if export:
        lines.append(f"download:  tunewright download {job['id']}")
    return "\n".join(lines)


def progress_line(job: dict) -> str:
    p = job["progress"]
    total, step = p.get("totalSteps"), p.get("step") or 0
    width = 30
    filled = int(width * step / total) if total else 0
    bar = "#" * filled + "-" * (width - filled)
    loss = f"{p['loss']:.4f}" if p.get("loss") is not None else "-"
    speed = f"{p['tokensPerSecond']:,.0f}" if p.get("tokensPerSecond") else "-"
    line = f"{job['status']:9} [{bar}] step {step}/{total or '?'}  loss {loss}  tokens/s {speed}"
    if job["status"] == "running":
        line += f"  ETA {duration(p.get('etaSeconds'))}"
    measured = job.get("telemetry") or {}
    if measured.get("mfu") is not None:
        line += f"  MFU {measured['mfu']:.0%}"
    if measured.get("commShare") is not None:
        line += f"  comm {measured['commShare']:.0%} ({measured['commShareExposed']:.0%} exposed)"
    return line


# what a run's evaluation measured: (label, field of `evalBefore` and `evalAfter`, format)
EVALUATED = (("validation loss", "valLoss", "{:.4f}"),
             ("preference accuracy", "preferenceAccuracy", "{:.1%}"),  # dpo: held-out pairs ranked right
             ("reward margin", "rewardMargin", "{:+.3f}"),  # dpo: chosen minus rejected reward, mean
             ("token accuracy", "valTokenAccuracy", "{:.1%}"), ("exact match", "exactMatch", "{:.1%}"))


def evaluation(result: dict | None) -> list[tuple[str, str]]:
    """A run's evaluation as `tunewright get` and the run's summary say it: (label, "before -> after") for each
    metric measured at the end, e.g. ("token accuracy", "0.3% -> 99.7%"); only the `after` on a resumed run,
    whose `before` was another run's. Nothing for a job without a validation set, or not finished."""
    before, after = (result or {}).get("evalBefore") or {}, (result or {}).get("evalAfter") or {}
    said = []
    for name, key, shown in EVALUATED:
        if after.get(key) is None:
            continue
        figure = shown.format(after[key]) if before.get(key) is None else \
            f"{shown.format(before[key])} -> {shown.format(after[key])}"
        if key == "exactMatch" and after.get("exactMatchExamples") is not None:
            count = after["exactMatchExamples"]
            figure += f"  ({count} held-out example{'' if count == 1 else 's'})"
        said.append((name, figure))
    return said


def run_summary(job: dict, metrics: list[dict]) -> str:
    """A succeeded job in a few lines: its plan, loss, evaluation before and after training (where the job
    had a validation set), speed, communication and cost (`tunewright train`, `make demo`)."""
    result, plan = job["result"], job["plan"]
    loss = f", training loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}" if metrics else ""
    lines = [f"job                {job['id']} ({job['status']})",
             f"plan               {plan['explanation']}",
             f"optimizer steps    {result['steps']}{loss}"]
    lines += [f"{name:18} {said}" for name, said in evaluation(result)]
    speeds = [m["tokensPerSecond"] for m in metrics if m.get("tokensPerSecond")]
    if speeds:
        lines.append(f"trained tokens/s   {statistics.median(speeds):,.0f} (median), "
                     f"{job['progress']['trainedTokens']:,} tokens")
    lines.append(communication(job["telemetry"], "gloo" if plan["device"] == "cpu" else "nccl"))
    held = f"{plan['gpus']} GPUs" if plan["gpus"] else f"{plan['workers']} CPU workers"
    seconds = (datetime.fromisoformat(job["finishedAt"]) - datetime.fromisoformat(job["startedAt"])).total_seconds()
    cost = job["telemetry"].get("costUSD")
    lines.append(f"cost               ${cost:,.2f} ({held} held {seconds:.0f} s)" if cost else
                 f"cost               $0.00: the local pool has no price ({held} held {seconds:.0f} s)")
    return "\n".join(lines)


def communication(telemetry: dict, collectives: str) -> str:
    if telemetry["commShare"] is None:
        return "communication      not measured (the run was too short for a profiler window)"
    return (f"communication      {telemetry['commShare']:.1%} of the step in collectives, "
            f"{telemetry['commShareExposed']:.1%} not hidden by compute (measured at step "
            f"{telemetry['commMeasuredAtStep']}, {collectives})")


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def memory_layout(plan: dict) -> list[str]:
    """What the plan does to fit in memory, beyond sharding. Plans made before selective checkpointing and
    kept weights lack their fields: every block checkpointed, weights resharded."""
    parts = []
    if plan["activationCheckpointing"]:
        every = plan.get("activationCheckpointingEvery", 1)
        parts.append("activation checkpointing" + (f" (every {ordinal(every)} block)" if every > 1 else ""))
    if not plan.get("reshardAfterForward", True):
        parts.append("weights kept unsharded until backward")
    if plan["cpuOffload"]:
        parts.append("CPU offload")
    return parts


def plan_text(answer: dict) -> str:
    plan, p = answer["plan"], answer["plan"]["predicted"]
    lines = [f"{answer['model']['name']} ({answer['model']['parameters'] / 1e9:.2f}B) on pool {answer['pool']}",
             f"plan:      {plan['strategy']} on {plan['gpus']} GPUs ({plan['nodes']} node(s)), micro-batch "
             f"{plan['microBatch']} x {plan['gradAccum']}"
             f"{''.join(', ' + part for part in memory_layout(plan))}",
             f"predicted: {p['peakMemoryGiB']:.1f} GiB/GPU, step {p['stepSeconds']:.3f} s, "
             f"{p['tokensPerSecond']:,.0f} tokens/s, MFU {p['mfu']:.0%}, communication {p['commShare']:.0%} "
             f"({p['exposedCommShare']:.0%} exposed), {p['durationSeconds'] / 3600:.2f} h, ${p['costUSD']:,.2f}",
             *band_lines(p),
             f"why:       {plan['explanation']}"]
    lines += [f"rejected:  {r['strategy']}: {r['reason']}" for r in plan["rejected"]]
    return "\n".join(lines)


def band_lines(predicted: dict) -> list[str]:
    """The predictions' P10-P90 band and what it comes from (plans made before the band have none)."""
    b = predicted.get("band")
    if not b:
        return []
    return [f"likely:    {b['tokensPerSecondLow']:,.0f}-{b['tokensPerSecondHigh']:,.0f} tokens/s, "
            f"{b['durationSecondsLow'] / 3600:.2f}-{b['durationSecondsHigh'] / 3600:.2f} h, "
            f"${b['costUSDLow']:,.2f}-${b['costUSDHigh']:,.2f} (P10-P90)",
            f"band:      {b['basis']}"]


def diagnosis_text(found: dict) -> str:
    """`tunewright explain`: the verdict, predicted and measured per component (ms a step), the findings."""
    ms = lambda s: "-" if s is None else f"{s * 1000:,.0f} ms"  # noqa: E731
    head = found["status"]
    if found.get("gap") is not None:
        head += (f": a step takes {ms(found['measuredStepSeconds'])} against {ms(found['predictedStepSeconds'])} "
                 f"predicted ({found['gap']:+.0%})")
    elif found.get("measuredStepSeconds") is not None:
        head += f": a step takes {ms(found['measuredStepSeconds'])}"
    lines = [head]
    if found["components"]:
        rows = [[c["name"], ms(c.get("predictedSeconds")), ms(c.get("measuredSeconds")),
                 "-" if c.get("measuredShare") is None else f"{c['measuredShare']:.0%}"]
                for c in found["components"]]
        lines += ["", columns(["COMPONENT", "PREDICTED", "MEASURED", "SHARE"], rows), ""]
    if found.get("goodput") is not None:
        lines.append(f"goodput: {found['goodput']:.0%} (training steps / the time the workers were held)")
    lines += [f"- {finding}" for finding in found["findings"]]
    return "\n".join(lines)


def files_table(files: list[dict]) -> str:
    return columns(["ID", "FILENAME", "PURPOSE", "FORMAT", "EXAMPLES", "BYTES", "AGE"],
                   [[f["id"], f["filename"], f["purpose"], f["format"], f["examples"], f["bytes"],
                     age(f["created_at"])] for f in files])


def events_table(events: list[dict]) -> str:
    """Oldest first, as a log reads."""
    return "\n".join(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['createdAt']))}  {e['level']:7}  "
                     f"{e['message']}" for e in events)


def metrics_table(points: list[dict]) -> str:
    headers = {"step": "STEP", "loss": "LOSS", "learningRate": "LEARNING_RATE", "gradNorm": "GRAD_NORM",
               "tokensPerSecond": "TOKENS_PER_SECOND", "stepSeconds": "STEP_SECONDS",
               "rewardMargin": "REWARD_MARGIN", "preferenceAccuracy": "PREFERENCE_ACCURACY"}  # (the last two: dpo)
    shown = [k for k in headers if any(k in p for p in points)]

    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else value
    return columns([headers[k] for k in shown], [[cell(p.get(k)) for k in shown] for p in points])


def checkpoints_table(checkpoints: list[dict]) -> str:
    return columns(["STEP", "TRAIN_LOSS", "LOCATION", "AGE"],
                   [[c["stepNumber"], f"{c['metrics']['trainLoss']:.4f}" if c["metrics"].get("trainLoss")
                     is not None else None, c["fineTunedModelCheckpoint"], age(c["createdAt"])]
                    for c in checkpoints])


def pools_table(pools: list[dict]) -> str:
    rows = []
    for p in pools:
        if "gpu" in p:
            links = p["intraNode"] + (f" / {p['interNode']}" if p.get("interNode") else "")
            rows.append([p["name"], p["gpu"], p["gpusPerNode"], p["maxNodes"], links, f"${p['pricePerGPUHour']:,.2f}"])
        else:  # a backend's own pool (this machine): described in words
            rows.append([p["name"], ", ".join(p.get("gpusFound") or []) or "none (CPU)", p.get("gpusUsed"), 1, "-",
                         f"${p.get('pricePerGPUHour', 0):,.2f}"])
    return columns(["NAME", "GPU", "GPUS/NODE", "MAX NODES", "LINKS", "PRICE/GPU-HOUR"], rows)


def tokens_table(tokens: list[dict]) -> str:
    return columns(["ID", "TENANT", "ADMIN", "NAME", "AGE"],
                   [[t["id"], t["tenant"], "yes" if t["admin"] else "no", t["name"] or None, age(t["createdAt"])]
                    for t in tokens])


def artifacts_table(files: list[dict]) -> str:
    return columns(["PATH", "BYTES"], [[f["path"], f["bytes"]] for f in files])


def is_finished(job: dict) -> bool:
    return job["status"] in TERMINAL
