"""Why is my job slow? Predicted and measured side by side, per component of a step: pure.

The planner predicts a step as matrix products + memory-bound work and launches + exposed communication
+ the optimizer step (its `Predicted`); the runtime measures each step's data wait, forward/backward and
optimizer phases (CUDA events), and in its profiler windows the communication, the GPU kernels by kind and
how busy the GPU was (`comm` records); checkpoints report how long they took. `diagnose` puts the two
together with the planner's own definitions, names the component that dominates the step and the one that
explains the gap to the prediction, and says what to do about it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pydantic import Field

from tunewright_core.spec import CamelModel, JobPlan

ON_PLAN = 0.10  # a step within 10% of the prediction is on plan (the planner's published error is ~5%)
NOTABLE = 0.05  # a component worth a suggestion takes at least this share of the step


@dataclass(frozen=True)
class Observed:
    """What the runtime measured, as the API keeps it: recent metric points, the last profiler window."""

    steps: int  # optimizer steps done
    points: list[dict]  # recent metric points (step records' fields), oldest first
    comm: dict | None  # the last `comm` record
    checkpoint_seconds: float  # every checkpoint written, all of them
    held_seconds: float | None  # since the run started (the GPUs held)
    checkpoint_every: int | None = None


class Component(CamelModel):
    name: str
    predicted_seconds: float | None = Field(default=None, description="Per step, the planner's.")
    measured_seconds: float | None = Field(default=None, description="Per step, the runtime's.")
    measured_share: float | None = Field(default=None, description="Of the measured step.")


class Diagnosis(CamelModel):
    status: str = Field(description="on plan | slower than planned | faster than planned | not measured yet | "
                                    "no prediction (CPU)")
    predicted_step_seconds: float | None = None
    measured_step_seconds: float | None = None
    gap: float | None = Field(default=None, description="measured / predicted step - 1")
    dominant: str | None = Field(default=None, description="The component that takes most of the step.")
    explains_gap: str | None = Field(default=None, description="The component furthest over its prediction.")
    goodput: float | None = Field(default=None, description="Step time / time the workers (GPUs) were held.")
    components: list[Component] = Field(default_factory=list)
    findings: list[str] = Field(default_factory=list, description="What was measured, then what to do.")


def _median(points: list[dict], key: str) -> float | None:
    values = [p[key] for p in points if p.get(key) is not None]
    return statistics.median(values) if values else None


def measured_components(obs: Observed) -> dict[str, float]:
    """Seconds per step by component, in the planner's terms, from the recent steps and the last window."""
    step, data = _median(obs.points, "step_seconds"), _median(obs.points, "data_seconds") or 0.0
    forward_backward = _median(obs.points, "forward_backward_seconds") or 0.0
    optimizer = _median(obs.points, "optimizer_seconds") or 0.0
    comm = obs.comm or {}
    exposed = comm.get("exposed_comm_seconds_per_step") or 0.0
    out = {"data wait": data, "optimizer and host": optimizer, "exposed communication": exposed}
    if comm.get("matmul_seconds_per_step") is not None:
        # the window's kernels: matrix products and attention are the planner's matmul time; the rest of the
        # kernels and the time the GPU idled (launches, host copies), less the optimizer step (its kernels, or
        # idle time when the host runs it) and the data wait, its memory-bound time; scaled from the profiled
        # step to the measured one
        window = comm["profiled_step_seconds"]
        idle = max(0.0, 1 - comm["gpu_busy_share"]) * window
        memory_bound = max(0.0, comm["other_compute_seconds_per_step"] + idle - optimizer - data)
        matmul = comm["matmul_seconds_per_step"] + comm["attention_seconds_per_step"]
        scale = max(0.0, forward_backward - exposed) / max(matmul + memory_bound, 1e-9) if forward_backward else 1.0
        scale = scale if 0.5 < scale < 2 else 1.0  # a window far from the recent steps: as measured
        out |= {"matrix products": matmul * scale, "memory-bound and launches": memory_bound * scale}
    else:  # no GPU kernels (the CPU): compute as one
        out["compute"] = max(0.0, forward_backward - exposed)
    if step is not None:  # host time outside the measured phases (logging, Python between steps)
        out["other"] = max(0.0, step - sum(out.values()))
    if obs.steps:  # between steps, so outside the median step: spread over the steps done
        out["checkpoints"] = obs.checkpoint_seconds / obs.steps
    return out


