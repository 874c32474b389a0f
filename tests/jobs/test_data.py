import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.jobs.conftest import python_path
from tunewright_jobs import tiny
from tunewright_jobs.data import (
    IGNORE_INDEX,
    DatasetError,
    EpochBatches,
    Example,
    TokenizedDataset,
    build_rows,
    eval_rows,
    micro_batches,
    pack_best_fit_decreasing,
    read_jsonl,
    tokenize_dataset,
    tokenize_record,
)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tokenizer(request, tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models[request.param])
    return tok


def write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def trained_text(tok, ex: Example) -> str:
    return tok.decode([t for t, keep in zip(ex.input_ids, ex.trainable, strict=True) if keep])


def test_chat_trains_only_on_assistant_turns(tokenizer):
    record = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The soup was cold."},
        {"role": "assistant", "content": "negative"},
        {"role": "user", "content": "The bread was fresh."},
        {"role": "assistant", "content": "positive"},
    ]}
    tokenize_dataset(tokenizer, [record], "chat", 512, "x")  # installs the fallback template where needed
    ex = tokenize_record(tokenizer, record, "chat")
    assert trained_text(tokenizer, ex) == "negative<|im_end|>\npositive<|im_end|>\n"
    assert tokenizer.decode(ex.input_ids).startswith("<|im_start|>system\nBe brief.")


def test_prompt_completion_and_text(tokenizer):
    ex = tokenize_record(tokenizer, {"prompt": "The soup was cold. Sentiment:", "completion": " negative"},
                         "prompt_completion")
    assert trained_text(tokenizer, ex) == " negative<|endoftext|>"
    ex = tokenize_record(tokenizer, {"text": "The bread was fresh."}, "text")
    assert all(ex.trainable) and tokenizer.decode(ex.input_ids).endswith("fresh.<|endoftext|>")


@pytest.mark.parametrize(
    ("fmt", "lines", "expected"),
    [
        ("chat", ['{"messages": [', {"messages": []}], ["data.jsonl:1: not valid JSON", 'data.jsonl:2: "messages" must be a non-empty list']),
        ("chat", [{"messages": [{"role": "user", "content": "hi"}]}], ["data.jsonl:1: no assistant message"]),
        ("chat", [{"messages": [{"role": "bot", "content": "hi"}]}], ["data.jsonl:1: messages[0].role must be one of"]),
        ("chat", [{"messages": [{"role": "assistant", "content": 3}]}], ["data.jsonl:1: messages[0].content must be a string"]),
        ("prompt_completion", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}],
         ['data.jsonl:2: "completion" must be a non-empty string']),
        ("text", ["[1, 2]", "", {"text": ""}], ["data.jsonl:1: must be a JSON object", 'data.jsonl:3: "text" must be a non-empty string']),
    ],
)
def test_malformed_files_name_file_line_and_reason(tmp_path, fmt, lines, expected):
    path = write(tmp_path, lines)
    with pytest.raises(DatasetError) as err:
        read_jsonl(path, fmt)
    for fragment in expected:
        assert fragment in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_jsonl(tmp_path / "nope.jsonl", "text")
    with pytest.raises(DatasetError, match="no examples"):
        read_jsonl(write(tmp_path, [""]), "text")


def test_error_list_is_bounded(tmp_path):
    message = str(pytest.raises(DatasetError, read_jsonl, write(tmp_path, ["x"] * 100), "text").value)
    assert "data.jsonl:20:" in message and "data.jsonl:21:" not in message and "stopped after" in message


def test_examples_without_targets_within_seq_len_are_dropped(tokenizer):
    long_prompt = {"prompt": "the food was lovely " * 50, "completion": "positive"}
    short = {"prompt": "ok", "completion": "positive"}
    data = tokenize_dataset(tokenizer, [long_prompt, short], "prompt_completion", 32, "x")
    assert (data.truncated, data.dropped, len(data.examples)) == (1, 1, 1)
    with pytest.raises(DatasetError, match="no example has a trainable token"):
        tokenize_dataset(tokenizer, [long_prompt], "prompt_completion", 32, "x")


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_packing_respects_capacity_and_keeps_every_item(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=300).tolist()
    bins = pack_best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= int(np.ceil(sum(lengths) / 128) * 1.15)  # near the lower bound


def test_packing_chat_lengths_leaves_under_one_percent_padding():
    """Log-normal lengths with a median half a row and a tail cut at the row (vs_hf's variable data): the
    rows' padding share, which costs trained tokens/s one for one."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(2048, rng.lognormal(np.log(1000), 0.75, size=2500)).astype(int).tolist()
    bins = pack_best_fit_decreasing(lengths, 2048)
    assert 1 - sum(lengths) / (len(bins) * 2048) < 0.01
    # ties keep the given order: a shuffled order packs the same lengths into other groups
    order = rng.permutation(len(lengths)).tolist()
    again = pack_best_fit_decreasing([lengths[i] for i in order], 2048)
    assert len(again) == len(bins)
    assert {frozenset(order[i] for i in b) for b in again} != {frozenset(b) for b in bins}


def test_packed_validation_rows_start_with_the_files_first_examples():
    """Packing longest first, then rows in the order of their first example: an evaluation capped at one
    batch scores the file's head, not its longest examples."""
    lengths = [3, 9, 2, 8, 4, 7]  # tokens; rows of 10: {1}, {3, 2}, {5, 0}, {4}
    data = TokenizedDataset([Example([100 + i] * n, [True] * n) for i, n in enumerate(lengths)], 0, 0)
    rows = eval_rows(data, seq_len=10, pad_id=0, packing=True)
    held = [sorted({int(t) - 100 for t in row if t}) for row in rows.input_ids]
    assert held == [[0, 5], [1], [2, 3], [4]]


