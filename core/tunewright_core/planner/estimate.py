"""Memory and time of one layout of one workload: pure arithmetic, no I/O.

Memory is the allocator's peak per GPU (what `torch.cuda.max_memory_allocated` reports), in bytes, at
the higher of two moments: the start of backward (model states by strategy, docs/reference.md, "Memory", as the
runtime actually stores them; activations per micro-batch, logits and loss) and the end of backward (the
states and every gradient, the activations freed). With CPU offload the states move to host memory,
reported apart. Time per optimizer step is split into matrix-product time, memory-bound time, exposed
communication, exposed host copies and the optimizer step (the host's when offloaded). The constants that kernels decide (bytes kept or moved per
token, efficiencies) live in `Calibration`, fitted to measured runs (calibration_fit.py).

The objective changes what a micro-batch is. sft: `micro_batch` sequences, forward and backward. dpo: `micro_batch`
preference pairs, each two sequences (chosen and rejected) through the policy's forward and backward, and both
through the frozen reference's forward (no backward, nothing recomputed). The reference is LoRA's own base with
the adapters off (nothing more held: its forward's activations are freed as it goes, under no_grad), or for full
fine-tuning a frozen bf16 copy of the weights, sharded and offloaded like the policy's states; whatever of it the
reference's forward gathers (blocks, root) is taken to be freed when that forward ends, before the policy's peak.
Its terms are the sft model's, applied to the work it adds, but its logits (`DPO_LOGITS_BYTES`): the runtime takes
the policy's whole logits where sft takes the fused chunk. Two runs on one H200 (dpo_check) checked it: step time
-8.5% (LoRA) and +7.4% (full), memory fitted on the LoRA run, the full one +0.5%.

QLoRA (method qlora) keeps the blocks' linear weights in NF4 and computes on a bf16 copy of one module at a time:
bitsandbytes dequantizes a weight for each matrix product that reads it, in forward, in backward (the input's
gradient) and in the recompute; that memory-bound work (`Calibration.nf4_dequant_bytes_per_param`, fitted by
qlora_fit on a compiled Llama-8B QLoRA step on the H200) is paid per micro-batch, whatever its tokens.

Full fine-tuning with `optimizer_state` bf16 (jobs' bf16_adamw.py) holds the weights and both moments in bf16 and
the gradients in bf16: 8 bytes a parameter instead of 16, and on `single` no compute copy (the model is bf16
already). Its optimizer step on a GPU is one Triton kernel (jobs' bf16_adamw_fused.py):
`BF16_STATE_ADAMW_BYTES_PER_PARAM`, counted. Measured on the H200 (Llama-8B): the step ran in 40.5 ms where this
predicts 49.5 (the kernel nears copy bandwidth, above the fitted memory efficiency), the whole step within 2.5%.

FP8 (`precision` fp8, jobs' fp8.py) runs the blocks' linear products at the GPU's FP8 rate (at the bf16 matmul
efficiency) and adds their casts: every product's input in forward (and recompute, and dpo's
reference forward) and its output's gradient in backward (`fp8_activation_cast_bytes` an element); the weights cast in each
forward and again in backward unless a frozen base keeps its FP8 cast (LoRA on one-GPU shards: then the cast is all
it keeps of its blocks, a byte a weight where bf16 took two), and laid out again for backward either way.
Attention, the head and the adapters' products stay in the compute dtype. The activations' cast bytes are fitted
(`Calibration.fp8_activation_cast_bytes`, fp8_fit: one Llama-8B LoRA run on one H100; 5 by count, which compiled
blocks partly fuse into the work before); the rest is counted. No full fine-tune is measured yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunewright_core.planner.comm import Group, UnitBytes, UnitCompute, step_comm
from tunewright_core.planner.hardware import GPU, Link, Pool
from tunewright_core.planner.models import ModelProfile

FP8, BF16, FP32 = 1, 2, 4
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW reads param, grad, m, v (fp32) and writes param, m, v
# bf16_adamw's fused step on a GPU: reads the bf16 weight, gradient and moments, writes the weight and moments
BF16_STATE_ADAMW_BYTES_PER_PARAM = 4 * BF16 + 3 * BF16
# an FP8 cast compiled into a reduction (amax: read 2) and one pass (read 2, write 1)
FP8_CAST_BYTES = 5
NF4 = 0.52  # QLoRA's 4-bit base with double-quantized block constants (QLoRA paper), per block weight
# kernels.recompute: the share of a block's activations its compiled graph keeps when the compiler recomputes the
# elementwise work in backward. Fitted on one H200 run (Llama-1B LoRA, seq 2048, mb 8: 16.9 GiB against 22.8
# without, vs_recompute_h200_2026-12-05.json); the CPU's compiler keeps 0.68 of a LoRA Llama block's bytes
# (jobs' test_recompute.py)
RECOMPUTE_ACTIVATION_SHARE = 0.695
# LoRA's dropout on the adapters' input (the spec's default, 0.05): each adapted module keeps what it dropped, per
# element of its input. Fitted on one H200 run (Llama-1B LoRA, seq 1024, mb 8, blocks compiled: 17.9 GiB against
# 13.1 counted without it, dpo_check_h200_2026-12-04.json); the CPU's compiler keeps 1.8, and 1.0 (the mask alone)
# where it recomputes the blocks' elementwise work: the planner takes that count times the H200's over the CPU's
# without recompute (held out on one H100 run, within 0.4%; jobs' test_recompute.py holds both counts)
LORA_DROPOUT_BYTES = 1.93
LORA_DROPOUT_BYTES_RECOMPUTED = 1.0 * LORA_DROPOUT_BYTES / 1.8
# dpo's log-probabilities: jobs' preference.py takes the policy's whole logits (bf16) and widens the labelled ones
# to fp32 for the log-softmax, not the fused chunked loss (so nor its gradients made in forward): by count 2 bytes a
# token and vocabulary entry, plus 4 (8 once their gradient is made) times the labelled share. Fitted on one H200 run
# (Llama-1B LoRA, 4 pairs of 1024-token rows, answers about two thirds of each sequence: 16.2 GiB against 13.1
# counted with sft's chunk); the full fine-tune's run of the same data, held out, +0.5%
# (dpo_check_h200_2026-12-04.json)
DPO_LOGITS_BYTES = 4.26


# (method, objective, precision) where jobs' `kernels.recompute: auto` turns it on for compiled blocks: where a GPU
# measured it (bf16 LoRA sft: 26% less memory, 0.4% slower); full fine-tuning, QLoRA, dpo and fp8 keep every
# activation until measured. jobs' kernels.RECOMPUTED_BY_DEFAULT (a contract test holds them equal)
RECOMPUTED_BY_DEFAULT = frozenset({("lora", "sft", "bf16")})


@dataclass(frozen=True)
class Workload:
    model: ModelProfile
    method: str  # lora | qlora | full
    seq_len: int
    global_batch: int  # sequences per optimizer step (dpo: preference pairs)
    steps: int
    lora_rank: int = 16
    objective: str = "sft"  # sft | dpo
    optimizer_state: str = "fp32"  # fp32 | bf16 (full fine-tuning: bf16 weights and moments, no fp32 master)
    precision: str = "bf16"  # bf16 | fp8 (the blocks' linear products)
    # jobs' kernels.recompute (on: compiled blocks keep RECOMPUTE_ACTIVATION_SHARE of their activations); auto as
    # the runtime resolves it for this method, objective and precision; off for a run measured without it
    recompute: str = "off"  # auto | on | off
    lora_dropout: bool = False  # dropout on the adapters' input (LoRA and QLoRA; the spec's default is 0.05)

    @property
    def recomputes(self) -> bool:
        return self.recompute == "on" or (self.recompute == "auto" and
                                          (self.method, self.objective, self.precision) in RECOMPUTED_BY_DEFAULT)

    @property
    def bf16_state(self) -> bool:
        return self.method == "full" and self.optimizer_state == "bf16"

    @property
    def gradient_bytes(self) -> int:
        """Per trainable parameter: fp32 gradients on fp32 masters, bf16 on bf16 weights."""
        return BF16 if self.bf16_state else FP32

    @property
    def sequences_per_example(self) -> int:
        """Sequences through the model per example of the global batch: dpo's chosen and rejected answers."""
        return 2 if self.objective == "dpo" else 1

    @property
    def forward_passes(self) -> int:
        """Forward passes over a micro-batch: the policy's, and dpo's reference's."""
        return 2 if self.objective == "dpo" else 1

    @property
    def reference_copy(self) -> bool:
        """Whether dpo holds a frozen copy of the weights as its reference (full fine-tuning: LoRA's reference is
        its own base with the adapters off)."""
        return self.objective == "dpo" and self.method == "full"

    @property
    def trainable_params(self) -> int:
        return self.model.params if self.method == "full" else self.model.lora_params(self.lora_rank)

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def tokens_per_step(self) -> int:
        """Trained tokens per step: both sequences of each dpo pair."""
        return self.global_batch * self.seq_len * self.sequences_per_example


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
    checkpoint_every: int = 1  # with activation checkpointing: one block in this many (2: every other)
    reshard_after_forward: bool = True  # False: blocks stay gathered from forward to backward (one gather less)

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard_group

    def checkpointed_share(self, layers: int) -> float:
        """The share of the `layers` blocks whose activations are recomputed in backward: the runtime wraps
        the 1st, (N+1)-th, ... block, ceil(layers / N) of them."""
        return math.ceil(layers / self.checkpoint_every) / layers if self.activation_checkpointing else 0.0


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
    # each rank's step time jitters; a step waits for the slowest of n: + sync_jitter x sqrt(2 ln n) of compute
    sync_jitter: float = 0.0
    # QLoRA: HBM traffic per block weight per matrix product that dequantizes it: reads the 4-bit codes and
    # block constants, writes bf16 (2.5 bytes by count; the committed file's is qlora_fit's, measured)
    nf4_dequant_bytes_per_param: float = 2.5
    # FP8: HBM traffic per activation element a product casts (its input in forward, its output's gradient in
    # backward): 5 bytes by count (read for the largest magnitude, read again, write one byte); compiled blocks
    # fuse much of it into the work before (the committed file's is fp8_fit's, measured)
    fp8_activation_cast_bytes: float = FP8_CAST_BYTES
    # CPU offload: the card's host link rate over what FSDP2's per-block copies of offloaded shards reach (1: the
    # catalog's rate; the committed file's is offload_fit's, measured)
    host_copy_slowdown: float = 1.0