def predicted_components(plan: JobPlan) -> dict[str, float]:
    p = plan.predicted
    # offloaded states' copies are memcpys, not kernels: the GPU idles through them, which the measured side counts
    # with the memory-bound work and launches (and, with no kernels measured, in the compute)
    return {"matrix products": p.matmul_seconds,
            "memory-bound and launches": p.memory_bound_seconds + p.exposed_offload_seconds,
            "exposed communication": p.exposed_comm_seconds,
            "optimizer and host": p.optimizer_seconds, "data wait": 0.0, "checkpoints": 0.0}


def diagnose(plan: JobPlan | None, obs: Observed) -> Diagnosis:
    step = _median(obs.points, "step_seconds")
    if step is None or not obs.steps:
        return Diagnosis(status="not measured yet", findings=["no step has been measured yet"])
    measured = measured_components(obs)
    predicted = predicted_components(plan) if plan and plan.predicted else {}
    if predicted and "compute" in measured:  # no kernel breakdown measured: compare the compute as one
        predicted = {"compute": predicted.pop("matrix products") + predicted.pop("memory-bound and launches"),
                     **predicted}
    names = list(dict.fromkeys([*predicted, *measured]))
    components = [Component(name=n, predicted_seconds=predicted.get(n), measured_seconds=measured.get(n),
                            measured_share=measured[n] / step if n in measured else None) for n in names]
    dominant = max(measured, key=measured.get)
    goodput = None
    if obs.held_seconds:
        productive = obs.steps * max(0.0, step - measured.get("data wait", 0.0))
        goodput = min(1.0, productive / obs.held_seconds)
    out = Diagnosis(status="no prediction (CPU)", measured_step_seconds=step, dominant=dominant, goodput=goodput,
                    components=components)
    findings = [f"{dominant} takes {measured[dominant] / step:.0%} of a {step * 1000:.0f} ms step"]
    if predicted:
        out.predicted_step_seconds = plan.predicted.step_seconds
        out.gap = step / plan.predicted.step_seconds - 1
        out.status = ("on plan" if abs(out.gap) <= ON_PLAN else
                      "slower than planned" if out.gap > 0 else "faster than planned")
        excess = {n: measured.get(n, 0.0) - predicted.get(n, 0.0) for n in names}
        culprit = max(excess, key=excess.get)
        if out.gap > ON_PLAN and excess[culprit] > 0:
            out.explains_gap = culprit
            share = excess[culprit] / (step - plan.predicted.step_seconds)
            findings.append(f"the step is {out.gap:.0%} slower than predicted ({step * 1000:.0f} ms vs "
                            f"{plan.predicted.step_seconds * 1000:.0f}); {culprit} explains {min(share, 1):.0%} of "
                            f"that ({measured.get(culprit, 0) * 1000:.0f} ms vs "
                            f"{predicted.get(culprit, 0) * 1000:.0f} predicted)")
        elif out.status == "on plan":
            findings.append(f"on plan: {step * 1000:.0f} ms a step against {plan.predicted.step_seconds * 1000:.0f} "
                            "predicted")
    findings += suggestions(plan, obs, measured, step, out)
    out.findings = findings
    return out


