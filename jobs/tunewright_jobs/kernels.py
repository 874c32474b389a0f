"""The fast paths of the training step, each chosen per run with a reason, each with the plain path beside it
(the tests hold them to the same numbers):

- **fused linear + cross-entropy**: the output head and the loss, chunk by chunk of tokens, gradients made
  in the forward pass, so the [tokens, vocab] logits, their fp32 copy and their gradient never exist whole
  (for a 128k vocabulary and 16k tokens a micro-batch, about 20 GiB that a plain step holds at its peak);
- **document-bounded attention**: packed rows through FlashAttention's variable-length kernel over each
  document of a row, bounded by the packing's own offsets, instead of SDPA with a dense block mask (which
  also computes every cross-document block, and falls off SDPA's flash kernel); micro-batches whose rows
  hold one document each through causal SDPA, cuDNN's kernel first (on one H200 1.36-1.57x
  FlashAttention-2's speed on the benchmark's shapes: benchmarks/results/attention_kernels_h200.json);
- **regional torch.compile**: each decoder block's forward compiled (norms, RoPE, SwiGLU and residuals
  fused); FSDP2's hooks stay outside, so sharding is unchanged. With `kernels.recompute` the compiler is asked
  to keep fewer activations (`RECOMPUTE_MEMORY_BUDGET`): on a Llama block it then recomputes the norms and the
  gated MLP's product in backward (elementwise work, fused into backward's kernels) and keeps a third less.

CUDA-only paths fall back on the CPU; `resolve` says which path each run takes and why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tunewright_jobs.config import JobConfig
from tunewright_jobs.data import IGNORE_INDEX, Rows

log = logging.getLogger(__name__)

VARLEN = "tunewright_varlen"  # our attention's name in transformers' registry
ONE_DOCUMENT_ROWS = "tw_one_document_rows"  # the attention kwarg saying every row holds one document
# Logits held at once by the fused loss: chunk tokens x vocabulary (fp32: 1 GiB).
FUSED_LOSS_CHUNK_ELEMENTS = 1 << 28
# kernels.recompute: the activations a compiled block may keep, as a share of what it keeps by default. The
# compiler meets it with the cheapest recomputation it finds: on a Llama block the elementwise work alone,
# which brings it to ~0.68 (tests/jobs/test_recompute.py); a lower budget starts recomputing matrix products.
RECOMPUTE_MEMORY_BUDGET = 0.8
# (method, objective, precision) where kernels.recompute auto turns it on: those a GPU measured (bf16 LoRA sft: 26%
# less memory, 0.4% slower on an H200); the planner's estimate.RECOMPUTED_BY_DEFAULT (a contract test holds them equal)
RECOMPUTED_BY_DEFAULT = frozenset({("lora", "sft", "bf16")})


@dataclass(frozen=True)
class Kernels:
    """What a run uses, and why (each reason a short phrase for the log)."""

    attention: str  # an attn_implementation: VARLEN, "sdpa", "eager", "flash_attention_2"
    fused_loss: bool
    compile_blocks: bool
    reasons: tuple[str, ...] = ()
    recompute: bool = False  # the compiled blocks keep fewer activations (RECOMPUTE_MEMORY_BUDGET)

    def describe(self) -> str:
        return "; ".join(self.reasons)


def varlen_attention_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _head_blocker(lm) -> str | None:
    """Why the output head is not a plain bias-free linear layer (scaled or capped logits, a bias, an
    adapter on it), or None: the fused loss computes hidden @ weight.T and nothing else."""
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                 "lm_head_multiplier"):
        if getattr(lm.config, name, None) not in (None, 1, 1.0):
            return f"the model's {name}"
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # PEFT's lora.Linear when the head is adapted, and other kinds
        return f"the output head is a {type(head).__name__}, not a plain Linear"
    if head.bias is not None:
        return "the output head has a bias"
    return None


def _attention_blocker(lm, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Why varlen attention cannot run this model here ("needs ..." or "does not do ..."), or None."""
    config = lm.config
    if device.type != "cuda":
        return "needs CUDA"
    if not varlen_attention_available():
        return "needs torch.nn.attention.varlen (this PyTorch has none)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs an Ampere or newer GPU"
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return f"needs bf16 or fp16 compute (this run computes in {str(compute_dtype).removeprefix('torch.')})"
    if not getattr(type(lm), "_supports_attention_backend", False):
        return f"needs a model that calls transformers' attention interface ({type(lm).__name__} does not)"
    for name in ("attention_dropout", "attn_pdrop"):
        if getattr(config, name, 0.0):
            return f"does not do attention dropout ({name}={getattr(config, name)})"
    if getattr(config, "attn_logit_softcapping", None):
        return "does not do attention logit soft-capping"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "does not do sliding-window attention"
    if getattr(config, "v_head_dim", None) not in (None, getattr(config, "qk_head_dim", None)):
        return "does not do value heads of another size than the keys'"
    return None