START_OF_BACKWARD, END_OF_BACKWARD = "start of backward", "end of backward"
PLACEMENT = "placement (the bf16 base whole on the GPU, before its blocks are cast to FP8)"
REFERENCE_WEIGHTS = "dpo reference weights (bf16, frozen)"
NF4_BASE = "frozen base (NF4 blocks, bf16 rest)"
FP8_BASE = "frozen base (FP8 blocks, bf16 rest)"
DEQUANTIZED = "dequantized module (bf16, one at a time)"
GRADIENTS = "gradients (fp32; bf16 on bf16 weights)"
ACCUMULATED_GRADIENTS = "accumulated gradients (fp32; bf16 on bf16 weights)"
ROOT_GATHERED = "embeddings and head, gathered (bf16)"
ROOT_GRADIENTS = "embedding and head gradients, reducing (bf16 + fp32 copy)"
LOSS_GRADIENTS = "loss's head and hidden-state gradients (bf16)"
# the terms at each moment that are not states kept through the step
BF16_BASE_PLACED = "frozen base (bf16, placed whole)"
TRANSIENT_TERMS = {START_OF_BACKWARD: ("activations", "logits and loss", LOSS_GRADIENTS),
                   END_OF_BACKWARD: (GRADIENTS, ROOT_GRADIENTS), PLACEMENT: (BF16_BASE_PLACED,)}


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
    # what the exposed communication is made of: the first gathers and last reductions of each micro-batch,
    # and the blocks whose collectives outlast the compute they run under (per micro-batch)
    exposed_ends_seconds: float = 0.0
    outlasting_forward_blocks: int = 0
    outlasting_backward_blocks: int = 0
    sync_seconds: float = 0.0  # waiting for the slowest rank

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
    if w.bf16_state:
        out = {"weights (bf16)": BF16 * psi / shard, "optimizer (AdamW m, v, bf16)": 2 * BF16 * psi / shard}
    elif w.method == "full":
        out = {"weights (fp32 master)": FP32 * psi / shard, "optimizer (AdamW m, v)": 2 * FP32 * psi / shard}
    elif w.method == "qlora":  # decoder blocks in NF4; embeddings, head and norms stay bf16
        blocks = w.model.layers * w.model.layer_linear_params
        out = {NF4_BASE: (NF4 * blocks + BF16 * (psi - blocks)) / shard,
               "adapters, grads, AdamW": 4 * FP32 * trainable / shard}
    elif keeps_fp8_copies(w, layout):  # the blocks' casts replace their bf16 weights (jobs' fp8.keep_frozen_casts)
        blocks = w.model.layers * w.model.layer_linear_params
        out = {FP8_BASE: FP8 * blocks + BF16 * (psi - blocks), "adapters, grads, AdamW": 4 * FP32 * trainable}
    else:
        out = {"frozen base (bf16)": BF16 * psi / shard, "adapters, grads, AdamW": 4 * FP32 * trainable / shard}
    if w.reference_copy:  # frozen: no gradients, no optimizer states; sharded like the policy
        out[REFERENCE_WEIGHTS] = BF16 * psi / shard
    if layout.grad_accum > 1:
        out[ACCUMULATED_GRADIENTS] = w.gradient_bytes * trainable / shard
    return out


