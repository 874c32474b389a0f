"""Published reference formulas, kept beside the planner so tests can hold it to them.

ZeRO (Rajbhandari et al. 2020, section 5.1): mixed-precision Adam keeps 2Ψ fp16/bf16 weights, 2Ψ
gradients and KΨ optimizer states (K = 12: fp32 master weights, momentum, variance).
Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2: activations per transformer layer
s·b·h·(34 + 5·a·s/h) bytes without recomputation; flash attention removes the 5·a·s/h term.
DeepSpeed's ZeRO-3 estimator (`estimate_zero3_model_states_mem_needs`, docs "Memory Requirements"): per GPU
4·L (the largest layer's bf16 parameters and gradients) + 18Ψ/N without offload, + 2Ψ/N with the
optimizer offloaded, nothing more with parameters offloaded too; per host, with zero_init and its 1.5
buffer factor, Ψ·max(4·G, 16)·1.5 (optimizer offloaded), Ψ·max(4·G, 18)·1.5 (both) or 4·L·G·1.5 (none),
G GPUs per node.
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


def deepspeed_zero3_bytes(params: float, largest_layer: float, gpus_per_node: int, nodes: int,
                          offload_optimizer: bool, offload_params: bool) -> tuple[float, float]:
    """(per GPU, per host) bytes of model states by DeepSpeed's ZeRO-3 estimator (zero_init on)."""
    gpus = gpus_per_node * nodes
    largest = 4 * largest_layer
    if offload_params:
        return largest, params * max(4 * gpus_per_node, 18) * 1.5
    if offload_optimizer:
        return largest + 2 * params / gpus, params * max(4 * gpus_per_node, 16) * 1.5
    return largest + 18 * params / gpus, largest * gpus_per_node * 1.5