def resolve(cfg: JobConfig, device: torch.device, lm, compute_dtype: torch.dtype) -> Kernels:
    """The paths of this run for the causal LM `lm`: each `auto` decided from the device and the model, each
    forced one checked."""
    k, reasons = cfg.kernels, []

    attention = cfg.model.attn_implementation
    if attention in ("auto", "varlen"):
        blocker = _attention_blocker(lm, device, compute_dtype)
        if blocker and attention == "varlen":
            raise ValueError(f"model.attn_implementation: varlen attention {blocker}; use auto to fall back to sdpa")
        attention = "sdpa" if blocker else VARLEN
        reasons.append(f"attention: sdpa (varlen attention {blocker})" if blocker else
                       "attention: varlen over each packed document, cuDNN's SDPA for rows of one" + (" (asked for)"
                                                                       if cfg.model.attn_implementation == "varlen"
                                                                       else ""))
    else:
        reasons.append(f"attention: {attention} (asked for)")

    # DPO weighs each sequence's log-probability by a factor known only once the whole pair is scored: the
    # fused loss's one sum over all tokens, with its gradient made in forward, cannot give it
    head = "DPO scores each sequence's log-probability" if cfg.method.objective == "dpo" else _head_blocker(lm)
    if k.fused_loss == "on" and head:
        raise ValueError(f"kernels.fused_loss: {head}; use auto to fall back to the plain loss")
    fused = k.fused_loss == "on" or (k.fused_loss == "auto" and head is None)
    reasons.append("loss: fused with the output head, in chunks" if fused
                   else f"loss: plain ({head or 'asked for'})")

    if k.compile == "on":
        compile_blocks, why = True, "compile: decoder blocks (asked for)"
    elif k.compile == "auto" and device.type == "cuda":
        compile_blocks, why = True, "compile: decoder blocks"
    else:
        compile_blocks, why = False, "compile: off" + (" (CPU: compiling costs more than it saves here)"
                                                      if k.compile == "auto" else "")
    reasons.append(why)

    if k.recompute == "on" and not compile_blocks:
        raise ValueError("kernels.recompute: the compiler recomputes the blocks' elementwise work, and this run "
                         f"does not compile them ({why}): set kernels.compile on, or recompute off")
    method = "qlora" if cfg.method.lora.quantization == "nf4" and cfg.method.type == "lora" else cfg.method.type
    # the products' precision as this run computes them: `auto` (every job config the API writes) is bf16 on a GPU
    precision = "fp8" if cfg.strategy.precision == "fp8" else "bf16" if compute_dtype == torch.bfloat16 else "fp32"
    measured = (method, cfg.method.objective, precision) in RECOMPUTED_BY_DEFAULT
    recompute = k.recompute == "on" or (k.recompute == "auto" and compile_blocks and device.type == "cuda"
                                        and measured)
    if k.recompute == "on":
        reasons.append("recompute: elementwise work in backward (asked for)")
    elif recompute:
        reasons.append("recompute: elementwise work in backward")
    else:
        reasons.append("recompute: off" + (f" (not yet measured for {method} {cfg.method.objective} in "
                                           f"{precision})" if k.recompute == "auto" and compile_blocks
                                           and not measured else ""))
    return Kernels(attention, fused, compile_blocks, tuple(reasons), recompute)