def gathers_weights(w: Workload, layout: Layout) -> bool:
    """Whether the weights are computed on bf16 copies of them: always for full fine-tuning (fp32 masters);
    for a frozen LoRA base only when FSDP shards or offloads it (jobs' parallel.one_gpu_shards keeps a bf16
    base on one-GPU shards out of FSDP, as plain tensors, and `single` computes on it in place). bf16 weights
    (`optimizer_state` bf16) are computed on in place by `single`, as a frozen base is."""
    if w.bf16_state and layout.strategy == "single" and not layout.cpu_offload:
        return False
    return w.method == "full" or layout.shard_group > 1 or layout.cpu_offload


def host_state_bytes(w: Workload, layout: Layout) -> float:
    """Offloaded states per rank: the sharded states, and the gradients, which land on the host for the
    optimizer step whether or not micro-batches accumulate them."""
    if not layout.cpu_offload:
        return 0.0
    states = sharded_states(w, layout)
    if ACCUMULATED_GRADIENTS not in states:
        states[GRADIENTS] = w.gradient_bytes * w.trainable_params / layout.shard_group
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
    if w.method == "qlora":  # the largest matrix, dequantized for its product
        out[DEQUANTIZED] = BF16 * w.model.hidden * max(w.model.hidden, w.model.ffn)
    if gathers_weights(w, layout):
        block = w.model.layer_linear_params
        keeps_all = (layout.shard_group == 1 or not layout.reshard_after_forward) and not layout.cpu_offload
        held = w.model.layers if keeps_all else 2
        out["unsharded blocks"] = held * BF16 * block + (w.gradient_bytes * block if w.method == "full" else 0)
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
        out[GRADIENTS] = w.gradient_bytes * w.trainable_params / layout.shard_group
    if w.method == "full":  # a LoRA base's embeddings and head are frozen: no gradients
        out[ROOT_GRADIENTS] = (BF16 + FP32) * w.model.params_outside_blocks
    return out


