"""A chat fine-tune stops at the end of its answer: the end-of-turn token it was trained to emit is one
token, and the exported tokenizer and generation config (and the evaluation's generation) stop at it."""

import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from tests.jobs.conftest import make_config
from tunewright_jobs.data import (
    FALLBACK_CHAT_TEMPLATE_EOS_TURNS,
    end_of_turn_id,
    read_jsonl,
    stop_token_ids,
    tokenize_dataset,
    tokenize_record,
)
from tunewright_jobs.evaluate import greedy_answers
from tunewright_jobs.export import export_final
from tunewright_jobs.model import load_model, load_tokenizer
from tunewright_jobs.parallel import Dist
from tunewright_jobs.run import train_without_ray
from tunewright_jobs.tiny import DATA_DIR

MAX_NEW_TOKENS = 40
CPU = Dist(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def chat_export(tiny_models, tmp_path_factory) -> dict:
    """A tiny chat LoRA run (GPT-2 tokenizer, ChatML fallback), long enough to answer then emit <|im_end|>."""
    cfg = make_config(tiny_models["gpt2"], tmp_path_factory.mktemp("chat-lora"),
                      hyperparameters={"max_steps": 40}, checkpoint={"export_merged": True})
    return train_without_ray(cfg)["export"]


@pytest.fixture(scope="module")
def prompts() -> list[list[dict]]:
    """The first validation conversations, up to the assistant's answer."""
    return [r["messages"][:-1] for r in read_jsonl(DATA_DIR / "validation.jsonl", "chat")[:3]]


def token_id(tokenizer, token: str) -> int:
    (only,) = tokenizer(token, add_special_tokens=False)["input_ids"]  # fails where `token` is split
    return only


def load_adapter_with_its_generation_config(export, tiny_models):
    model = AutoPeftModelForCausalLM.from_pretrained(export["adapter"])
    return model, {"generation_config": GenerationConfig.from_pretrained(export["adapter"],
                                                                         max_new_tokens=MAX_NEW_TOKENS)}


def load_adapter_stopping_at_tokenizer_eos(export, tiny_models):
    base = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])
    model = PeftModel.from_pretrained(base, export["adapter"])
    tokenizer = AutoTokenizer.from_pretrained(export["adapter"])
    return model, {"eos_token_id": tokenizer.eos_token_id, "max_new_tokens": MAX_NEW_TOKENS}


def load_merged(export, tiny_models):
    return AutoModelForCausalLM.from_pretrained(export["merged"]), {"max_new_tokens": MAX_NEW_TOKENS}


@pytest.mark.parametrize("load", [load_adapter_with_its_generation_config,
                                  load_adapter_stopping_at_tokenizer_eos, load_merged])
def test_exported_chat_model_stops_after_one_answer(chat_export, tiny_models, prompts, load):
    model, generate_args = load(chat_export, tiny_models)
    tokenizer = AutoTokenizer.from_pretrained(chat_export["merged" if load is load_merged else "adapter"])
    im_end = token_id(tokenizer, "<|im_end|>")
    for messages in prompts:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            output = model.eval().generate(**inputs, do_sample=False, **generate_args)
        new = output[0, inputs["input_ids"].shape[1]:].tolist()
        text = tokenizer.decode(new)
        assert len(new) < MAX_NEW_TOKENS and new[-1] == im_end, text
        assert new.count(im_end) == 1 and "<|im_start|>" not in text, text
        assert text.removesuffix("<|im_end|>").strip(), text  # an answer came before the stop


def test_exported_generation_config_and_tokenizer_stop_at_end_of_turn(chat_export, tiny_models):
    base = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    im_end, eos = token_id(base, "<|im_end|>"), base.eos_token_id
    assert im_end != eos
    for folder in (chat_export["adapter"], chat_export["merged"]):
        saved = json.loads((Path(folder) / "generation_config.json").read_text())
        assert saved["eos_token_id"] == [im_end, eos]
        assert not saved.get("_from_model_config")  # else transformers 4.x rebuilds it from config.json
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert (tokenizer.eos_token, tokenizer.pad_token_id) == ("<|im_end|>", base.pad_token_id)
        assert tokenizer.chat_template