def prepare(cfg: JobConfig, model, device: torch.device) -> Kernels:
    """Decide this run's paths and switch on those that change the model before it is sharded (the
    attention it calls, the forward that fuses the head and the loss); compiling comes after sharding."""
    from tunewright_jobs.parallel import compute_dtype

    lm = causal_lm(model)
    kernels = resolve(cfg, device, lm, compute_dtype(cfg, device))
    if kernels.attention == VARLEN:
        register_varlen_attention()
        lm.config._attn_implementation = VARLEN
    if kernels.fused_loss:
        install_fused_loss(model)
    log.info("kernels: %s", kernels.describe())
    return kernels


# --- fused linear + cross-entropy --------------------------------------------------------------------


def _chunk_loss_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor, vocab: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk and d(loss)/d(logits), in fp32 arithmetic, the gradient in the
    logits' dtype. Rows labelled IGNORE_INDEX count for nothing; columns from `vocab` on are padding (no
    token: they get no probability and no gradient).

    The gradient, softmax - one-hot, is one elementwise expression of the logits and their log-sum-exp (no
    in-place scatter), which the compiler fuses into the pass that writes it, with no fp32 copy of the chunk
    (the scatter needed an fp32 softmax to write into and an fp32 masked copy; benchmarks/fused_loss_kernels.py:
    GPT-2's head and loss 20.7 -> 15.4 ms on one H200)."""
    dtype, logits = logits.dtype, logits.float()
    column = torch.arange(logits.shape[-1], device=logits.device)
    if logits.shape[-1] > vocab:
        logits = torch.where(column < vocab, logits, float("-inf"))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(-1, target[:, None]).squeeze(-1)) * valid).sum()
    one_hot = (column[None, :] == target[:, None]).to(logits.dtype)
    grad = (torch.exp(logits - lse[:, None]) - one_hot) * valid[:, None]
    return loss, grad.to(dtype)


_compiled_chunk = None


def _chunk_fn(device: torch.device):
    """The chunk arithmetic, compiled into fused kernels on CUDA (eager on the CPU). Static shapes: a run's
    chunks come in two sizes at most (whole chunks and the micro-batch's remainder), each compiled once."""
    global _compiled_chunk
    if device.type != "cuda":
        return _chunk_loss_and_logit_grad
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_logit_grad, dynamic=False)
    return _compiled_chunk


# Matmuls whose vocabulary side is not a multiple of this fall off the fast kernels (GPT-2's 50257 ran on
# alignment-1 kernels at a fraction of the speed): the head is padded with zero rows that no token uses.
VOCAB_ALIGNMENT = 64


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T, labels), its gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        chunk_fn = _chunk_fn(hidden.device)
        vocab = weight.shape[0]
        padded = F.pad(weight, (0, 0, 0, -vocab % VOCAB_ALIGNMENT)) if vocab % VOCAB_ALIGNMENT else weight
        grad_hidden = torch.empty_like(hidden)
        # in the weight's dtype, accumulated in place: the matmul sums in fp32 and rounds once per chunk
        grad_weight = torch.zeros_like(padded) if weight.requires_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            loss_c, grad_logits = chunk_fn(h @ padded.t(), labels[start:start + chunk], vocab)
            loss += loss_c
            torch.mm(grad_logits, padded, out=grad_hidden[start:start + chunk])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h)
        if grad_weight is not None:
            grad_weight = grad_weight[:vocab]
        ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.weight_grad = grad_weight is not None
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_w = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.weight_grad else None
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_w, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed token cross-entropy of `hidden` [N, h] through the head `weight` [V, h] against `labels` [N]."""
    chunk = chunk_tokens or max(256, FUSED_LOSS_CHUNK_ELEMENTS // weight.shape[0])
    return _FusedLinearCrossEntropy.apply(hidden, weight.to(hidden.dtype), labels, chunk)


def plain_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def causal_lm(model):
    """The Hugging Face causal LM inside PEFT's wrappers (the module whose forward holds the head)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_fused_loss(model) -> None:
    """Give the causal LM a forward that, when labels are passed, returns the summed loss through the fused
    head instead of logits (without labels it is the model's own forward: evaluation and generation).

    It runs inside the model's forward, so under FSDP2 the head's weight is the gathered one there, and its
    gradient flows back into FSDP's reduce-scatter as any parameter's does."""
    lm = causal_lm(model)
    original = lm.forward
    decoder = getattr(lm, lm.base_model_prefix)
    head = lm.get_output_embeddings()

    def forward(self, *args, labels=None, **kwargs):
        if labels is None:
            return original(*args, **kwargs)
        if args or kwargs.get("attention_mask") is not None:  # the training step passes neither
            raise TypeError("the fused loss takes input_ids and position_ids by name, and no attention_mask")
        inputs = {name: kwargs[name] for name in ("input_ids", "position_ids") if kwargs.get(name) is not None}
        passed = {name: value for name, value in kwargs.items() if name in VARLEN_KWARGS}
        hidden = decoder(**inputs, use_cache=False, **passed).last_hidden_state
        return fused_linear_cross_entropy(hidden.flatten(0, 1), head.weight, labels.flatten())

    lm.forward = types.MethodType(forward, lm)


