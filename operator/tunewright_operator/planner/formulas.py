"""Published reference formulas, kept beside the planner so tests can hold it to them.

ZeRO (Rajbhandari et al. 2020, section 5.1): mixed-precision Adam keeps 2Ψ fp16/bf16 weights, 2Ψ
gradients and KΨ optimizer states (K = 12: fp32 master weights, momentum, variance).
Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2: activations per transformer layer
s·b·h·(34 + 5·a·s/h) bytes without recomputation; flash attention removes the 5·a·s/h term.
"""

from __future__ import annotations

ZERO_K = 12


def zero_model_state_bytes(params: float, data_parallel: int, stage: int) -> float:
    """Bytes per GPU of weights, gradients and Adam states under ZeRO stage 0-3 (16Ψ at stage 0)."""
    weights, grads, optimizer = 2 * params, 2 * params, ZERO_K * params
    if stage >= 1:
        optimizer /= data_parallel
    if stage >= 2:
        grads /= data_parallel
    if stage >= 3:
        weights /= data_parallel
    return weights + grads + optimizer


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: int,
                                 flash_attention: bool = False) -> float:
    per_layer = 34 + (0 if flash_attention else 5 * heads * seq / hidden)
    return seq * batch * hidden * per_layer * layers
