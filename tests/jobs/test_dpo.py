"""DPO (`method.objective: dpo`): the preference data, the loss held to TRL's DPOTrainer as an oracle, the same
numbers however a batch is split (micro-batches, packing, ranks), and a run that learns a preference."""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.jobs.conftest import make_config, metrics
from tests.jobs.test_distributed import run_torchrun
from tunewright_jobs import tiny
from tunewright_jobs.config import ConfigError
from tunewright_jobs.data import DatasetError, read_jsonl
from tunewright_jobs.kernels import prepare as prepare_kernels
from tunewright_jobs.model import load_model, load_tokenizer
from tunewright_jobs.parallel import Dist, wrap_model
from tunewright_jobs.preference import dpo_scores, reference_copy, tokenize_pairs
from tunewright_jobs.run import train_without_ray
from tunewright_jobs.train import build_objective, prepare_data, seed_everything
from tunewright_jobs.validate import validate

CPU = Dist(0, 1, 0, torch.device("cpu"))


# --- preference data -------------------------------------------------------------------------------------


def openai_pair(prompt: list[dict], good: str, bad: str) -> dict:
    return {"input": {"messages": prompt}, "preferred_output": [{"role": "assistant", "content": good}],
            "non_preferred_output": [{"role": "assistant", "content": bad}]}


SHAPES = {
    "openai": lambda review, good, bad: openai_pair([{"role": "user", "content": review}], good, bad),
    "messages": lambda review, good, bad: {"prompt": [{"role": "system", "content": tiny.SYSTEM_PROMPT},
                                                      {"role": "user", "content": review}],
                                           "chosen": good, "rejected": bad},
    "text": lambda review, good, bad: {"prompt": f"Review: {review}\nSentiment:", "chosen": f" {good}",
                                       "rejected": f" {bad}"},
}


def sentiment_pairs(n: int, seed: int, shape: str) -> list[dict]:
    """The tiny task's reviews, the true sentiment preferred to the other one (answers of several lengths)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        review, label = tiny.make_review(rng)
        wrong = "negative" if label == "positive" else "positive"
        pairs.append(SHAPES[shape](review, rng.choice([label, f"{label}, clearly"]),
                                   rng.choice([wrong, f"{wrong} I guess", "hard to say"])))
    return pairs


def style_pairs(n: int, seed: int) -> list[dict]:
    """A style to learn: the label said in a sentence preferred to the label shouted; both shapes, alternating."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        review, label = tiny.make_review(rng)
        shape = SHAPES["openai" if i % 2 else "messages"]
        pairs.append(shape(review, f"The review is {label}.", f"{label.upper()}!!"))
    return pairs


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def dpo_config(model_dir: Path, out: Path, train: list[dict], validation: list[dict] | None = None, **overrides):
    out.mkdir(parents=True, exist_ok=True)
    dataset = {"train": str(write_jsonl(out / "train.jsonl", train)), "format": "preference",
               "validation": str(write_jsonl(out / "validation.jsonl", validation)) if validation else None}
    defaults = {"method": {"objective": "dpo"}, "dataset": dataset,
                "hyperparameters": {"seq_len": 64, "global_batch_size": 4}, "metrics": {"profile": {"enabled": False}}}
    merged = {key: {**defaults.get(key, {}), **overrides.get(key, {})} for key in {*defaults, *overrides}}
    return make_config(model_dir, out, **merged)


@pytest.mark.parametrize("shape", ["openai", "messages", "text"])
def test_both_preference_shapes_read_and_label_only_the_answers(tiny_models, tmp_path, shape):
    records = sentiment_pairs(5, seed=0, shape=shape)
    assert read_jsonl(write_jsonl(tmp_path / "pairs.jsonl", records), "preference") == records
    assert validate(tmp_path / "pairs.jsonl", "auto")["format"] == "preference"
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])  # no chat template: the fallback is given
    pairs = tokenize_pairs(tokenizer, records, seq_len=128, source="pairs.jsonl").pairs
    for record, pair in zip(records, pairs, strict=True):
        for example, key in ((pair.chosen, "chosen"), (pair.rejected, "rejected")):
            answer = record.get(key) or record[f"{'non_' if key == 'rejected' else ''}preferred_output"][0]["content"]
            labelled = tokenizer.decode([t for t, keep in zip(example.input_ids, example.trainable, strict=True) if keep])
            prompt = tokenizer.decode([t for t, keep in zip(example.input_ids, example.trainable, strict=True)
                                       if not keep])
            # the answer, closed as the model will be asked to close it: end of turn (messages) or eos (text)
            assert labelled == answer + ("<|endoftext|>" if shape == "text" else "<|im_end|>\n")
            assert "<|im_start|>assistant" in prompt if shape != "text" else prompt.startswith("Review:")