@pytest.mark.parametrize("kind", ["gpt2", "llama"])  # the ChatML fallback; a template of the tokenizer's own
@pytest.mark.parametrize("method", ["lora", "full"])
def test_export_lists_end_of_turn_and_eos_in_generation_config(tiny_models, tmp_path, kind, method):
    cfg = make_config(tiny_models[kind], tmp_path, method={"type": method})
    tokenizer = load_tokenizer(cfg)
    # Tokenizing chat data installs the fallback template where needed, as in training.
    tokenize_dataset(tokenizer, read_jsonl(cfg.dataset.train, "chat")[:4], "chat", 128, "train")
    exported = export_final(cfg, load_model(cfg), tokenizer, CPU)
    folder = Path(exported.adapter or exported.model)
    eos_ids = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert eos_ids == [token_id(tokenizer, "<|im_end|>"), tokenizer.eos_token_id]
    assert tokenizer.eos_token == "<|endoftext|>"  # the export's copy changed, not the training tokenizer


def test_evaluation_cuts_answers_where_generate_stops(chat_export, tiny_models, prompts):
    model, generate_args = load_adapter_with_its_generation_config(chat_export, tiny_models)
    tokenizer = AutoTokenizer.from_pretrained(chat_export["adapter"])
    rendered = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    stop_ids = generate_args["generation_config"].eos_token_id
    answers = greedy_answers(model.eval(), tokenizer, rendered, MAX_NEW_TOKENS, CPU.device, stop_ids)
    for text, answer in zip(rendered, answers, strict=True):
        inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, do_sample=False, **generate_args)
        generated = output[0, inputs["input_ids"].shape[1]:]
        assert answer == tokenizer.decode(generated, skip_special_tokens=True).strip()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_stop_tokens_are_end_of_turn_then_eos(tiny_models, kind):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[kind])
    tokenize_dataset(tokenizer, read_jsonl(DATA_DIR / "train.jsonl", "chat")[:4], "chat", 128, "train")
    im_end, eos = token_id(tokenizer, "<|im_end|>"), tokenizer.eos_token_id
    assert end_of_turn_id(tokenizer) == im_end
    assert stop_token_ids(tokenizer, "chat", model_eos=[eos, 7]) == [im_end, eos, 7]
    assert stop_token_ids(tokenizer, "prompt_completion", model_eos=eos) == [eos]


def gpt2_like_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE whose only special token is <|endoftext|>: <|im_end|> splits into ordinary tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The soup was cold.", "negative", "positive"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_fallback_closes_turns_with_eos_where_im_end_is_not_one_token():
    tokenizer = gpt2_like_tokenizer()
    assert len(tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1
    record = {"messages": [{"role": "user", "content": "The soup was cold."},
                           {"role": "assistant", "content": "negative"}]}
    tokenize_dataset(tokenizer, [record], "chat", 128, "train")
    assert tokenizer.chat_template == FALLBACK_CHAT_TEMPLATE_EOS_TURNS
    example = tokenize_record(tokenizer, record, "chat")
    trained = [t for t, keep in zip(example.input_ids, example.trainable, strict=True) if keep]
    assert tokenizer.decode(trained) == "negative<|endoftext|>\n"  # the model learns to emit eos
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id
    assert stop_token_ids(tokenizer, "chat") == [tokenizer.eos_token_id]


def test_template_closing_turns_with_plain_text_has_no_end_of_turn_token():
    tokenizer = gpt2_like_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    assert end_of_turn_id(tokenizer) is None
    assert stop_token_ids(tokenizer, "chat") == [tokenizer.eos_token_id]
