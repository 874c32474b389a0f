"""Memory and time of one layout of one workload: pure arithmetic, no I/O.

Memory is the allocator's peak per GPU (what `torch.cuda.max_memory_allocated` reports), in bytes:
model states by strategy (REFERENCE.md table, as the runtime actually stores them), activations per
micro-batch, logits and loss. Time per optimizer step is split into matrix-product time, memory-bound
time, exposed communication and the optimizer step. The constants that kernels decide (bytes kept or
moved per token, efficiencies) live in `Calibration`, fitted to measured runs (calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunewright_operator.planner.hardware import GPU, Pool
from tunewright_operator.planner.models import ModelProfile

ADAMW_BYTES_PER_PARAM = 28  # fused AdamW reads param, grad, m, v (fp32) and writes param, m, v
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Workload:
    model: ModelProfile
    method: str  # lora | full
    seq_len: int
    global_batch: int  # sequences per optimizer step
    steps: int
    lora_rank: int = 16

    @property
    def trainable_params(self) -> int:
        return self.model.params if self.method == "full" else self.model.lora_params(self.lora_rank)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    strategy: str  # single | ddp | fsdp | hsdp
    gpus: int
    nodes: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    shard_group: int = 1  # GPUs one copy of the states is sharded over (fsdp: all; hsdp: one node)

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")


def precision_path(layout: Layout) -> str:
    """How the runtime computes in bf16: FSDP's MixedPrecisionPolicy (bf16 parameters) or autocast."""
    return "mp" if layout.sharded else "autocast"


@dataclass(frozen=True)
class Calibration:
    """Constants that kernels decide, fitted on measured runs of the smallest models (calibration.py).

    Activation rates are keyed `<precision path>/<family>` (`autocast/llama`, `mp/gpt2`, ...): what is
    kept for backward depends on both. Traffic rates are keyed by family alone (fewer runs pin them down).
    """

    act_bytes_per_hidden: dict[str, float]  # kept for backward, per token per layer per unit of hidden size
    logits_bytes_per_vocab: float  # logits, their fp32 copy and gradient, per token per vocabulary entry
    traffic_bytes_per_hidden: dict[str, float]  # memory-bound traffic per token per layer per unit of hidden, by family
    autocast_traffic_bytes_per_hidden: float  # what autocast adds (casts of weights and activations each use)
    lora_traffic_bytes_per_hidden: float  # per adapted module per token
    seconds_per_layer: float  # per micro-batch: launches and latency-bound kernels of one block
    seconds_per_lora_module: float  # per micro-batch, per adapted module
    act_bytes_per_ffn: float = 8.0  # gated MLP: gate, up, activation and product kept in bf16
    traffic_bytes_per_vocab: float = 26.0  # bf16 logits, fp32 copy, log-softmax and its gradient
    comm_interference: float = 0.3  # overlapped collectives still slow compute (SMs and HBM they share)

    def key(self, layout: Layout, model: ModelProfile) -> str:
        return f"{precision_path(layout)}/{model.family}"


@dataclass(frozen=True)
class Estimate:
    peak_memory_bytes: float
    memory_breakdown: dict[str, float]
    step_seconds: float
    matmul_seconds: float
    memory_bound_seconds: float
    optimizer_seconds: float
    comm_seconds: float  # all collective time in a step (total)
    exposed_comm_seconds: float  # the part that no compute hides

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.step_seconds

    @property
    def exposed_comm_share(self) -> float:
        return self.exposed_comm_seconds / self.step_seconds


# --- memory ------------------------------------------------------------------------------------------


def state_bytes(w: Workload, layout: Layout) -> dict[str, float]:
    """Weights and optimizer states per GPU, as the runtime holds them at the peak.

    Gradients are not counted apart: they are freed after each step and grow during backward as the
    activations they replace are freed, so the activation term (fitted on measured peaks) covers them.
    """
    psi, trainable = w.model.params, w.trainable_params
    shard = layout.shard_group if layout.sharded else 1
    out: dict[str, float] = {}
    if w.method == "full":
        out["weights (fp32 master)"] = FP32 * psi / shard
        out["optimizer (AdamW m, v)"] = 2 * FP32 * psi / shard
        if layout.sharded:
            # the blocks being computed are unsharded in bf16 (current and prefetched) with fp32 gradients
            block = w.model.layer_linear_params
            out["unsharded blocks"] = 2 * BF16 * block + FP32 * block
        else:
            out["bf16 weight copies (autocast)"] = BF16 * psi
            if layout.strategy == "ddp":
                out["DDP gradient buckets"] = FP32 * psi
    else:
        out["frozen base (bf16)"] = BF16 * psi / shard
        out["adapters, grads, AdamW"] = 4 * FP32 * trainable / shard
        if layout.strategy == "ddp":
            out["DDP gradient buckets"] = FP32 * trainable
        if layout.sharded:
            out["unsharded blocks"] = 2 * BF16 * w.model.layer_linear_params
    return out


