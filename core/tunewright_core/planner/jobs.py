"""Plan a FineTuneJob: spec → workload → the JobPlan its runtime config is built from."""

from __future__ import annotations

import math
from dataclasses import replace

from tunewright_core.planner.calibration import evidence as committed_evidence
from tunewright_core.planner.estimate import NF4_BASE, Calibration, Workload
from tunewright_core.planner.hardware import Pool
from tunewright_core.planner.models import ModelProfile
from tunewright_core.planner.search import NoPlan, plan
from tunewright_core.spec import FineTuneJobSpec, HyperparametersSpec, JobPlan

JSONL_BYTES_PER_TOKEN = 4


def dataset_tokens_of(jsonl_bytes: int) -> int:
    """Tokens in a JSONL dataset, estimated from its size until a run counts them."""
    return max(1, jsonl_bytes // JSONL_BYTES_PER_TOKEN)


# Text to tokens, before any tokenizer is loaded: English through a BPE vocabulary is about 4 characters a
# token, and a chat template adds role markers and turn ends (a few tokens a message).
CHARACTERS_PER_TOKEN = 4
TEMPLATE_TOKENS_PER_EXAMPLE = 16
SHORTEST_SEQ_LEN = 128


def sized_for_data(spec: FineTuneJobSpec, *, examples: int, characters: int, longest_characters: int,
                   max_positions: int = 0) -> tuple[FineTuneJobSpec, str | None]:
    """The spec with the sizes it leaves to tunewright chosen from its data, and what was chosen (None: nothing).

    seqLen: the smallest power of two (from 128, up to the default and the model's positions) that holds the
    longest example, so none is cut off and a small dataset still packs into enough sequences. The global
    batch: at most the sequences one epoch makes (dpo: the preference pairs it holds). Sizes the spec sets are
    kept; when even the most tokens the text could be (one a character) cannot fill one batch (dpo: when the
    pairs cannot), ValueError names the field and what would fit."""
    hp = spec.hyperparameters
    seq_len, chosen = hp.seq_len, []
    if "seq_len" not in hp.model_fields_set and hp.global_batch_tokens is None:  # tokens: seqLen divides it
        longest = longest_characters // CHARACTERS_PER_TOKEN + TEMPLATE_TOKENS_PER_EXAMPLE
        cap = min(hp.seq_len, max_positions or hp.seq_len)
        seq_len = min(cap, max(SHORTEST_SEQ_LEN, 1 << max(0, longest - 1).bit_length()))
        if seq_len != hp.seq_len:
            chosen.append(f"seqLen {seq_len} (the longest example is about {longest} tokens)")
    if spec.method.objective == "dpo":
        return _pairs_sized(spec, hp, seq_len, chosen, examples)
    tokens = characters // CHARACTERS_PER_TOKEN + TEMPLATE_TOKENS_PER_EXAMPLE * examples
    sequences = max(1, tokens // seq_len)  # one epoch, packed (about)
    batch_set = hp.global_batch_size is not None or hp.global_batch_tokens is not None
    if not batch_set and sequences < hp.sequences_per_step:
        batch = 1 << (sequences.bit_length() - 1)  # a power of two: it splits into micro-batches
        chosen.append(f"globalBatchSize {batch} (one epoch makes about {sequences} sequences of {seq_len} tokens)")
        hp = hp.model_copy(update={"global_batch_size": batch})
    at_most = (characters + TEMPLATE_TOKENS_PER_EXAMPLE * examples) // seq_len
    if batch_set and at_most < hp.sequences_per_step:
        if hp.global_batch_size is not None:
            field, limit, asked = "globalBatchSize", f"{at_most} sequences", hp.global_batch_size
        else:  # in tokens: the limit too (whole sequences of seqLen)
            field, limit, asked = "globalBatchTokens", f"{at_most * seq_len} tokens", hp.global_batch_tokens or 0
        raise ValueError(
            f"hyperparameters.{field}: at most {limit} a step, not {asked}; one epoch ({examples} examples) holds "
            f"about {sequences} sequences of {seq_len} tokens. Lower {field} or seqLen, or leave both out and "
            "tunewright sizes them from the data")
    if not chosen:
        return spec, None
    sized = spec.model_copy(update={"hyperparameters": hp.model_copy(update={"seq_len": seq_len})})
    return sized, "sized from the data: " + "; ".join(chosen)


def _pairs_sized(spec: FineTuneJobSpec, hp: HyperparametersSpec, seq_len: int, chosen: list[str],
                 pairs: int) -> tuple[FineTuneJobSpec, str | None]:
    """sized_for_data's global batch for dpo: it counts preference pairs, and one epoch holds one per example."""
    batch_set = hp.global_batch_size is not None or hp.global_batch_tokens is not None
    if not batch_set and pairs < hp.sequences_per_step:
        batch = 1 << (pairs.bit_length() - 1)  # a power of two: it splits into micro-batches
        chosen.append(f"globalBatchSize {batch} (one epoch holds {pairs} preference pairs)")
        hp = hp.model_copy(update={"global_batch_size": batch})
    if batch_set and pairs < hp.sequences_per_step:
        field = "globalBatchSize" if hp.global_batch_size is not None else "globalBatchTokens"
        raise ValueError(f"hyperparameters.{field}: at most {pairs} preference pairs a step, not "
                         f"{hp.sequences_per_step}; one epoch holds {pairs} pairs. Lower {field}, or leave it out "
                         "and tunewright sizes it from the data")
    if not chosen:
        return spec, None
    sized = spec.model_copy(update={"hyperparameters": hp.model_copy(update={"seq_len": seq_len})})
    return sized, "sized from the data: " + "; ".join(chosen)


def check_fits_model(spec: FineTuneJobSpec, profile: ModelProfile) -> None:
    """Sizes that follow from the model: ValueError naming the field when the spec asks for more."""
    hp = spec.hyperparameters
    if profile.max_positions and hp.seq_len > profile.max_positions:
        raise ValueError(f"hyperparameters.seqLen: {hp.seq_len} is more than the {profile.max_positions} positions "
                         f"{profile.name} has (learned position embeddings)")
    if spec.method.type == "lora" and spec.method.lora.r > profile.hidden:
        raise ValueError(f"method.lora.r: a rank of {spec.method.lora.r} is more than {profile.name}'s hidden size "
                         f"({profile.hidden}): the adapters would be larger than the weights they adapt")
    if spec.method.type == "lora" and (names := profile.linear_module_names):
        # a dotted target is a path PEFT matches by suffix: only the runtime, holding the model, can check it
        unmatched = [t for t in spec.method.lora.target_modules if t != "all-linear" and "." not in t
                     and t not in names]
        if unmatched:
            raise ValueError(f"method.lora.targetModules: {', '.join(unmatched)} match no module of {profile.name} "
                             f"({profile.model_type}); its linear modules are {', '.join(sorted(names))}, "
                             "or all-linear for every one")


def workload(spec: FineTuneJobSpec, profile: ModelProfile, dataset_tokens: int | None) -> Workload:
    check_fits_model(spec, profile)
    hp = spec.hyperparameters
    batch = hp.sequences_per_step
    if hp.max_steps is not None:
        steps = hp.max_steps
    elif dataset_tokens is None:
        raise ValueError("hyperparameters.maxSteps: needed when the dataset's size is unknown")
    elif spec.method.objective == "dpo":  # a pair's two sequences each hold its prompt and one answer
        steps = max(1, hp.epochs * math.ceil(dataset_tokens / (batch * hp.seq_len * 2)))
    else:
        steps = max(1, hp.epochs * math.ceil(dataset_tokens / (batch * hp.seq_len)))
    quantized = spec.method.type == "lora" and spec.method.lora.quantization == "nf4"
    light = spec.method.type == "full" and hp.optimizer_state == "bf16"
    return Workload(profile, "qlora" if quantized else spec.method.type, hp.seq_len, batch, steps,
                    lora_rank=spec.method.lora.r, objective=spec.method.objective,
                    optimizer_state="bf16" if light else "fp32", precision=spec.resources.precision,
                    recompute="auto",  # the runtime's default: the job spec does not set its kernels
                    # dpo runs without dropout (preference.disable_dropout, as TRL's default)
                    lora_dropout=spec.method.type == "lora" and spec.method.lora.dropout > 0
                    and spec.method.objective == "sft")


def as_planned(w: Workload, plan: JobPlan) -> Workload:
    """The workload a plan runs: `auto` settings resolved as the plan resolved them."""
    method = "qlora" if plan.quantization == "nf4" else w.method
    return replace(w, method=method, optimizer_state=plan.optimizer_state, precision=plan.precision)


def lighter(spec: FineTuneJobSpec, w: Workload) -> Workload | None:
    """The lighter workload an `auto` setting allows (a 4-bit LoRA base, unless its products are FP8, which casts
    bf16 weights; bf16 weights and moments for full fine-tuning), or None where the spec allows none."""
    if spec.method.type == "lora" and spec.method.lora.quantization == "auto" and w.precision != "fp8":
        return replace(w, method="qlora")
    if spec.method.type == "full" and spec.hyperparameters.optimizer_state == "auto":
        return replace(w, optimizer_state="bf16")
    return None


def plan_job(spec: FineTuneJobSpec, pool: Pool, calibration: Calibration, profile: ModelProfile,
             dataset_tokens: int | None = None) -> JobPlan:
    """The plan by the spec's objective (a budget, a deadline, else the cheapest). Where an `auto` setting allows
    a lighter workload (method.lora.quantization, hyperparameters.optimizerState), the usual one unless its plan
    needs CPU offload (or none fits) and the lighter one fits without: its quality cost is paid only where it
    saves the offload, and the explanation says what it trades."""
    res = spec.resources
    objective = ("fastest-within-budget" if res.budget_usd is not None
                 else "cheapest-within-deadline" if res.deadline_seconds is not None else "cheapest")

    def planned(w: Workload) -> JobPlan:
        made = plan(w, pool, calibration, objective=objective, strategy=res.strategy, max_gpus=res.max_gpus,
                    budget_usd=res.budget_usd, deadline_seconds=res.deadline_seconds, evidence=committed_evidence())
        return made.model_copy(update={"quantization": "nf4" if w.method == "qlora" else "none",
                                       "optimizer_state": w.optimizer_state})

    w = workload(spec, profile, dataset_tokens)
    light = lighter(spec, w)
    if light is None:
        return planned(w)
    usual, refused = None, ""
    try:
        usual = planned(w)
    except NoPlan as err:
        refused = str(err)
    if usual is not None and not usual.cpu_offload:
        return usual
    what = "a 4-bit (nf4) base" if light.method == "qlora" else "bf16 weights and moments"
    try:
        lighter_plan = planned(light)
    except NoPlan as err:
        if usual is None:
            raise NoPlan(f"{refused}; with {what}: {err}") from None
        return usual.model_copy(update={"explanation": f"{usual.explanation} auto kept the usual precision, as "
                                                       f"{what} fits no better: {err}"})
    if lighter_plan.cpu_offload and usual is not None:  # its quality cost would buy no offload saved
        return usual.model_copy(update={"explanation": f"{usual.explanation} auto kept the usual precision: "
                                                       f"{what} would need CPU offload too."})
    return lighter_plan.model_copy(update={"explanation": f"{lighter_plan.explanation} "
                                                          f"{trade(usual, lighter_plan, refused)}"})


def trade(usual: JobPlan | None, light: JobPlan, refused: str = "") -> str:
    """Why auto chose the lighter workload: what the usual one would need (or why it had no plan: `refused`),
    against what the lighter costs."""
    assert light.predicted is not None, "planned on a GPU pool"
    nf4 = light.quantization == "nf4"
    precision = "a bf16 base fits" if nf4 else "fp32 master weights fit"
    if usual is None or usual.predicted is None:
        instead = f"{'a bf16 base' if nf4 else 'fp32 master weights'} had no plan ({refused})"
        if light.cpu_offload:
            instead += f"; {'the 4-bit base' if nf4 else 'bf16 state'} fits only with CPU offload too"
    else:
        instead = (f"{precision} only with CPU offload ({usual.gpus} GPU{'s' if usual.gpus != 1 else ''}, "
                   f"step {usual.predicted.step_seconds:.2f} s, {usual.predicted.host_memory_gib_per_node:.0f} GiB "
                   f"of host memory per node, ${usual.predicted.cost_usd:,.2f})")
    step = light.predicted.step_seconds
    if nf4:
        base = light.predicted.memory_breakdown_gib.get(NF4_BASE, 0.0)
        return (f"quantization auto chose nf4 (QLoRA): {instead}; the 4-bit base takes {base:.1f} GiB and a "
                f"{step:.2f} s step, its weights dequantized in every pass, and costs a little quality: the "
                "adapters learn on weights rounded to 4 bits (set method.lora.quantization none to keep bf16).")
    return (f"optimizerState auto chose bf16: {instead}; bf16 weights and AdamW moments, updated with stochastic "
            f"rounding, hold 8 bytes a parameter instead of 16, at a {step:.2f} s step, and cost a little quality "
            "(set hyperparameters.optimizerState fp32 to keep fp32 masters).")