def test_packed_rows_keep_examples_apart():
    a = Example([1, 2, 3], [False, True, True])
    b = Example([4, 5], [False, True])
    rows = build_rows([a, b], [[0, 1]], seq_len=8, pad_id=0)
    assert rows.input_ids[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    # shifted labels: token 3 (last of a) does not predict token 4 (first of b)
    assert rows.labels[0].tolist() == [2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert rows.real_tokens.tolist() == [5]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_forward_equals_separate_forwards(tiny_models, kind):
    """Padding-free packing: no attention across example boundaries."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models[kind]).eval()
    a, b = Example(list(range(10, 30)), [True] * 20), Example(list(range(40, 52)), [True] * 12)
    rows = build_rows([a, b], [[0, 1]], seq_len=40, pad_id=0)
    with torch.no_grad():
        packed = model(input_ids=torch.tensor(rows.input_ids), position_ids=torch.tensor(rows.position_ids),
                       use_cache=False).logits[0]
        alone_a = model(input_ids=torch.tensor([a.input_ids]), use_cache=False).logits[0]
        alone_b = model(input_ids=torch.tensor([b.input_ids]), use_cache=False).logits[0]
    torch.testing.assert_close(packed[:20], alone_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed[20:32], alone_b, atol=1e-5, rtol=1e-4)


def fake_dataset(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return TokenizedDataset([Example(list(rng.integers(1, 50, size=int(k))), [True] * int(k))
                             for k in rng.integers(5, 40, size=n)], 0, 0)


def test_epochs_are_deterministic_and_differ():
    data = fake_dataset()
    one = EpochBatches(data, 64, 0, True, seed=7, global_batch_size=8)
    two = EpochBatches(data, 64, 0, True, seed=7, global_batch_size=8)
    np.testing.assert_array_equal(one.rows(0).input_ids, two.rows(0).input_ids)
    np.testing.assert_array_equal(one.rows(3).input_ids, two.rows(3).input_ids)
    assert not np.array_equal(one.rows(0).input_ids[:8], one.rows(1).input_ids[:8])
    epoch, batch = one.step_rows(one.steps_per_epoch + 2)  # third step of the second epoch
    assert epoch == 1
    np.testing.assert_array_equal(batch.input_ids, one.rows(1).input_ids[16:24])


def test_unpacked_rows_hold_one_example_each():
    data = fake_dataset(40)
    batches = EpochBatches(data, 64, 0, packing=False, seed=0, global_batch_size=4)
    assert len(batches.rows(0)) == 40 and batches.steps_per_epoch == 10
    assert sorted(batches.rows(0).real_tokens.tolist()) == sorted(len(e.input_ids) for e in data.examples)


def test_ranks_split_a_global_batch_exactly():
    batches = EpochBatches(fake_dataset(), 64, 0, True, seed=0, global_batch_size=12)
    _, batch = batches.step_rows(0)
    seen = [mb.input_ids for rank in range(3) for mb in micro_batches(batch, rank, 3, micro_batch_size=2)]
    assert len(seen) == 6 and all(len(s) == 2 for s in seen)
    assert sorted(map(bytes, np.concatenate(seen))) == sorted(map(bytes, batch.input_ids))


def test_too_small_for_one_batch():
    with pytest.raises(DatasetError, match=r"^hyperparameters.global_batch_size: at most \d+ sequences a step, not 64;"):
        EpochBatches(fake_dataset(4), 64, 0, True, seed=0, global_batch_size=64)


def test_shipped_dataset_matches_its_generator():
    train, validation = tiny.make_dataset()
    assert read_jsonl(tiny.DATA_DIR / "train.jsonl", "chat") == train
    assert read_jsonl(tiny.DATA_DIR / "validation.jsonl", "chat") == validation
    train_reviews = {r["messages"][1]["content"] for r in train}
    assert not any(r["messages"][1]["content"] in train_reviews for r in validation)


@pytest.mark.parametrize(("lines", "expected"), [
    ([{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]}],
     {"format": "chat", "examples": 1, "characters": 3, "longest_characters": 3}),
    ([{"prompt": "a", "completion": "bcd"}] * 3,
     {"format": "prompt_completion", "examples": 3, "characters": 12, "longest_characters": 4}),
    ([{"text": "a"}, {"text": "bb"}], {"format": "text", "examples": 2, "characters": 3, "longest_characters": 2}),
])
def test_validate_detects_the_format(tmp_path, lines, expected):
    from tunewright_jobs.validate import validate

    assert validate(write(tmp_path, lines), "auto") == expected


def test_validate_reports_line_numbers_and_undetectable_files(tmp_path):
    from tunewright_jobs.validate import main, validate

    result = validate(write(tmp_path, [{"text": "a"}, {"text": ""}]), "auto")
    assert result["format"] == "text" and result["errors"][0].endswith('data.jsonl:2: "text" must be a non-empty string')
    assert "cannot tell the format" in validate(write(tmp_path, [{"foo": 1}]), "auto")["errors"][0]
    assert main([str(write(tmp_path, ["{bad"])), "--format", "text"]) == 1


def test_validator_runs_without_numpy_torch_or_transformers():
    """The API runs it at upload in its own environment, which has none of the training stack."""
    code = ("import sys\n"
            "sys.modules['numpy'] = sys.modules['torch'] = sys.modules['transformers'] = None  # import fails\n"
            "from tunewright_jobs.validate import main\n"
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny.DATA_DIR / "train.jsonl")], capture_output=True,
                          text=True, env={"PYTHONPATH": python_path()}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    checked = json.loads(proc.stdout)
    assert (checked["format"], checked["examples"]) == ("chat", 800) and 0 < checked["longest_characters"] < 2000