def loss_sum(model, batch: dict[str, torch.Tensor], kernels: Kernels) -> torch.Tensor:
    """The summed token loss of one micro-batch, through whichever paths the run uses."""
    extra = {name: batch[name] for name in VARLEN_KWARGS if name in batch}
    if kernels.fused_loss:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     **extra)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **extra).logits
    return plain_cross_entropy(logits, batch["labels"])


# --- variable-length attention -----------------------------------------------------------------------

VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", ONE_DOCUMENT_ROWS)


def document_offsets(position_ids: np.ndarray) -> np.ndarray:
    """Where each document starts in the flattened [rows x seq_len] micro-batch, and its end: the
    cumulative offsets FlashAttention's varlen kernels take. A document starts where its positions restart
    at 0 (every row starts one; a padded tail is a document of its own that nothing real attends to)."""
    flat = position_ids.reshape(-1)
    return np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)


# Causal SDPA over whole rows computes the padding's attention too; on one H200 cuDNN's kernel is 1.36-1.57x
# FlashAttention-2's, so it pays while the documents' own attention work is at least this share of the rows'.
ONE_DOCUMENT_MIN_WORK = 0.7


def one_document_rows(position_ids: np.ndarray, real_tokens: np.ndarray) -> bool:
    """Whether each row's real tokens are one document from the row's start (any padding after it), and
    the padding so short that attending over whole rows is the faster: then plain causal attention over the
    row is exact for every real token, which attends only to its own document's earlier tokens; the
    padding's outputs carry no loss, so no gradient."""
    rows, seq_len = position_ids.shape
    real = np.arange(seq_len)[None, :] < real_tokens[:, None]
    one_document = not bool(((position_ids != np.arange(seq_len)[None, :]) & real).any())
    return one_document and float((real_tokens.astype(np.float64) ** 2).sum()) >= ONE_DOCUMENT_MIN_WORK * rows * seq_len**2


