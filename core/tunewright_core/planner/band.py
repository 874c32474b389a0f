"""How far a prediction can be trusted: a P10-P90 band of measured over predicted tokens/s, from the
errors on runs the model was not fitted on, widened where the plan extrapolates beyond them.

- One H200, or one GPU of its die (an H100): the committed one-GPU runs held out of the calibration
  (calibration_fit; on an H100, our runs there checked it: chip_check).
- Anything else: the published multi-GPU runs held out of the scale fit (scale_fit: other frameworks,
  model sizes, GPU counts and clusters than the fit set).

The band is widened (its log-width multiplied) for each way the plan leaves what was measured: a GPU no
run measured (unless the pool's own jobs measured it, over at least `LEARNED_ENOUGH` profiler windows), more GPUs than the largest published run, a network no published run used, sequences longer
than the fit's, LoRA on several GPUs (every published run is full fine-tuning), the dpo objective (sft's terms
for the work it adds, checked on two runs of one model), a 4-bit QLoRA base (its dequantization fitted on one
Llama-8B run on an H200, checked on two on an H100), CPU offload (its copies' rate fitted on one run, checked on
one other), bf16
weights and moments on several GPUs (their sharded step never measured; on one H200 two runs checked it), or FP8
products (their casts fitted on one LoRA run on one H100, checked on one other; no full fine-tune measured).
`basis` says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunewright_core.planner.hardware import ONE_GPU_MEASURED, Link

MEASURED_ONE_GPU = "H200"
# the catalog GPUs whose efficiency runs measured (ours on the H200, published ones on the others); the rest
# borrow the nearest chip's (calibration.EFFICIENCY_OF)
MEASURED_CHIPS = frozenset({"H200", "H100", "A100-80GB", "A100-40GB"})
UNMEASURED_GPU, BEYOND_LARGEST, UNMEASURED_NETWORK, LONGER_SEQUENCES, LORA_ON_SEVERAL = 2.0, 0.5, 1.5, 2.0, 1.25
UNMEASURED_OBJECTIVE = 1.25  # dpo: its step is sft's terms applied to the work it adds; two runs checked it
UNMEASURED_FP8 = 1.5  # fp8: its casts fitted on one LoRA run, checked on one other; no full fine-tune measured
UNMEASURED_LIGHT_STATE = 1.25  # optimizer_state bf16 on several GPUs: the sharded step is counted, not measured
UNMEASURED_QLORA = 1.25  # qlora: its dequantization term fitted on one run, checked on two (70B and 8B, one H100)
UNMEASURED_OFFLOAD = 1.25  # cpu offload: the copies' rate fitted on one run, checked on one other (step +2.8%)
LEARNED_ENOUGH = 3  # profiler windows of a pool's own jobs that stand for a run measured on its GPU


@dataclass(frozen=True)
class Evidence:
    """What the band is made of (the committed scale.json)."""

    one_gpu: tuple[float, float]  # P10, P90 of measured over predicted tokens/s, one H200
    published: tuple[float, float]  # the same, published multi-GPU runs held out
    published_rows: int
    one_gpu_rows: int
    largest_gpu_count: int
    longest_sequence: int
    network_range: tuple[float, float]  # the inter-node bus bandwidths (bytes/s per node) published runs had


@dataclass(frozen=True)
class Band:
    low: float  # measured over predicted tokens/s, P10
    high: float  # P90
    basis: str  # what it comes from and where it extrapolates

    def around(self, value: float, inverse: bool = False) -> tuple[float, float]:
        """The band of a predicted quantity: tokens/s scale with it; step time, duration and cost inversely."""
        return (value / self.high, value / self.low) if inverse else (value * self.low, value * self.high)


def band(evidence: Evidence, gpu: str, gpus: int, network: Link | None, seq_len: int, method: str,
         learned_windows: int = 0, objective: str = "sft", optimizer_state: str = "fp32",
         precision: str = "bf16", cpu_offload: bool = False) -> Band:
    """The band of a plan of `gpus` `gpu`s whose collectives cross `network` (None: one node); the GPU's
    efficiency learned over `learned_windows` profiler windows of the pool's own jobs (0: the catalog's)."""
    one_measured_gpu = gpus == 1 and gpu in ONE_GPU_MEASURED
    low, high = evidence.one_gpu if one_measured_gpu else evidence.published
    basis = (f"{evidence.one_gpu_rows} one-GPU H200 runs held out of the calibration" if one_measured_gpu else
             f"{evidence.published_rows} published multi-GPU runs held out of the fit (other frameworks, sizes, "
             "GPU counts and clusters)")
    if one_measured_gpu and gpu != MEASURED_ONE_GPU:
        basis += f" (the {gpu} is the H200's chip with less memory; runs of ours on one checked it)"
    widen, reasons = 1.0, []
    if learned_windows:
        basis += (f"; the {gpu}'s compute efficiency as {learned_windows} profiler window"
                  f"{'s' if learned_windows != 1 else ''} of this pool's jobs measured it")
    if gpu not in MEASURED_CHIPS and learned_windows < LEARNED_ENOUGH:
        widen *= UNMEASURED_GPU
        reasons.append(f"no run measured a {gpu}" + (f" but {learned_windows} window{'s' if learned_windows != 1 else ''}"
                                                      " of this pool's jobs" if learned_windows else ""))
    if gpus > evidence.largest_gpu_count:
        widen *= 1 + BEYOND_LARGEST * math.log2(gpus / evidence.largest_gpu_count)
        reasons.append(f"{gpus} GPUs, beyond the largest published run ({evidence.largest_gpu_count})")
    slowest, fastest = evidence.network_range
    if network is not None and not slowest <= network.bus_bytes_per_s <= fastest:
        widen *= UNMEASURED_NETWORK
        reasons.append(f"no published run crossed nodes at {network.bus_bytes_per_s / 1e9:.3g} GB/s ({network.name}; "
                       f"they ran at {slowest / 1e9:.3g}-{fastest / 1e9:.3g})")
    if seq_len > evidence.longest_sequence:
        widen *= LONGER_SEQUENCES
        reasons.append(f"sequences of {seq_len} tokens, beyond the fit's {evidence.longest_sequence}")
    if method != "full" and gpus > 1:
        widen *= LORA_ON_SEVERAL
        reasons.append(f"{method} on several GPUs (every published run is full fine-tuning)")
    if method == "qlora":
        widen *= UNMEASURED_QLORA
        reasons.append("a 4-bit base (its dequantization fitted on one Llama-8B run on an H200; a 70B-shaped and an "
                       "8B run on an H100 held out, within 2.2%)")
    if cpu_offload:
        widen *= UNMEASURED_OFFLOAD
        reasons.append("CPU offload (its copies' rate fitted on one Llama-8B LoRA run on one H100; a Llama-1B full "
                       "run on one H200 held out: step +3%, its forward and backward +15%; none across GPUs)")
    if precision == "fp8":
        widen *= UNMEASURED_FP8
        reasons.append("fp8 products (their casts fitted on one Llama-8B LoRA run on one H100; no full fine-tune "
                       "measured)")
    if optimizer_state == "bf16" and gpus > 1:
        widen *= UNMEASURED_LIGHT_STATE
        reasons.append("bf16 weights and moments on several GPUs (their sharded step counted, not measured)")
    if objective != "sft":
        widen *= UNMEASURED_OBJECTIVE
        reasons.append(f"objective {objective} (sft's terms for the work it adds; two runs on one H200 checked "
                       "them, within 8.5%)")
    low, high = min(low, 1.0), max(high, 1.0)
    low, high = math.exp(math.log(low) * widen), math.exp(math.log(high) * widen)
    extrapolates = f"; extrapolates: {', '.join(reasons)}" if reasons else "; within what was measured"
    return Band(low, high, f"P10-P90 from {basis}{extrapolates}")