@pytest.mark.parametrize("record", [
    openai_pair([{"role": "user", "content": "ab"}], "cde", "f"),
    {"prompt": "ab", "chosen": "cde", "rejected": "f"},
    {"prompt": [{"role": "user", "content": "ab"}], "chosen": [{"role": "assistant", "content": "cde"}], "rejected": "f"},
])
def test_a_pairs_text_is_its_prompt_and_both_answers(tmp_path, record):
    """What the API sizes a job by at upload (`validate`), before any tokenizer is loaded."""
    checked = validate(write_jsonl(tmp_path / "pairs.jsonl", [record] * 2), "auto")
    assert checked == {"format": "preference", "examples": 2, "characters": 12, "longest_characters": 6}


def test_a_pair_with_the_same_answer_twice_is_dropped_and_counted(tiny_models, caplog):
    """Its loss is log 2 and its gradient zero: kept, it would only dilute the batch's mean (TRL keeps it)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    records = [{"prompt": "Review: fine.", "chosen": "good", "rejected": "bad"},
               {"prompt": "Review: fine.", "chosen": "good", "rejected": "good"}]
    data = tokenize_pairs(tokenizer, records, seq_len=128, source="pairs.jsonl")
    assert len(data.pairs) == 1 and data.dropped == 1
    assert "dropped: 0 with an answer left with no token, 1 with the same answer twice" in caplog.text
    with pytest.raises(DatasetError, match="no preference pair has two different answers"):
        tokenize_pairs(tokenizer, records[1:], seq_len=128, source="pairs.jsonl")


@pytest.mark.parametrize(("lines", "expected"), [
    ([{"prompt": "a", "chosen": "b"}], 'pairs.jsonl:1: "rejected" is missing'),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "", "rejected": "c"}],
     'pairs.jsonl:2: "chosen" must be a non-empty string'),
    ([{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}],
     'pairs.jsonl:1: "chosen" is a list of messages, which needs "prompt" as a list of messages too (or "chosen" '
     'as text)'),  # messages after a text prompt
    ([{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], "rejected": "c"}],
     "pairs.jsonl:1: chosen[0].role must be one of ['assistant']"),
    ([{"prompt": 3, "chosen": "b", "rejected": "c"}], 'pairs.jsonl:1: "prompt" must be a string or a list of messages'),
    ([openai_pair([{"role": "user", "content": "a"}], "b", "c"), {"input": {"messages": []}}],
     'pairs.jsonl:2: "input.messages" must be a non-empty list'),
    ([{**openai_pair([{"role": "user", "content": "a"}], "b", "c"), "non_preferred_output": "c"}],
     'pairs.jsonl:1: "non_preferred_output" must be a non-empty list'),
    ([{"messages": [{"role": "user", "content": "a"}]}], 'pairs.jsonl:1: a preference pair needs "input"'),
    ([{k: v for k, v in openai_pair([{"role": "user", "content": "a"}], "b", "c").items()
       if k != "non_preferred_output"}], 'pairs.jsonl:1: "non_preferred_output" is missing'),
    ([{"prompt": "a", "chosen": "b", "rejected": None}], 'pairs.jsonl:1: "rejected" must be a non-empty string'),
])
def test_bad_pairs_are_refused_naming_line_and_reason(tmp_path, lines, expected):
    path = write_jsonl(tmp_path / "pairs.jsonl", lines)
    with pytest.raises(DatasetError) as err:
        read_jsonl(path, "preference")
    assert expected in str(err.value)
    assert any(expected in line for line in validate(path, "preference")["errors"])


@pytest.mark.parametrize(("method", "dataset", "field"), [
    ({"objective": "dpo"}, {"format": "chat"}, "dataset.format: method.objective dpo trains on preference pairs"),
    ({}, {"format": "preference"}, "method.objective: preference pairs train with objective dpo"),
    ({"objective": "dpo", "dpo": {"label_smoothing": 0.5}}, {"format": "preference"}, "method.dpo.label_smoothing"),
    ({"objective": "dpo", "dpo": {"beta": 0}}, {"format": "preference"}, "method.dpo.beta"),
])
def test_the_objective_and_the_data_format_go_together(tmp_path, method, dataset, field):
    with pytest.raises(ConfigError, match=field):
        make_config(tmp_path, tmp_path, method=method, dataset=dataset)


def test_a_reference_is_where_the_weights_start(tmp_path):
    cfg = make_config(tmp_path / "base", tmp_path, method={"objective": "dpo", "dpo": {"reference": "hf://org/sft"}},
                      dataset={"format": "preference"}, model={"revision": "main"})
    assert cfg.weights_source == ("org/sft", None)
    assert make_config(tmp_path / "base", tmp_path, model={"revision": "main"}).weights_source == (
        str(tmp_path / "base"), "main")


@pytest.mark.parametrize(("strategy", "offload"), [("fsdp", False), ("single", True), ("ddp", False)])
def test_the_full_reference_is_stored_in_its_compute_dtype_however_it_is_placed(tiny_models, tmp_path, monkeypatch,
                                                                               strategy, offload):
    """Sharded or offloaded, the reference's weights reach FSDP in bf16, as the planner counts them (2 bytes a
    weight), not as the fp32 policy they were copied from."""
    import tunewright_jobs.parallel as parallel

    handed = []
    monkeypatch.setattr(parallel, "device_mesh", lambda cfg, dist: None)
    monkeypatch.setattr(parallel, "_shard_blocks", lambda model, options, dist, offload: handed.append(model) or model)
    workers = 1 if strategy == "single" else 2
    cfg = dpo_config(tiny_models["llama"], tmp_path, sentiment_pairs(4, seed=0, shape="text"),
                     method={"type": "full"}, strategy={"type": strategy, "num_workers": workers, "micro_batch_size": 1,
                                                        "cpu_offload": offload, "use_gpu": offload, "precision": "bf16"})
    model = load_model(cfg)
    placed = reference_copy(cfg, model, Dist(0, workers, 0, torch.device("cpu")))
    assert bool(handed) == (strategy == "fsdp" or offload)  # ddp: whole on each rank
    assert {p.dtype for p in placed.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not any(p.requires_grad for p in placed.parameters())


# --- the loss, against TRL's -----------------------------------------------------------------------------


class Policy:
    """What `Trainer.build_model` builds for a job, in one process on the CPU: the policy, its objective, and
    the data (the validation pairs in file order)."""

    def __init__(self, cfg):
        self.tokenizer = load_tokenizer(cfg)
        self.data = prepare_data(cfg, self.tokenizer)
        seed_everything(cfg.hyperparameters.seed)
        model = load_model(cfg)
        kernels = prepare_kernels(cfg, model, CPU.device)
        frozen = reference_copy(cfg, model, CPU)
        self.model, _ = wrap_model(cfg, model, CPU)
        self.objective = build_objective(cfg, self.model, frozen, kernels, CPU, self.tokenizer.pad_token_id)
        self.trainable = {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def moved(self, seed: int = 1) -> "Policy":
        """The trained weights moved off the reference's (LoRA's B starts at zero: the policy is the reference)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.trainable.values():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        return self

    def step(self, pairs) -> tuple[float, list[float], dict[str, torch.Tensor]]:
        """One step's forward and backward as `train.train_step` runs them over its micro-batches: the mean
        loss, the DPO statistics' means, and the gradients."""
        for p in self.trainable.values():
            p.grad = None
        inputs = self.objective.micro_batches(pairs)
        total, sums = 0.0, torch.zeros(self.objective.statistics)
        for batch in inputs.micro_batches:
            loss, statistics = self.objective.loss(batch)
            (loss / inputs.units).backward()
            total, sums = total + loss.item(), sums + statistics
        fields = self.objective.step_fields(sums.tolist(), inputs.units)
        return total / inputs.units, fields, {name: p.grad.clone() for name, p in self.trainable.items()}