def micro_tokens(w: Workload, layout: Layout) -> int:
    """Tokens through the policy per micro-batch: its sequences (dpo: both of each pair's)."""
    return layout.micro_batch * w.seq_len * w.sequences_per_example


def activation_bytes(w: Workload, layout: Layout, cal: Calibration) -> dict[str, float]:
    m = w.model
    tokens = micro_tokens(w, layout)
    ffn = cal.act_bytes_per_ffn * m.ffn if m.gated_mlp else 0.0  # GPT-2's MLP is folded into its per-hidden rate
    per_layer = tokens * (cal.act_bytes_per_hidden[m.family] * m.hidden + ffn)
    recomputed = w.recomputes and m.gated_mlp  # measured on Llama blocks; elsewhere the count keeps every activation
    if recomputed:
        per_layer *= RECOMPUTE_ACTIVATION_SHARE
    if w.adapters and w.lora_dropout:  # each adapted module's dropped input
        per_layer += tokens * sum(i for i, _ in m.linear_shapes) * (
            LORA_DROPOUT_BYTES_RECOMPUTED if recomputed else LORA_DROPOUT_BYTES)
    if layout.activation_checkpointing:
        # a checkpointed block keeps its input (bf16), the others all their activations; one block's alive
        # while it is recomputed
        checkpointed = m.layers * layout.checkpointed_share(m.layers)
        layers = tokens * checkpointed * BF16 * m.hidden + (m.layers - checkpointed) * per_layer + per_layer
    else:
        layers = m.layers * per_layer
    if w.objective == "dpo":  # the policy's whole logits, through the plain head: no gradient made in forward
        return {"activations": layers, "logits and loss": tokens * m.vocab * DPO_LOGITS_BYTES, LOSS_GRADIENTS: 0.0}
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
    return BF16 * micro_tokens(w, layout) * w.model.hidden + head_gradient_bytes(w)