def copy_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for it: to a GPU through pinned memory, so that the copy is
    queued behind the previous step's kernels instead of waiting for them (from pageable memory it waits,
    and the host could never run ahead into the next step)."""
    tensor = torch.as_tensor(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device(batch: Rows, device: torch.device, kernels: Kernels) -> dict[str, torch.Tensor]:
    """A micro-batch's tensors on the device, with the packing's document offsets for varlen attention (and
    whether its rows hold one document each)."""
    tensors = {name: copy_to_device(getattr(batch, name), device) for name in ("input_ids", "labels", "position_ids")}
    return tensors | (varlen_inputs(batch.position_ids, batch.real_tokens, device) if kernels.attention == VARLEN
                      else {})


def varlen_inputs(position_ids: np.ndarray, real_tokens: np.ndarray, device: torch.device) -> dict:
    offsets = copy_to_device(document_offsets(position_ids), device)
    # The longest a document can be (not the batch's longest): one value, so compiled code never re-specializes.
    longest = int(position_ids.shape[1])
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest,
            ONE_DOCUMENT_ROWS: one_document_rows(position_ids, real_tokens)}


def _takes_grouped_heads(varlen_attn, causal: dict) -> bool:
    """Whether this varlen_attn passes fewer key/value heads than query heads to FlashAttention's kernel,
    which reads each shared head in place (torch 2.11's takes no enable_gqa but checks nothing): tried
    once on a tiny input against the heads repeated."""
    try:
        offsets = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
        q = torch.randn(8, 4, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        grouped = varlen_attn(q, k, v, offsets, offsets, 8, 8, **causal)
        repeated = varlen_attn(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), offsets, offsets,
                               8, 8, **causal)
    except (RuntimeError, ValueError):
        return False
    return bool(torch.allclose(grouped, repeated))


def _varlen_call():
    """torch's varlen_attn with causal masking and GQA, whatever its version calls them (2.10: is_causal;
    later: window_size; enable_gqa where it exists, or the grouped heads as they are where the kernel takes
    them; else the key/value heads are repeated: copies, and their gradients summed back)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {} if _takes_grouped_heads(varlen_attn, causal) else None

    def call(q, k, v, offsets, longest, scale):
        if q.shape[1] != k.shape[1]:
            if gqa is not None:
                return varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale, **gqa, **causal)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, offsets, offsets, longest, longest, scale=scale, **causal)

    return call


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [b, heads, s, d] -> output [b, s, heads, d], each packed
    document attending causally to itself only (offsets from `varlen_inputs`)."""
    offsets = kwargs.get("cu_seq_lens_q")
    if offsets is None:
        raise RuntimeError("varlen attention was called without the packing's offsets (cu_seq_lens_q): "
                           "evaluation and generation run under for_evaluation()")
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or dropout:
        raise RuntimeError(f"varlen attention cannot apply {', '.join(unsupported) or 'attention dropout'}: "
                           "set model.attn_implementation to sdpa")
    b, heads, s, d = query.shape
    if kwargs.get(ONE_DOCUMENT_ROWS):
        with sdpa_kernel(ONE_DOCUMENT_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                 enable_gqa=key.shape[1] != heads)
        return out.transpose(1, 2), None
    flat = lambda x: x.transpose(1, 2).reshape(b * s, x.shape[1], d)  # noqa: E731
    out = _VARLEN_CALL[0](flat(query), flat(key), flat(value), offsets, kwargs["max_length_q"], scaling)
    return out.view(b, s, heads, d), None


# cuDNN's fused attention first (the fastest on Hopper), FlashAttention-2 where cuDNN cannot take the shape,
# then the rest (the CPU's math kernel)
ONE_DOCUMENT_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH]
_VARLEN_CALL: list = []  # the kernel's call, made once (the CPU tests put a reference implementation here)


def register_varlen_attention() -> None:
    """Make VARLEN an attn_implementation transformers accepts (it builds no mask for it)."""
    from transformers import AttentionInterface

    if not _VARLEN_CALL:
        _VARLEN_CALL.append(_varlen_call())
    AttentionInterface.register(VARLEN, varlen_attention)


@contextlib.contextmanager
def for_evaluation(model):
    """Evaluation and generation on the plain paths: SDPA with the masks transformers builds (they pass no
    packing offsets, and may pad) and the blocks in eager (a growing KV cache would recompile them)."""
    config = causal_lm(model).config
    used = config._attn_implementation
    config._attn_implementation = "sdpa" if used == VARLEN else used
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        config._attn_implementation = used


# --- regional compile --------------------------------------------------------------------------------


def compile_blocks(blocks: list[torch.nn.Module], recompute: bool = False) -> None:
    """Each decoder block's forward compiled in place: parameter names, state dicts and FSDP2's hooks (which
    run around forward, in eager) stay as they are. One graph serves every block of the same shape. With
    `recompute`, the blocks keep fewer activations (for this process: the compiler reads it as it compiles)."""
    import torch._dynamo
    import torch._functorch.config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if recompute:
        torch._functorch.config.activation_memory_budget = RECOMPUTE_MEMORY_BUDGET
    for block in blocks:
        block.forward = torch.compile(block.forward)