def trl_record(record: dict) -> dict:
    """The pair as TRL reads it: prompt/chosen/rejected, all text or all messages (OpenAI's shape mapped by hand)."""
    if "input" in record:
        return {"prompt": record["input"]["messages"], "chosen": record["preferred_output"],
                "rejected": record["non_preferred_output"]}
    if isinstance(record["prompt"], list):
        return {**record, **{k: [{"role": "assistant", "content": record[k]}] for k in ("chosen", "rejected")}}
    return record


def trl_oracle(policy: Policy, model_dir: Path, records: list[dict], method: str, beta: float, out: Path):
    """TRL's DPOTrainer on the same pairs and weights: its own tokenization, collator, forward and loss."""
    datasets = pytest.importorskip("datasets")
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(out), beta=beta, max_length=None, per_device_train_batch_size=len(records),
                     report_to="none", bf16=False, gradient_checkpointing=False, use_cpu=True, save_strategy="no")
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=datasets.Dataset.from_list([trl_record(r) for r in records]),
                         processing_class=policy.tokenizer, peft_config=lora if method == "lora" else None)
    trl_params = dict(trainer.model.named_parameters())
    with torch.no_grad():  # the policy's weights (the reference is the base, or the model as saved)
        for name, p in policy.trainable.items():
            trl_params[name].copy_(p)
    features = [trainer.train_dataset[i] for i in range(len(records))]
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(features))
    loss.backward()
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return loss.item(), logged, {name: trl_params[name].grad for name in policy.trainable}, features