def suggestions(plan: JobPlan | None, obs: Observed, measured: dict[str, float], step: float,
                found: Diagnosis) -> list[str]:
    """What follows from what was measured, the component that explains the gap first."""
    said: list[str] = []
    p = plan.predicted if plan else None
    share = {n: s / step for n, s in measured.items()}
    order = [found.explains_gap] if found.explains_gap else []
    order += sorted((n for n in measured if n not in order), key=lambda n: -share[n])
    comm = obs.comm or {}
    for name in order:
        if share.get(name, 0) < NOTABLE and name != found.explains_gap:
            continue
        if name == "exposed communication":
            line = (f"exposed communication is {share[name]:.0%} of the step"
                    + (f" vs {p.exposed_comm_share:.0%} predicted" if p else ""))
            wait = comm.get("wait_seconds_per_step")
            transfer = comm.get("transfer_seconds_per_step")
            if wait is not None and transfer is not None and comm.get("comm_seconds_per_step"):
                line += (f"; of the collectives' {comm['comm_seconds_per_step'] * 1000:.0f} ms a step, "
                         f"{wait * 1000:.0f} ms is waiting for the slowest rank (rank {comm.get('slowest_rank')}) "
                         f"and {transfer * 1000:.0f} ms transfer")
                if p and transfer > 0:
                    line += f", which runs at {p.comm_seconds / transfer:.0%} of the speed the pool's declared links predict"
            elif p and comm.get("comm_seconds_per_step"):
                speed = p.comm_seconds / comm["comm_seconds_per_step"]
                line += (f": the collectives ran at {speed:.0%} of the speed the pool's declared links "
                         "predict (a slower link, or ranks waiting for the slowest one)")
            alternatives = [r for r in (plan.rejected if plan else []) if r.strategy in ("hsdp", "ddp", "single")
                            and r.strategy != plan.strategy]
            if alternatives:
                line += "; the planner's alternatives that communicate less: " + "; ".join(
                    f"{r.strategy}{f' on {r.gpus} GPUs' if r.gpus else ''} ({r.reason})" for r in alternatives[:2])
            said.append(line)
        elif name == "data wait":
            said.append(f"the step waits {share[name]:.0%} of its time for its next batch: the host is busy "
                        "(fewer CPU cores than the workers need, or CPU offload's optimizer on the same cores)")
        elif name == "optimizer and host":
            said.append(f"the optimizer step takes {share[name]:.0%} of the step"
                        + (f" ({measured[name] * 1000:.0f} ms vs {p.optimizer_seconds * 1000:.0f} predicted)"
                           if p else "")
                        + (": offloaded to the host, so a larger micro-batch or more accumulation amortizes it"
                           if plan and plan.cpu_offload else ""))
        elif name == "checkpoints":
            every = f" every {obs.checkpoint_every} steps" if obs.checkpoint_every else ""
            said.append(f"checkpoints{every} take {share[name]:.0%} of the training time: checkpoint less "
                        "often (checkpoint.everySteps)")
        elif name == "matrix products" and p and measured[name] > (1 + ON_PLAN) * p.matmul_seconds:
            said.append(f"matrix products run at {p.matmul_seconds / measured[name]:.0%} of the calibrated rate: "
                        "the GPUs may be throttled or shared, or this model's shapes are outside the calibration")
        elif name == "memory-bound and launches" and p and measured[name] > (1 + ON_PLAN) * (
                expected := p.memory_bound_seconds + p.exposed_offload_seconds):
            offloaded = plan is not None and plan.cpu_offload
            busy = comm.get("gpu_busy_share")
            idled = (f"; the GPU idled {1 - busy:.0%} of the profiled steps ("
                     + ("waiting on the host copies: fewer, larger micro-batches copy the states in fewer times"
                        if offloaded else "launch-bound: a larger micro-batch gives each launch more work") + ")"
                     if busy is not None and busy < 0.9 else "")
            said.append(f"memory-bound work and launches{' (and the host copies)' if offloaded else ''} take "
                        f"{measured[name] / max(expected, 1e-9):.1f}x the prediction{idled}")
    slowest, median = comm.get("rank_own_seconds_max"), comm.get("rank_own_seconds_median")
    wait = comm.get("wait_seconds_per_step")
    if slowest and median and wait is not None and slowest > (1 + ON_PLAN) * median and wait / step >= NOTABLE:
        said.append(f"rank {comm.get('slowest_rank')} is a straggler: its own work takes {slowest * 1000:.0f} ms a "
                    f"step against the ranks' median {median * 1000:.0f}, and the others wait for it "
                    f"({wait / step:.0%} of the step on average): look for a slower GPU or a busier host on its node")
    if found.goodput is not None and found.goodput < 0.8:
        said.append(f"{found.goodput:.0%} of the time the workers were held went to training steps: the rest "
                    "was start-up, evaluation, checkpoints and waits")
    return said