# jobs' kernels.FUSED_LOSS_CHUNK_ELEMENTS (a contract test holds them equal): the runtime's fused output
# head and loss hold the logits of one chunk of tokens at a time, never the micro-batch's
FUSED_LOSS_CHUNK_ELEMENTS = 1 << 28


def loss_tokens(w: Workload, layout: Layout) -> int:
    """Tokens whose logits are alive at once: one chunk of the fused loss (the runtime's default for
    the models the planner profiles), or the micro-batch when it is smaller."""
    return min(micro_tokens(w, layout), max(1, FUSED_LOSS_CHUNK_ELEMENTS // w.model.vocab))


def peak_memory(w: Workload, layout: Layout, cal: Calibration) -> tuple[str, dict[str, float]]:
    """When the peak falls and its terms. Each block's backward frees its activations and adds its
    gradients, so memory moves monotonically from the start of backward (states, activations, logits) to
    its end (states, gradients) and peaks at one of the two: the first for large micro-batches, the second
    for large models on few GPUs at small ones. A base kept as FP8 casts is placed whole in bf16 first: that
    moment too (a 70B base does not fit one H200 so, though its FP8 blocks would)."""
    start = {**gpu_state_bytes(w, layout), **activation_bytes(w, layout, cal)}
    end = end_of_backward_bytes(w, layout)
    moments = [(START_OF_BACKWARD, start), (END_OF_BACKWARD, end)]
    if keeps_fp8_copies(w, layout):  # the runtime places the bf16 model, then casts its blocks (fp8.keep_frozen_casts)
        moments.append((PLACEMENT, {BF16_BASE_PLACED: BF16 * w.model.params,
                                    "adapters, grads, AdamW": 4 * FP32 * w.trainable_params}))
    return max(moments, key=lambda moment: sum(moment[1].values()))


# --- time --------------------------------------------------------------------------------------------


def matmul_flops(w: Workload, layout: Layout) -> float:
    """Hardware FLOPs of one micro-batch: forward, input gradients, weight gradients (full only), causal
    flash attention (half the square), and one more forward under activation checkpointing; dpo: of both
    sequences of each pair, and the reference's forward of both (no backward, nothing recomputed)."""
    m = w.model
    tokens = micro_tokens(w, layout)
    dense = 2 * m.matmul_params
    attention = attention_flops(w)
    forward = dense + attention
    backward = dense + 2 * attention + (dense if w.method == "full" else 6 * w.trainable_params)
    # the forward again, for the checkpointed share of the blocks (the head is not recomputed; the committed
    # calibration was fitted counting it, and refitting without it moved single runs' errors both ways)
    recompute = forward * layout.checkpointed_share(m.layers)
    flops = tokens * (forward + backward + recompute)
    if w.objective == "dpo":
        flops += tokens * forward  # the reference's (LoRA: the base, adapters off)
    return flops


def attention_flops(w: Workload) -> float:
    """Forward FLOPs per token of the blocks' attention (causal flash attention: half of 4·s·q per layer)."""
    return 2 * w.seq_len * w.model.heads * w.model.head_dim * w.model.layers


def head_flops(w: Workload, layout: Layout) -> tuple[float, float]:
    """The output head's matrix products of one micro-batch, forward (dpo: the reference's too) and backward
    (the root unit's work)."""
    forward = 2 * w.model.vocab * w.model.hidden * micro_tokens(w, layout)
    return forward * w.forward_passes, forward * (2 if w.method == "full" else 1)


def recompute_factor(layout: Layout, layers: int) -> float:
    return 1 + layout.checkpointed_share(layers) / 3  # the forward's third of the blocks' work runs twice


def memory_bound_bytes(w: Workload, layout: Layout, cal: Calibration) -> float:
    m = w.model
    tokens = micro_tokens(w, layout)
    layers = tokens * m.layers * cal.traffic_bytes_per_hidden[m.family] * m.hidden
    lora = 0.0
    if w.adapters:
        lora = tokens * m.layers * m.linear_modules_per_layer * cal.lora_traffic_bytes_per_hidden * m.hidden
    traffic = (layers + lora) * recompute_factor(layout, m.layers) + tokens * m.vocab * cal.traffic_bytes_per_vocab
    if w.objective == "dpo":
        traffic += reference_traffic_bytes(w, layout, cal)[0]
    return traffic + dequantization_bytes(w, layout, cal) + fp8_cast_bytes(w, layout, cal)


def keeps_fp8_copies(w: Workload, layout: Layout) -> bool:
    """Whether the blocks' frozen weights are kept as their FP8 casts, cast once: where they stay plain tensors on
    the GPU, not gathered by FSDP (jobs' fp8.keep_frozen_casts)."""
    return w.precision == "fp8" and w.method == "lora" and not gathers_weights(w, layout)


def fp8_linear_flops(w: Workload, layout: Layout) -> float:
    """The blocks' linear products of a micro-batch, which FP8 runs: forward, the input's gradient, the weight's
    (full), the recompute and dpo's reference forward."""
    if w.precision != "fp8":
        return 0.0
    passes = 2 + (1 if w.method == "full" else 0) + layout.checkpointed_share(w.model.layers) \
        + (1 if w.objective == "dpo" else 0)
    return micro_tokens(w, layout) * 2 * w.model.layers * w.model.layer_linear_params * passes


def fp8_cast_bytes(w: Workload, layout: Layout, cal: Calibration) -> float:
    """FP8's casts of a micro-batch (see the module's docstring)."""
    if w.precision != "fp8":
        return 0.0
    m, tokens = w.model, micro_tokens(w, layout)
    inputs = sum(i for i, _ in m.linear_shapes)
    outputs = sum(o for _, o in m.linear_shapes)
    forwards = 1 + layout.checkpointed_share(m.layers) + (1 if w.objective == "dpo" else 0)
    activations = tokens * m.layers * (inputs * forwards + outputs) * cal.fp8_activation_cast_bytes
    if w.method == "full":  # the weight's gradient lays out the saved input and the output's gradient again
        activations += tokens * m.layers * (inputs + outputs) * 2
    # backward lays each weight's cast out column by column (read 1, write 1); an uncached one is cast in each
    # forward and again in backward (by count: no run has measured it)
    casts = 0 if keeps_fp8_copies(w, layout) else FP8_CAST_BYTES * (forwards + 1)
    return activations + m.layers * m.layer_linear_params * (casts + 2)


def dequantization_passes(w: Workload, layout: Layout) -> float:
    """Matrix products per block weight per micro-batch that dequantize it (QLoRA): forward, the input's gradient,
    the recompute of checkpointed blocks, and dpo's reference forward."""
    if w.method != "qlora":
        return 0.0
    return 2 + layout.checkpointed_share(w.model.layers) + (1 if w.objective == "dpo" else 0)


def dequantization_bytes(w: Workload, layout: Layout, cal: Calibration) -> float:
    """QLoRA's dequantization traffic per micro-batch (see the module's docstring)."""
    blocks = w.model.layers * w.model.layer_linear_params
    return dequantization_passes(w, layout) * blocks * cal.nf4_dequant_bytes_per_param


def reference_traffic_bytes(w: Workload, layout: Layout, cal: Calibration) -> tuple[float, float]:
    """dpo's reference forward, memory-bound: (all of it, of it the head's). A forward is a third of the blocks'
    traffic (as `recompute_factor` counts it; no adapters) and half of the head's (as `unit_compute` splits it)."""
    m = w.model
    tokens = micro_tokens(w, layout)
    head = tokens * m.vocab * cal.traffic_bytes_per_vocab / 2
    return tokens * m.layers * cal.traffic_bytes_per_hidden[m.family] * m.hidden / 3 + head, head


def lora_modules(w: Workload) -> int:
    return w.model.layers * w.model.linear_modules_per_layer if w.adapters else 0


def fixed_seconds(w: Workload, layout: Layout, cal: Calibration) -> float:
    """Per micro-batch time that does not grow with tokens: kernel launches and latency-bound kernels (dpo: the
    reference's forward too, a third of a block's, its adapters off)."""
    seconds = (w.model.layers * cal.seconds_per_layer + lora_modules(w) * cal.seconds_per_lora_module) \
        * recompute_factor(layout, w.model.layers)
    if w.objective == "dpo":
        seconds += w.model.layers * cal.seconds_per_layer / 3
    return seconds


def host_floor_seconds(w: Workload, layout: Layout, cal: Calibration) -> float:
    """Per micro-batch host time that the GPU cannot run ahead of (see Calibration)."""
    if not layout.activation_checkpointing:
        return 0.0
    return lora_modules(w) * cal.host_seconds_per_lora_module_recompute


def groups(layout: Layout, pool: Pool) -> tuple[Group, Group]:
    """The shard group and the replica group of a layout, as the runtime's device mesh lays them out
    (replicate x shard, ranks in node order): a shard group within a node or over whole nodes; the replica
    group takes one rank of every shard group, and where it crosses nodes, the node's other GPUs' groups
    cross them at the same time."""
    g, k = layout.shard_group, layout.gpus // layout.nodes
    shard = Group(g, -(-g // k), 1)  # the nodes it spans, a partly used one included
    replicas = layout.replicas
    per_node = k // g if g <= k else 1  # one replica group's ranks on each node it spans
    spans = layout.nodes if g <= k else layout.nodes // (g // k)
    return shard, Group(replicas, spans, max(1, k // per_node) if spans > 1 else 1)


def unit_compute(w: Workload, layout: Layout, cal: Calibration, gpu: GPU) -> UnitCompute:
    """One micro-batch's compute split into what FSDP's collectives run under: each block's forward (one pass:
    dpo makes two, the reference's and the policy's) and backward (its recompute in backward), and the root's
    (embeddings, head and loss)."""
    m = w.model
    rate = gpu.bf16_flops * gpu.matmul_efficiency
    bandwidth = gpu.hbm_bytes_per_s * gpu.memory_efficiency
    tokens = micro_tokens(w, layout)
    head_forward, head_backward = head_flops(w, layout)
    blocks = matmul_flops(w, layout) - head_forward - head_backward
    block_forward_share = tokens * (2 * m.layers * m.layer_linear_params + attention_flops(w)) / blocks
    vocab_traffic = tokens * m.vocab * cal.traffic_bytes_per_vocab
    block_traffic = memory_bound_bytes(w, layout, cal) - vocab_traffic
    reference_head = 0.0
    if w.objective == "dpo":
        reference_head = reference_traffic_bytes(w, layout, cal)[1]
        block_traffic -= reference_head
    fp8 = fp8_linear_flops(w, layout)
    block_products = (blocks - fp8) / rate + (fp8 / (gpu.fp8_flops * gpu.matmul_efficiency) if fp8 else 0.0)
    blocks_seconds = (block_products + block_traffic / bandwidth + fixed_seconds(w, layout, cal)) / m.layers
    root_forward = head_forward / rate + vocab_traffic / 2 / bandwidth
    if w.objective == "dpo":
        root_forward += reference_head / bandwidth
    return UnitCompute(block_forward=blocks_seconds * block_forward_share,
                       block_backward=blocks_seconds * (1 - block_forward_share * w.forward_passes),
                       root_forward=root_forward,
                       root_backward=head_backward / rate + vocab_traffic / 2 / bandwidth)


def unit_bytes(w: Workload) -> UnitBytes:
    """Per unit: every weight gathered in bf16 (frozen ones too), trainable gradients reduced in fp32."""
    m = w.model
    root_trainable = m.params_outside_blocks if w.method == "full" else 0
    return UnitBytes(block_weights=BF16 * m.layer_linear_params,
                     block_gradients=FP32 * (w.trainable_params - root_trainable) / m.layers,
                     root_weights=BF16 * m.params_outside_blocks, root_gradients=FP32 * root_trainable)


def offload_seconds(w: Workload, layout: Layout, gpu: GPU, cal: Calibration) -> float:
    """Host <-> GPU copies per step: each block's shard copied in for forward and again for backward, the root's
    (embeddings, head) once (FSDP2 keeps it gathered to the end of backward); dpo: the reference's bf16 weights for
    its forward too (LoRA's is the policy's own base: its blocks again, its root still gathered); the gradients
    copied out. The two directions at once, each at the card's host link rate over `cal.host_copy_slowdown` (what
    FSDP2's per-block copies reach)."""
    if not layout.cpu_offload:
        return 0.0
    stored = FP32 if w.method == "full" and not w.bf16_state else BF16
    root = w.model.params_outside_blocks
    reference = (BF16 * (w.model.params - (0 if w.reference_copy else root)) if w.objective == "dpo" else 0)
    copied_in = stored * (2 * w.model.params - root) + reference
    copied_out = w.gradient_bytes * w.trainable_params
    per_micro = max(copied_in, copied_out) / layout.shard_group
    return layout.grad_accum * per_micro * cal.host_copy_slowdown / gpu.host_bytes_per_s


def estimate(w: Workload, layout: Layout, pool: Pool, cal: Calibration) -> Estimate:
    gpu: GPU = pool.gpu.on(layout.gpus)
    moment, memory = peak_memory(w, layout, cal)
    micro = layout.grad_accum
    fp8 = fp8_linear_flops(w, layout)
    mm = micro * ((matmul_flops(w, layout) - fp8) / (gpu.bf16_flops * gpu.matmul_efficiency)
                  + (fp8 / (gpu.fp8_flops * gpu.matmul_efficiency) if fp8 else 0.0))
    mb = micro * (memory_bound_bytes(w, layout, cal) / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
                  + fixed_seconds(w, layout, cal))
    # a host-bound micro-batch leaves the GPU idle: counted as memory-bound (not matmul) time
    mb += max(0.0, micro * host_floor_seconds(w, layout, cal) - mm - mb)
    local_trainable = w.trainable_params / layout.shard_group
    if layout.cpu_offload:  # the ranks of a node share its cores and memory bandwidth
        opt = local_trainable * (layout.gpus // layout.nodes) * cal.cpu_adam_seconds_per_param
    else:
        per_param = BF16_STATE_ADAMW_BYTES_PER_PARAM if w.bf16_state else ADAMW_BYTES_PER_PARAM
        opt = per_param * local_trainable / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    compute = mm + mb
    shard, replica = groups(layout, pool)
    comm = step_comm(w.model.layers, micro, unit_compute(w, layout, cal, gpu), unit_bytes(w), shard, replica, pool,
                     layout.reshard_after_forward, cal.sync_jitter, forwards=w.forward_passes)
    copies = offload_seconds(w, layout, gpu, cal)
    # FSDP2 copies a block's shard in as it gathers it: on the runs measured (offload_fit) the copies added to
    # the compute, none hidden under it
    exposed_copies = copies
    hidden = comm.total_seconds - comm.exposed_seconds
    step = compute + opt + comm.exposed_seconds + exposed_copies + cal.comm_interference * hidden + comm.sync_seconds
    host = host_state_bytes(w, layout)
    on_link: dict[Link, tuple[float, float]] = {}  # (total, exposed) seconds per link
    for link, total, exposed in ((comm.shard_link, comm.shard_seconds, comm.exposed_shard_seconds),
                                 (comm.replica_link, comm.replica_seconds, comm.exposed_replica_seconds)):
        if link is not None and total:
            before = on_link.get(link, (0.0, 0.0))
            on_link[link] = (before[0] + total, before[1] + exposed)
    bounding = max(on_link, key=lambda link: (on_link[link][1], on_link[link][0]), default=None)
    link_total, link_exposed = on_link[bounding] if bounding is not None else (0.0, 0.0)
    return Estimate(sum(memory.values()), memory, host, step, mm, mb, opt, comm.total_seconds, comm.exposed_seconds,
                    copies, exposed_copies, moment, bounding, link_total, link_exposed, comm.ends_seconds,
                    comm.outlasting_forward, comm.outlasting_backward, comm.sync_seconds)