def activation_bytes(w: Workload, layout: Layout, cal: Calibration) -> dict[str, float]:
    m = w.model
    tokens = layout.micro_batch * w.seq_len
    ffn = cal.act_bytes_per_ffn * m.ffn if m.gated_mlp else 0.0  # GPT-2's MLP is folded into its per-hidden rate
    per_layer = tokens * (cal.act_bytes_per_hidden[cal.key(layout, m)] * m.hidden + ffn)
    if layout.activation_checkpointing:
        # layer inputs kept (bf16), and one layer's activations alive while it is recomputed
        layers = tokens * m.layers * BF16 * m.hidden + per_layer
    else:
        layers = m.layers * per_layer
    return {"activations": layers, "logits and loss": tokens * m.vocab * cal.logits_bytes_per_vocab}


# --- time --------------------------------------------------------------------------------------------


def matmul_flops(w: Workload, layout: Layout) -> float:
    """Hardware FLOPs of one micro-batch: forward, input gradients, weight gradients (full only), causal
    flash attention (half the square), and one more forward under activation checkpointing."""
    m = w.model
    tokens = layout.micro_batch * w.seq_len
    dense = 2 * m.matmul_params
    attention = 2 * w.seq_len * m.heads * m.head_dim * m.layers  # causal: half of 4·s·q per layer
    forward = dense + attention
    backward = dense + 2 * attention + (dense if w.method == "full" else 6 * w.trainable_params)
    recompute = forward if layout.activation_checkpointing else 0
    return tokens * (forward + backward + recompute)


def recompute_factor(layout: Layout) -> float:
    return 4 / 3 if layout.activation_checkpointing else 1.0  # the forward's third of the work runs twice


def memory_bound_bytes(w: Workload, layout: Layout, cal: Calibration) -> float:
    m = w.model
    tokens = layout.micro_batch * w.seq_len
    rate = cal.traffic_bytes_per_hidden[m.family]
    if precision_path(layout) == "autocast":
        rate += cal.autocast_traffic_bytes_per_hidden
    layers = tokens * m.layers * rate * m.hidden
    lora = 0.0
    if w.method == "lora":
        lora = tokens * m.layers * m.linear_modules_per_layer * cal.lora_traffic_bytes_per_hidden * m.hidden
    return (layers + lora) * recompute_factor(layout) + tokens * m.vocab * cal.traffic_bytes_per_vocab


def fixed_seconds(w: Workload, layout: Layout, cal: Calibration) -> float:
    """Per micro-batch time that does not grow with tokens: kernel launches and latency-bound kernels."""
    modules = w.model.layers * w.model.linear_modules_per_layer if w.method == "lora" else 0
    return (w.model.layers * cal.seconds_per_layer + modules * cal.seconds_per_lora_module) * recompute_factor(layout)


def collective_seconds(nbytes: float, ranks: int, factor: float, link) -> float:
    """latency + factor · bytes / busbw, factor 2(n-1)/n for all-reduce, (n-1)/n for gather/scatter."""
    if ranks <= 1:
        return 0.0
    return link.latency_s * 2 * (ranks - 1) + factor * nbytes / link.bus_bytes_per_s


def comm_per_step(w: Workload, layout: Layout, pool: Pool) -> tuple[float, str]:
    """Seconds of collectives per optimizer step, and which link bounds them."""
    n = layout.gpus
    spans_nodes = layout.nodes > 1
    inter = pool.inter_node or pool.intra_node
    world_link = inter if spans_nodes and inter.bus_bytes_per_s < pool.intra_node.bus_bytes_per_s else pool.intra_node
    trainable = w.trainable_params
    if layout.strategy == "ddp":  # one all-reduce of fp32 gradients per step
        return collective_seconds(FP32 * trainable, n, 2 * (n - 1) / n, world_link), world_link.name
    if not layout.sharded:
        return 0.0, ""
    g = layout.shard_group
    shard_link = pool.intra_node if g <= pool.gpus_per_node else world_link
    # every weight is gathered in bf16, frozen ones too, in forward and again in backward
    per_micro = (2 * collective_seconds(BF16 * w.model.params, g, (g - 1) / g, shard_link)
                 + collective_seconds(FP32 * trainable, g, (g - 1) / g, shard_link))  # reduce-scatter
    if layout.strategy == "hsdp":
        replicas = n // g
        per_micro += collective_seconds(FP32 * trainable / g, replicas, 2 * (replicas - 1) / replicas, world_link)
        link = world_link if replicas > 1 else shard_link
    else:
        link = shard_link
    return per_micro * layout.grad_accum, link.name


def estimate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Estimate:
    gpu: GPU = pool.gpu
    memory = {**state_bytes(w, layout), **activation_bytes(w, layout, cal)}
    micro = layout.grad_accum
    mm = micro * matmul_flops(w, layout) / (gpu.bf16_flops * gpu.matmul_efficiency)
    mb = micro * (memory_bound_bytes(w, layout, cal) / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
                  + fixed_seconds(w, layout, cal))
    local_trainable = w.trainable_params / (layout.shard_group if layout.sharded else 1)
    opt = ADAMW_BYTES_PER_PARAM * local_trainable / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    compute = mm + mb
    comm, _ = comm_per_step(w, layout, pool)
    # DDP's all-reduce overlaps the last micro-batch's backward (about 2/3 of its compute); FSDP prefetches
    # the next block's gather during this block's compute, all step long.
    window = (2 / 3) * compute / micro if layout.strategy == "ddp" else compute
    exposed = max(0.0, comm - window)
    hidden = comm - exposed
    step = compute + opt + exposed + cal.comm_interference * hidden
    return Estimate(sum(memory.values()), memory, step, mm, mb, opt, comm, exposed)