@pytest.mark.parametrize(("method", "shape", "packing"), [
    ("lora", "openai", True), ("lora", "text", False), ("full", "messages", False), ("full", "text", True),
])
def test_loss_gradients_and_rewards_are_trls(tiny_models, tmp_path, method, shape, packing):
    pytest.importorskip("trl", reason="TRL is the oracle (the dev extra installs it)")
    kind = "gpt2" if method == "lora" else "llama"
    records = sentiment_pairs(6, seed=1, shape=shape)
    cfg = dpo_config(tiny_models[kind], tmp_path, records, records, method={"type": method, "dpo": {"beta": 0.5}},
                     dataset={"packing": packing}, strategy={"micro_batch_size": 3},
                     hyperparameters={"global_batch_size": 6})
    policy = Policy(cfg).moved()
    loss, fields, grads = policy.step(policy.data.val_rows)
    trl_loss, logged, trl_grads, features = trl_oracle(policy, tiny_models[kind], records, method, 0.5, tmp_path / "trl")

    for pair, feature in zip(policy.data.val_rows, features, strict=True):  # TRL's tokens and answer masks
        for ours, answer in ((pair.chosen, feature["chosen_ids"]), (pair.rejected, feature["rejected_ids"])):
            assert ours.input_ids == feature["prompt_ids"] + answer
            assert ours.trainable == [False] * len(feature["prompt_ids"]) + [True] * len(answer)
    assert 0.1 < fields["preference_accuracy"] < 0.9 and abs(fields["reward_margin"]) > 1e-3  # not a trivial case
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(loss, trl_loss, **close)
    for ours, theirs in (("chosen_reward", "rewards/chosen"), ("rejected_reward", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("preference_accuracy", "rewards/accuracies")):
        torch.testing.assert_close(fields[ours], logged[theirs], **close)
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], **close)


