"""Memory and time of one layout of one workload: pure arithmetic, no I/O.

Memory is the allocator's peak per GPU (what `torch.cuda.max_memory_allocated` reports), in bytes, at
the higher of two moments: the start of backward (model states by strategy, REFERENCE.md table, as the
runtime actually stores them; activations per micro-batch, logits and loss) and the end of backward (the
states and every gradient, the activations freed). With CPU offload the states move to host memory,
reported apart. Time per optimizer step is split into matrix-product time, memory-bound time, exposed
communication, exposed host copies and the optimizer step (the host's when offloaded). The constants that kernels decide (bytes kept or moved per
token, efficiencies) live in `Calibration`, fitted to measured runs (calibration_fit.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunewright_operator.planner.hardware import GPU, Link, Pool
from tunewright_operator.planner.models import ModelProfile

ADAMW_BYTES_PER_PARAM = 28  # fused AdamW reads param, grad, m, v (fp32) and writes param, m, v
BF16, FP32 = 2, 4
NF4 = 0.52  # QLoRA's 4-bit base with double-quantized block constants (QLoRA paper), per block weight


@dataclass(frozen=True)
class Workload:
    model: ModelProfile
    method: str  # lora | qlora | full
    seq_len: int
    global_batch: int  # sequences per optimizer step
    steps: int
    lora_rank: int = 16

    @property
    def trainable_params(self) -> int:
        return self.model.params if self.method == "full" else self.model.lora_params(self.lora_rank)

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "qlora")

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
    shard_group: int = 1  # GPUs one copy of the states is sharded over (single, ddp: 1; fsdp: all; hsdp: a group)
    cpu_offload: bool = False  # sharded states in host memory, optimizer step on the CPU

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard_group


@dataclass(frozen=True)
class Calibration:
    """Constants that kernels decide, fitted on measured runs of the smallest models (calibration_fit.py).

    Every strategy runs the same mixed precision (fp32 masters, bf16 compute: FSDP2's, or on `single` the
    runtime's own with the same casts), so the rates depend on the model family alone.
    """

    act_bytes_per_hidden: dict[str, float]  # kept for backward, per token per layer per unit of hidden size
    logits_bytes_per_vocab: float  # logits, their fp32 copy and gradient, per token per vocabulary entry
    traffic_bytes_per_hidden: dict[str, float]  # memory-bound traffic per token per layer per unit of hidden
    lora_traffic_bytes_per_hidden: float  # per adapted module per token
    seconds_per_layer: float  # per micro-batch: launches and latency-bound kernels of one block
    seconds_per_lora_module: float  # per micro-batch, per adapted module
    cpu_adam_seconds_per_param: float = 4e-9  # host AdamW step per offloaded trainable parameter, whole host
    # LoRA with activation checkpointing is bound by the host: per micro-batch, each adapted module costs this
    # much CPU time (measured; the GPU idles when its own work is shorter)
    host_seconds_per_lora_module_recompute: float = 0.0
    act_bytes_per_ffn: float = 8.0  # gated MLP: gate, up, activation and product kept in bf16
    traffic_bytes_per_vocab: float = 26.0  # bf16 logits, fp32 copy, log-softmax and its gradient
    comm_interference: float = 0.3  # overlapped collectives still slow compute (SMs and HBM they share)


START_OF_BACKWARD, END_OF_BACKWARD = "start of backward", "end of backward"
GRADIENTS = "gradients (fp32)"
ROOT_GATHERED = "embeddings and head, gathered (bf16)"
ROOT_GRADIENTS = "embedding and head gradients, reducing (bf16 + fp32 copy)"
LOSS_GRADIENTS = "loss's head and hidden-state gradients (bf16)"
# the terms at each moment that are not states kept through the step
TRANSIENT_TERMS = {START_OF_BACKWARD: ("activations", "logits and loss", LOSS_GRADIENTS),
                   END_OF_BACKWARD: (GRADIENTS, ROOT_GRADIENTS)}


@dataclass(frozen=True)
class Estimate:
    peak_memory_bytes: float
    memory_breakdown: dict[str, float]  # the terms at the peak
    host_memory_bytes: float  # per rank, offloaded states (pinned)
    step_seconds: float
    matmul_seconds: float
    memory_bound_seconds: float
    optimizer_seconds: float
    comm_seconds: float  # all collective time in a step (total)
    exposed_comm_seconds: float  # the part that no compute hides
    offload_seconds: float = 0.0  # host <-> GPU copies of offloaded states
    exposed_offload_seconds: float = 0.0
    peak_moment: str = START_OF_BACKWARD
    # the link whose collectives cost the step the most (exposed time, then total), and their seconds on it
    bounding_link: Link | None = None
    bounding_link_seconds: float = 0.0
    bounding_link_exposed_seconds: float = 0.0

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.step_seconds

    @property
    def exposed_comm_share(self) -> float:
        return self.exposed_comm_seconds / self.step_seconds


# --- memory ------------------------------------------------------------------------------------------


def sharded_states(w: Workload, layout: Layout) -> dict[str, float]:
    """Weights and optimizer states one rank keeps between steps (on the GPU, or the host when offloaded).

    Gradients are freed after each step (zero_grad to None) and grow during backward as the activations
    they replace are freed: they are counted at the end of backward (`end_of_backward_bytes`); only
    gradients accumulated across micro-batches stay alive through a forward, so they are states here.
    """
    psi, trainable, shard = w.model.params, w.trainable_params, layout.shard_group
    if w.method == "full":
        out = {"weights (fp32 master)": FP32 * psi / shard, "optimizer (AdamW m, v)": 2 * FP32 * psi / shard}
    elif w.method == "qlora":  # decoder blocks in NF4; embeddings, head and norms stay bf16
        blocks = w.model.layers * w.model.layer_linear_params
        out = {"frozen base (NF4 blocks, bf16 rest)": (NF4 * blocks + BF16 * (psi - blocks)) / shard,
               "adapters, grads, AdamW": 4 * FP32 * trainable / shard}
    else:
        out = {"frozen base (bf16)": BF16 * psi / shard, "adapters, grads, AdamW": 4 * FP32 * trainable / shard}
    if layout.grad_accum > 1:
        out["accumulated gradients (fp32)"] = FP32 * trainable / shard
    return out


def gathers_weights(w: Workload, layout: Layout) -> bool:
    """Whether the weights are computed on bf16 copies of them: always for full fine-tuning (fp32 masters);
    for a frozen LoRA base only when FSDP shards or offloads it (jobs' parallel.one_gpu_shards keeps a bf16
    base on one-GPU shards out of FSDP, as plain tensors, and `single` computes on it in place)."""
    return w.method == "full" or layout.shard_group > 1 or layout.cpu_offload


def host_state_bytes(w: Workload, layout: Layout) -> float:
    """Offloaded states per rank: the sharded states, and the gradients, which land on the host for the
    optimizer step whether or not micro-batches accumulate them."""
    if not layout.cpu_offload:
        return 0.0
    states = sharded_states(w, layout)
    if "accumulated gradients (fp32)" not in states:
        states["gradients (fp32)"] = FP32 * w.trainable_params / layout.shard_group
    return sum(states.values())


def gpu_state_bytes(w: Workload, layout: Layout) -> dict[str, float]:
    """States on the GPU through forward and backward: the sharded ones (unless offloaded); the blocks being
    computed, gathered in bf16 (current and prefetched; with shards of one GPU too, FSDP2 computes on a bf16
    copy); and the root unit (embeddings, head, final norm: jobs' parallel.shard_model shards the blocks,
    then the rest as one unit), gathered in bf16 at the start of forward and kept so until backward ends
    (FSDP2 does not reshard its root after forward). On shards of one GPU (not offloaded) every block's copy
    is kept from its forward to its backward (parallel.shard_model: nothing to free there but a copy);
    `single`'s compute copies (parallel.MasterWeights) are the same bytes."""
    out = {} if layout.cpu_offload else sharded_states(w, layout)
    if gathers_weights(w, layout):
        block = w.model.layer_linear_params
        held = w.model.layers if layout.shard_group == 1 and not layout.cpu_offload else 2
        out["unsharded blocks"] = held * BF16 * block + (FP32 * block if w.method == "full" else 0)
        out[ROOT_GATHERED] = BF16 * w.model.params_outside_blocks
    return out


def end_of_backward_bytes(w: Workload, layout: Layout) -> dict[str, float]:
    """On the GPU when backward ends, the activations freed: the sharded states; every trainable parameter's
    gradient, fp32 and sharded like its master (FSDP2 reduce-scatters in fp32 into the master's dtype; with
    offload they land on the host); and the reduction of the root unit, the last of the step: its gradients
    unsharded in bf16 (the head's made at the start of backward and held until the root's post-backward)
    copied into an fp32 reduce-scatter input. The blocks are resharded by then, their last reduce-scatter
    buffer released. `single` (parallel.MasterWeights) holds no more: it folds each bf16 gradient into its
    master's as backward makes it (no reduce-scatter input) and frees each compute copy there."""
    out = {} if layout.cpu_offload else sharded_states(w, layout)
    if not layout.cpu_offload and layout.grad_accum == 1:  # accumulated ones are states already
        out[GRADIENTS] = FP32 * w.trainable_params / layout.shard_group
    if w.method == "full":  # a LoRA base's embeddings and head are frozen: no gradients
        out[ROOT_GRADIENTS] = (BF16 + FP32) * w.model.params_outside_blocks
    return out


def activation_bytes(w: Workload, layout: Layout, cal: Calibration) -> dict[str, float]:
    m = w.model
    tokens = layout.micro_batch * w.seq_len
    ffn = cal.act_bytes_per_ffn * m.ffn if m.gated_mlp else 0.0  # GPT-2's MLP is folded into its per-hidden rate
    per_layer = tokens * (cal.act_bytes_per_hidden[m.family] * m.hidden + ffn)
    if layout.activation_checkpointing:
        # layer inputs kept (bf16), and one layer's activations alive while it is recomputed
        layers = tokens * m.layers * BF16 * m.hidden + per_layer
    else:
        layers = m.layers * per_layer
    # Backward scales the head's gradient into a second copy once the last chunk's logits are gone: the
    # larger of the two is alive beside the activations.
    logits = max(loss_tokens(w, layout) * m.vocab * cal.logits_bytes_per_vocab, head_gradient_bytes(w))
    return {"activations": layers, "logits and loss": logits, LOSS_GRADIENTS: loss_gradient_bytes(w, layout)}


def head_gradient_bytes(w: Workload) -> float:
    """The output head's gradient, which jobs' fused head and loss computes in forward (full fine-tuning)."""
    return BF16 * w.model.vocab * w.model.hidden if w.method == "full" else 0.0


def loss_gradient_bytes(w: Workload, layout: Layout) -> float:
    """What jobs' fused output head and loss computes in forward and holds for backward: d(loss)/d(hidden) of
    the micro-batch and the head's gradient."""
    return BF16 * layout.micro_batch * w.seq_len * w.model.hidden + head_gradient_bytes(w)


# jobs' kernels.FUSED_LOSS_CHUNK_ELEMENTS (a contract test holds them equal): the runtime's fused output
# head and loss hold the logits of one chunk of tokens at a time, never the micro-batch's
FUSED_LOSS_CHUNK_ELEMENTS = 1 << 28


def loss_tokens(w: Workload, layout: Layout) -> int:
    """Tokens whose logits are alive at once: one chunk of the fused loss (the runtime's default for
    the models the planner profiles), or the micro-batch when it is smaller."""
    return min(layout.micro_batch * w.seq_len, max(1, FUSED_LOSS_CHUNK_ELEMENTS // w.model.vocab))


def peak_memory(w: Workload, layout: Layout, cal: Calibration) -> tuple[str, dict[str, float]]:
    """When the peak falls and its terms. Each block's backward frees its activations and adds its
    gradients, so memory moves monotonically from the start of backward (states, activations, logits) to
    its end (states, gradients) and peaks at one of the two: the first for large micro-batches, the second
    for large models on few GPUs at small ones."""
    start = {**gpu_state_bytes(w, layout), **activation_bytes(w, layout, cal)}
    end = end_of_backward_bytes(w, layout)
    return (END_OF_BACKWARD, end) if sum(end.values()) > sum(start.values()) else (START_OF_BACKWARD, start)


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
    layers = tokens * m.layers * cal.traffic_bytes_per_hidden[m.family] * m.hidden
    lora = 0.0
    if w.adapters:
        lora = tokens * m.layers * m.linear_modules_per_layer * cal.lora_traffic_bytes_per_hidden * m.hidden
    return (layers + lora) * recompute_factor(layout) + tokens * m.vocab * cal.traffic_bytes_per_vocab


def lora_modules(w: Workload) -> int:
    return w.model.layers * w.model.linear_modules_per_layer if w.adapters else 0


def fixed_seconds(w: Workload, layout: Layout, cal: Calibration) -> float:
    """Per micro-batch time that does not grow with tokens: kernel launches and latency-bound kernels."""
    return (w.model.layers * cal.seconds_per_layer + lora_modules(w) * cal.seconds_per_lora_module) \
        * recompute_factor(layout)


def host_floor_seconds(w: Workload, layout: Layout, cal: Calibration) -> float:
    """Per micro-batch host time that the GPU cannot run ahead of (see Calibration)."""
    if not layout.activation_checkpointing:
        return 0.0
    return lora_modules(w) * cal.host_seconds_per_lora_module_recompute


def collective_seconds(nbytes: float, ranks: int, factor: float, link) -> float:
    """latency + factor · bytes / busbw, factor 2(n-1)/n for all-reduce, (n-1)/n for gather/scatter."""
    if ranks <= 1:
        return 0.0
    return link.latency_s * 2 * (ranks - 1) + factor * nbytes / link.bus_bytes_per_s


@dataclass(frozen=True)
class Collectives:
    shard_seconds: float  # all-gathers and reduce-scatters in the shard group, every micro-batch
    replica_seconds: float  # the all-reduce across replicas, once per step (last micro-batch's backward)
    shard_link: Link
    replica_link: Link


def collectives(w: Workload, layout: Layout, pool: Pool) -> Collectives:
    """Seconds of collectives per optimizer step, as the runtime issues them (FSDP2, on every strategy with
    more than one rank)."""
    inter = pool.inter_node or pool.intra_node
    # a ring over several nodes runs at its slowest hop (of equal bandwidths, the one of higher latency)
    world_link = (min(pool.intra_node, inter, key=lambda link: (link.bus_bytes_per_s, -link.latency_s))
                  if layout.nodes > 1 else pool.intra_node)
    g, replicas = layout.shard_group, layout.replicas
    shard_link = pool.intra_node if g <= pool.gpus_per_node else world_link
    trainable = w.trainable_params
    # every weight is gathered in bf16, frozen ones too, in forward and again in backward; fp32 gradients
    # are reduce-scattered
    per_micro = (2 * collective_seconds(BF16 * w.model.params, g, (g - 1) / g, shard_link)
                 + collective_seconds(FP32 * trainable, g, (g - 1) / g, shard_link))
    replica = collective_seconds(FP32 * trainable / g, replicas, 2 * (replicas - 1) / replicas, world_link)
    return Collectives(per_micro * layout.grad_accum, replica, shard_link, world_link)


def offload_seconds(w: Workload, layout: Layout, gpu: GPU) -> float:
    """Host <-> GPU copies per step: each shard copied in for forward and backward, gradients copied out."""
    if not layout.cpu_offload:
        return 0.0
    weight_bytes = (FP32 if w.method == "full" else BF16) * w.model.params + FP32 * w.trainable_params
    per_micro = (2 * weight_bytes + FP32 * w.trainable_params) / layout.shard_group
    return layout.grad_accum * per_micro / gpu.host_bytes_per_s


def estimate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Estimate:
    gpu: GPU = pool.gpu
    moment, memory = peak_memory(w, layout, cal)
    micro = layout.grad_accum
    mm = micro * matmul_flops(w, layout) / (gpu.bf16_flops * gpu.matmul_efficiency)
    mb = micro * (memory_bound_bytes(w, layout, cal) / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
                  + fixed_seconds(w, layout, cal))
    # a host-bound micro-batch leaves the GPU idle: counted as memory-bound (not matmul) time
    mb += max(0.0, micro * host_floor_seconds(w, layout, cal) - mm - mb)
    local_trainable = w.trainable_params / layout.shard_group
    if layout.cpu_offload:  # the ranks of a node share its cores and memory bandwidth
        opt = local_trainable * (layout.gpus // layout.nodes) * cal.cpu_adam_seconds_per_param
    else:
        opt = ADAMW_BYTES_PER_PARAM * local_trainable / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    compute = mm + mb
    comm = collectives(w, layout, pool)
    copies = offload_seconds(w, layout, gpu)
    # The replica all-reduce overlaps the last micro-batch's backward (about 2/3 of its compute); gathers,
    # reduce-scatters and offload copies are prefetched under the compute of the whole step.
    last_backward = (2 / 3) * compute / micro
    exposed_replica = max(0.0, comm.replica_seconds - last_backward)
    streamed = comm.shard_seconds + copies
    exposed_streamed = max(0.0, streamed - (compute - min(comm.replica_seconds, last_backward)))
    streamed_comm_part = comm.shard_seconds / streamed if streamed else 0.0
    exposed_comm = exposed_replica + exposed_streamed * streamed_comm_part
    exposed_copies = exposed_streamed * (1 - streamed_comm_part)
    total_comm = comm.shard_seconds + comm.replica_seconds
    hidden = total_comm + copies - exposed_comm - exposed_copies
    step = compute + opt + exposed_comm + exposed_copies + cal.comm_interference * hidden
    host = host_state_bytes(w, layout)
    on_link: dict[Link, tuple[float, float]] = {}  # (total, exposed) seconds per link
    for link, total, exposed in ((comm.shard_link, comm.shard_seconds, exposed_streamed * streamed_comm_part),
                                 (comm.replica_link, comm.replica_seconds, exposed_replica)):
        if total:
            before = on_link.get(link, (0.0, 0.0))
            on_link[link] = (before[0] + total, before[1] + exposed)
    bounding = max(on_link, key=lambda link: (on_link[link][1], on_link[link][0]), default=None)
    link_total, link_exposed = on_link.get(bounding, (0.0, 0.0))
    return Estimate(sum(memory.values()), memory, host, step, mm, mb, opt, total_comm, exposed_comm, copies,
                    exposed_copies, moment, bounding, link_total, link_exposed)