def test_label_smoothing_weighs_in_the_flipped_pair():
    """Conservative DPO: a pair's loss is (1 - ls) x its sigmoid loss (TRL's, above) + ls x the loss of the
    pair with its labels flipped."""
    policy, reference = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.randn(8)
    flipped = lambda x: torch.cat(x.chunk(2)[::-1])  # noqa: E731
    smoothed = dpo_scores(policy, reference, beta=0.3, label_smoothing=0.2).losses
    plain = dpo_scores(policy, reference, beta=0.3, label_smoothing=0.0).losses
    swapped = dpo_scores(flipped(policy), flipped(reference), beta=0.3, label_smoothing=0.0).losses
    torch.testing.assert_close(smoothed, 0.8 * plain + 0.2 * swapped)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_policy_starts_from_the_reference_and_is_held_to_it(tiny_models, tmp_path, method):
    """`method.dpo.reference` (an SFT run's export, say) is what the policy starts from and what it is compared
    with: there the policy's log-probabilities are the reference's, every reward 0."""
    sft = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    with torch.no_grad():
        for p in sft.parameters():
            p.mul_(1.5)
    sft.save_pretrained(tmp_path / "sft")
    records = sentiment_pairs(4, seed=5, shape="text")
    cfg = dpo_config(tiny_models["llama"], tmp_path / "job", records, records,
                     method={"type": method, "dpo": {"reference": str(tmp_path / "sft")}})
    policy = Policy(cfg)
    base = {key.replace(".base_layer", ""): value for key, value in policy.model.state_dict().items()
            if "lora_" not in key}  # LoRA's: the weights its adapters are added to
    base = {key.removeprefix("base_model.model."): value for key, value in base.items()}
    torch.testing.assert_close(base, sft.state_dict(), rtol=0, atol=0)
    loss, fields, _ = policy.step(policy.data.val_rows)
    assert loss == pytest.approx(math.log(2)) and fields["reward_margin"] == fields["chosen_reward"] == 0


# --- however a batch is split --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["lora", "full"])
def test_micro_batches_and_packing_give_one_batchs_loss_and_gradients(tiny_models, tmp_path, method):
    """1 x 4, 2 x 2 and 4 x 1 pairs, packed or a sequence a row: the same mean loss and gradients."""
    kind = "gpt2" if method == "lora" else "llama"
    records = sentiment_pairs(4, seed=2, shape="messages")
    results = []
    for micro, packing in ((4, False), (4, True), (2, True), (1, False)):
        cfg = dpo_config(tiny_models[kind], tmp_path / f"{micro}-{packing}", records, records,
                         method={"type": method}, dataset={"packing": packing},
                         strategy={"micro_batch_size": micro})
        assert cfg.batch_plan().grad_accum == 4 // micro
        policy = Policy(cfg).moved()
        results.append(policy.step(policy.data.val_rows))
    (loss, fields, grads), *others = results
    for other_loss, other_fields, other_grads in others:
        assert other_loss == pytest.approx(loss, rel=1e-6)
        assert other_fields == pytest.approx(fields, rel=1e-6, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "kind", "strategy"), [("lora", "gpt2", "ddp"), ("full", "llama", "ddp"),
                                                         ("lora", "gpt2", "fsdp"), ("full", "llama", "fsdp")])
def test_two_ranks_compute_what_one_does(tiny_models, tmp_path, method, kind, strategy):
    """Two gloo ranks under torchrun (LoRA's reference: the adapters off, on whole or sharded weights; full
    fine-tuning's: a copy, whole on each DDP rank, sharded as the policy is under FSDP) against one process: the
    first two steps' loss, gradient norm and rewards, the evaluations, and the exported adapter or model."""
    train, validation = sentiment_pairs(16, seed=3, shape="openai"), sentiment_pairs(8, seed=4, shape="text")
    overrides = {"method": {"type": method}, "hyperparameters": {"max_steps": 2, "learning_rate": 1e-2},
                 "strategy": {"micro_batch_size": 1}, "eval": {"max_batches": None}}
    one = dpo_config(tiny_models[kind], tmp_path / "one", train, validation, **overrides)
    two = dpo_config(tiny_models[kind], tmp_path / "two", train, validation,
                     **{**overrides, "strategy": {"type": strategy, "num_workers": 2, "micro_batch_size": 1}})
    alone = train_without_ray(one)
    together = run_torchrun(two, tmp_path, 2)
    first, second = metrics(one)[0], metrics(two)[0]
    assert first.loss == pytest.approx(math.log(2), rel=1e-6)  # the policy starts as its reference
    assert second.loss == pytest.approx(first.loss, rel=1e-6)
    assert second.grad_norm == pytest.approx(first.grad_norm, rel=1e-5)
    later = metrics(one)[1], metrics(two)[1]
    for field in ("loss", "chosen_reward", "rejected_reward", "reward_margin", "preference_accuracy"):
        assert getattr(later[1], field) == pytest.approx(getattr(later[0], field), rel=1e-4, abs=1e-6), field
    for name in ("eval_before", "eval_after"):
        scores = {key: value for key, value in alone[name].items() if value is not None}  # no exact match
        assert {key: together[name][key] for key in scores} == pytest.approx(scores, rel=1e-4, abs=1e-6)
    folder = "adapter" if method == "lora" else "model"
    exported = [load_file(next(Path(run["export"][folder]).glob("*.safetensors"))) for run in (alone, together)]
    assert exported[0] and sorted(exported[1]) == sorted(exported[0])  # an adapter exported whole, not empty
    for name, tensor in exported[0].items():
        torch.testing.assert_close(exported[1][name], tensor, rtol=1e-4, atol=1e-6)


# --- a run -------------------------------------------------------------------------------------------------


def test_a_run_learns_the_preferred_style(tiny_models, tmp_path):
    """LoRA DPO on held-out pairs: from ties (the policy starts as its reference: every reward 0, no pair ranked
    right, the loss log 2) to nearly every pair ranked right; the records carry the rewards."""
    cfg = dpo_config(tiny_models["gpt2"], tmp_path, style_pairs(96, seed=0), style_pairs(32, seed=1),
                     hyperparameters={"max_steps": 8, "learning_rate": 1e-2, "global_batch_size": 8},
                     strategy={"micro_batch_size": 8},
                     eval={"max_batches": None, "exact_match": True, "exact_match_max_examples": 4,
                           "max_new_tokens": 4})
    result = train_without_ray(cfg)
    before, after = result["eval_before"], result["eval_after"]
    assert after["exact_match_examples"] == 4  # generated after the prompt, scored against the chosen answer
    exported = Path(result["export"]["adapter"])
    end_of_turn = AutoTokenizer.from_pretrained(exported).convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert before["val_loss"] == pytest.approx(math.log(2)) and before["reward_margin"] == 0
    assert before["preference_accuracy"] == 0
    assert after["preference_accuracy"] >= 0.9 and after["reward_margin"] > 1 and after["val_loss"] < 0.3
    steps = metrics(cfg)
    assert [r.step for r in steps] == list(range(1, 9))
    assert steps[-1].preference_accuracy >= 0.9 and steps[-1].loss < steps[0].loss
    for r in steps:
        assert r.reward_margin == pytest.approx(r.chosen_reward - r.rejected_reward)
    assert metrics(cfg, "start")[0].train_examples == 96


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_resumed_run_continues_exactly(tiny_models, tmp_path, method):
    """Stopped after 3 steps and resumed to 6 from its checkpoint: the same losses and rewards as 6 steps in one
    go (full fine-tuning's frozen reference is the model as it started, not as the checkpoint left it)."""
    def config(out: Path, steps: int, storage: Path):
        return dpo_config(tiny_models["llama"], out, style_pairs(48, seed=0), method={"type": method},
                          hyperparameters={"max_steps": steps, "lr_schedule": "constant", "learning_rate": 5e-3},
                          checkpoint={"storage": str(storage)})
    train_without_ray(config(tmp_path / "first", 3, tmp_path / "ckpt"))
    resumed = config(tmp_path / "resumed", 6, tmp_path / "ckpt")
    assert train_without_ray(resumed)["resumed_from_step"] == 3
    straight = config(tmp_path / "straight", 6, tmp_path / "straight-ckpt")
    train_without_ray(straight)
    for field in ("loss", "reward_margin", "preference_accuracy"):
        assert [getattr(r, field) for r in metrics(resumed)] == [getattr(r, field) for r in metrics(straight)][3:]


def test_sft_records_carry_no_preference_fields(tiny_models, tmp_path):
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 1}, eval={"max_batches": 1},
                      checkpoint={"final": False}, metrics={"profile": {"enabled": False}})
    result = train_without_ray(cfg)
    (step,) = metrics(cfg)
    assert (step.chosen_reward, step.rejected_reward, step.reward_margin, step.preference_accuracy) == (None,) * 4
    assert result["eval_after"]["preference_accuracy"] is None and result["eval_after"]["reward_margin"] is None
