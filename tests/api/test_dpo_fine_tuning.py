"""DPO through the API: preference files validated at upload (both shapes; a bad line refused naming it), the
OpenAI-compatible route taking method {"type": "dpo"} as OpenAI's client sends it and answering it back, the
native route's spec rule, a reference model checked as model.source is, and the CLI's flags and `get`.

No job trains here (max_running_jobs=0): each stays queued with its spec and its runtime config."""

import json
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from tests.api.conftest import TRAIN, Server, upload
from tunewright_api.cli import build_parser, main, render, spec_from_args

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "examples" / "local" / "data" / "preference-train.jsonl"  # OpenAI's shape
PROMPT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}]
OPENAI_PAIR = {"input": {"messages": PROMPT}, "preferred_output": [{"role": "assistant", "content": "blue"}],
               "non_preferred_output": [{"role": "assistant", "content": "green"}]}


@pytest.fixture
def api(tmp_path):
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as server:
        yield server


def jsonl(path: Path, *records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# --- upload ------------------------------------------------------------------------------------------


def test_preference_files_are_accepted_in_both_shapes(api, tmp_path):
    alice = api.tenant("alice")
    answer = upload(alice, PAIRS)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["format"], answer.json()["examples"]) == ("preference", 200)
    trl = jsonl(tmp_path / "trl.jsonl",
                {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "blue"}],
                 "rejected": [{"role": "assistant", "content": "green"}]})
    answer = upload(alice, trl)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["format"], answer.json()["examples"]) == ("preference", 2)


@pytest.mark.parametrize(("bad", "names"), [
    ({"input": {"messages": PROMPT}, "preferred_output": [{"role": "assistant", "content": "blue"}]},
     "non_preferred_output"),
    ({**OPENAI_PAIR, "preferred_output": [{"role": "user", "content": "blue"}]}, "preferred_output[0].role"),
    ({**OPENAI_PAIR, "input": {"messages": "Sky colour?"}}, "input.messages"),
    ({"prompt": "The sky is", "chosen": "", "rejected": " green."}, "chosen"),
    ({"prompt": "The sky is", "chosen": " blue."}, "rejected"),
    ({"prompt": 3, "chosen": " blue.", "rejected": " green."}, "prompt"),
    ('{"input": ', "not valid JSON"),
])
def test_a_bad_preference_line_is_refused_naming_its_line_and_reason(api, tmp_path, bad, names):
    good = OPENAI_PAIR if isinstance(bad, str) or "input" in bad else {
        "prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    path = jsonl(tmp_path / "pairs.jsonl", good, bad, good)
    answer = upload(api.tenant("alice"), path, "mine.jsonl")
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "file" and "mine.jsonl:2: " in message, message
    assert names in message.split("mine.jsonl:2: ", 1)[1] and "mine.jsonl:1" not in message, message
    assert [p for p in (api.settings.data_dir / "files").rglob("*") if p.is_file()] == []


# --- the OpenAI-compatible route ---------------------------------------------------------------------


def create(client, tiny_models, training_file: str, method: dict | None, **extra):
    body = {"model": str(tiny_models["gpt2"]), "training_file": training_file, "max_steps": 4, "seq_len": 128,
            **({"method": method} if method is not None else {}), **extra}
    return client.post("/v1/fine_tuning/jobs", json=body)


def test_fine_tuning_takes_dpo_as_openai_does_and_answers_it_back(api, tiny_models):
    alice = api.tenant("alice")
    pairs = upload(alice, PAIRS).json()["id"]
    answer = create(alice, tiny_models, pairs, {"type": "dpo", "dpo": {"hyperparameters": {
        "beta": 0.2, "n_epochs": 1, "batch_size": 4}}})
    assert answer.status_code == 200, answer.text
    job = answer.json()
    expected = {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 4,
                                                           "learning_rate_multiplier": 1.0, "beta": 0.2}}}
    assert job["method"] == expected  # no supervised, no null beside it
    assert alice.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["method"] == expected
    spec = alice.get(f"/v1/jobs/{job['id']}").json()["spec"]
    assert (spec["method"]["objective"], spec["method"]["dpo"]["beta"], spec["dataset"]["format"]) == (
        "dpo", 0.2, "preference")
    assert spec["method"]["type"] == "lora" and spec["hyperparameters"]["learningRate"] == pytest.approx(1e-5)
    # "auto" (and no hyperparameters at all): the spec's beta, answered as a number
    auto = create(alice, tiny_models, pairs, {"type": "dpo", "dpo": {"hyperparameters": {"beta": "auto"}}},
                  method_type="full")
    assert auto.status_code == 200, auto.text
    assert auto.json()["method"]["dpo"]["hyperparameters"]["beta"] == 0.1
    assert alice.get(f"/v1/jobs/{auto.json()['id']}").json()["spec"]["method"]["type"] == "full"
    nulls = create(alice, tiny_models, pairs, {"type": "dpo", "dpo": {"hyperparameters": {  # the SDK's model_dump()
        "beta": None, "batch_size": None, "n_epochs": None, "learning_rate_multiplier": None}}})
    assert nulls.status_code == 200 and nulls.json()["method"]["dpo"]["hyperparameters"]["beta"] == 0.1, nulls.text
    bare = create(alice, tiny_models, pairs, {"type": "dpo"})
    assert bare.status_code == 200 and bare.json()["method"]["type"] == "dpo", bare.text
    listed = alice.get("/v1/fine_tuning/jobs").json()["data"]
    assert {j["method"]["type"] for j in listed} == {"dpo"}


def test_fine_tuning_supervised_is_sft_and_answered_as_before(api, tiny_models):
    alice = api.tenant("alice")
    chat = upload(alice, TRAIN).json()["id"]
    for method in ({"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}}, None,
                   # the official client's model_dump() of an answered job's method: the other types as null
                   {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}, "dpo": None,
                    "reinforcement": None}):
        answer = create(alice, tiny_models, chat, method)
        assert answer.status_code == 200, answer.text
        assert answer.json()["method"]["type"] == "supervised" and "dpo" not in answer.json()["method"]
        assert answer.json()["method"]["supervised"]["hyperparameters"]["learning_rate_multiplier"] == 1.0
        spec = alice.get(f"/v1/jobs/{answer.json()['id']}").json()["spec"]
        assert spec["method"]["objective"] == "sft" and spec["hyperparameters"]["learningRate"] == pytest.approx(2e-4)


@pytest.mark.parametrize(("file", "method", "param", "said"), [
    ("chat", {"type": "dpo"}, "training_file", "method.type dpo trains on preference pairs"),
    ("pairs", {"type": "supervised"}, "method.type", "holds preference pairs"),
    ("pairs", None, "method.type", "holds preference pairs"),
    ("pairs", {"type": "reinforcement"}, "method.type", "'supervised' or 'dpo'"),
    ("pairs", {"type": "dpo", "reinforcement": {"hyperparameters": {}}}, "method",
     "reinforcement fine-tuning is not offered"),
    ("pairs", {"type": "dpo", "supervised": {}}, "method", "supervised is given but type is dpo"),
    ("pairs", {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}, "method.dpo.hyperparameters.beta",
     "method.dpo.hyperparameters.beta: Input should be greater than 0 or 'auto' (allowed: more than 0, at most 100; "
     "default auto)"),
    ("pairs", {"type": "dpo", "dpo": {"hyperparameters": {"betta": 0.1}}}, "method.dpo.hyperparameters.betta",
     "did you mean beta?"),  # a misspelt key inside method is refused, not run with the default
])
def test_fine_tuning_refuses_a_method_its_file_does_not_fit(api, tiny_models, file, method, param, said):
    alice = api.tenant("alice")
    files = {"chat": upload(alice, TRAIN).json()["id"], "pairs": upload(alice, PAIRS).json()["id"]}
    answer = create(alice, tiny_models, files[file], method)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"] or "").startswith(param) and said in error["message"], error
    assert alice.get("/v1/fine_tuning/jobs").json()["data"] == []


# --- the native route --------------------------------------------------------------------------------


def native_spec(model: Path, train: str, **method) -> dict:
    return {"model": {"source": str(model)}, "method": {"type": "lora", **method},
            "dataset": {"train": train, "format": "preference"},
            "hyperparameters": {"maxSteps": 4, "globalBatchSize": 4, "seqLen": 128}}


def test_the_spec_route_takes_dpo_and_says_the_rule_it_breaks(api, tiny_models):
    alice = api.tenant("alice")
    pairs, chat = upload(alice, PAIRS).json()["id"], upload(alice, TRAIN).json()["id"]
    made = alice.post("/v1/jobs", json=native_spec(tiny_models["gpt2"], pairs, objective="dpo", dpo={"beta": 0.3}))
    assert made.status_code == 201, made.text
    job = made.json()
    assert job["spec"]["method"]["objective"] == "dpo" and job["spec"]["method"]["dpo"]["beta"] == 0.3
    sft_on_pairs = alice.post("/v1/jobs", json=native_spec(tiny_models["gpt2"], pairs))
    assert sft_on_pairs.status_code == 422 and "method.objective: dataset.format preference" in \
        sft_on_pairs.json()["error"]["message"]
    chat_spec = native_spec(tiny_models["gpt2"], chat, objective="dpo")
    chat_spec["dataset"]["format"] = "chat"
    dpo_on_chat = alice.post("/v1/jobs", json=chat_spec)
    assert dpo_on_chat.status_code == 422 and "dataset.format: method.objective dpo trains on preference pairs" in \
        dpo_on_chat.json()["error"]["message"]
    unset = native_spec(tiny_models["gpt2"], pairs, objective="dpo")
    del unset["dataset"]["format"]
    refused = alice.post("/v1/jobs", json=unset).json()["error"]
    assert refused["param"] == "dataset.format" and refused["message"] == (
        "dataset.format: method.objective dpo trains on preference pairs: set dataset.format to preference (not "
        "chat, the default where it is not given)")


def test_the_spec_routes_reference_model_is_checked_as_model_source_is(api, tiny_models, tmp_path):
    alice = api.tenant("alice")
    pairs = upload(alice, PAIRS).json()["id"]
    for reference, said in (("/etc", "is not where this server reads models from"),
                            (str(tmp_path / "nothing-here"), "no model there"),
                            ("relative/../folder", "must be absolute")):
        answer = alice.post("/v1/jobs", json=native_spec(tiny_models["gpt2"], pairs, objective="dpo",
                                                         dpo={"reference": reference}))
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["param"] == "method.dpo.reference" and said in answer.json()["error"]["message"]
    linked = tmp_path / "sft-export"
    linked.symlink_to(tiny_models["gpt2"])
    answer = alice.post("/v1/jobs", json=native_spec(tiny_models["gpt2"], pairs, objective="dpo",
                                                     dpo={"reference": str(linked)}))
    assert answer.status_code == 201, answer.text
    assert answer.json()["spec"]["method"]["dpo"]["reference"] == str(tiny_models["gpt2"].resolve())  # resolved
    described = {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4", "pricePerGPUHour": 2.5}
    plan = alice.post("/v1/plans", json={"poolSpec": described, "spec": native_spec(
        tiny_models["gpt2"], pairs, objective="dpo", dpo={"reference": "/etc"})})
    assert plan.status_code == 422 and plan.json()["error"]["param"] == "spec.method.dpo.reference", plan.text


def test_a_dpo_plan_on_a_gpu_pool_says_what_dpo_adds(api):
    with api.client() as admin:
        assert admin.post("/v1/pools", json={"name": "h100", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 2,
                                             "intraNode": "nvlink4", "interNode": "ib-8x400g",
                                             "pricePerGPUHour": 2.5}).status_code == 201
        spec = yaml.safe_load((ROOT / "examples" / "cluster" / "finetunejob-dpo.yaml").read_text())["spec"]
        answer = admin.post("/v1/plans", json={"pool": "h100", "spec": spec})
    assert answer.status_code == 200, answer.text
    plan = answer.json()["plan"]
    assert "dpo: chosen and rejected per example, plus the reference forward" in plan["explanation"]
    assert "frozen bf16 copy of the weights" in plan["explanation"]


# --- the CLI -----------------------------------------------------------------------------------------


def flags(*argv) -> Namespace:
    return build_parser().parse_args(["submit", *argv])


def test_cli_flags_make_a_dpo_spec():
    spec = spec_from_args(flags("--model", "org/m", "--train", "p.jsonl", "--objective", "dpo", "--beta", "0.2",
                                "--label-smoothing", "0.1", "--reference", "org/sft"))
    assert spec["method"] == {"objective": "dpo", "dpo": {"beta": 0.2, "labelSmoothing": 0.1, "reference": "org/sft"}}
    assert spec["dataset"]["format"] == "preference"  # what dpo trains on, unless said otherwise
    spec = spec_from_args(flags("--model", "org/m", "--train", "p.jsonl", "--format", "preference"))
    assert spec["method"]["objective"] == "dpo" and spec["dataset"]["format"] == "preference"
    spec = spec_from_args(flags("--model", "org/m", "--train", "p.jsonl", "--objective", "dpo", "--format", "chat"))
    assert spec["dataset"]["format"] == "chat"  # said: the spec's check refuses it, naming the field
    spec = spec_from_args(flags("--model", "org/m", "--train", "p.jsonl"))
    assert "objective" not in spec.get("method", {}) and "format" not in spec["dataset"]


def test_cli_flags_override_a_spec_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"source": "org/m"}, "method": {"type": "full"},
                                    "dataset": {"train": "p.jsonl", "format": "preference"}}))
    spec = spec_from_args(flags(str(path), "--objective", "dpo", "--beta", "0.5"))
    assert spec["method"] == {"type": "full", "objective": "dpo", "dpo": {"beta": 0.5}}


def test_cli_get_shows_the_objective():
    base = {"id": "ftjob-1", "status": "queued", "model": "org/m", "progress": {"step": 0}, "created_at":
            "2026-01-01T00:00:00+00:00", "plan": None}
    dpo = {**base, "spec": {"method": {"type": "lora", "objective": "dpo", "dpo": {"beta": 0.2}}}}
    assert "model:     org/m (lora, objective dpo, beta 0.2)" in render.job_text(dpo)
    sft = {**base, "spec": {"method": {"type": "full"}}}  # a job from before dpo: no objective
    assert "model:     org/m (full, objective sft)" in render.job_text(sft)
    assert render.method_cell(dpo["spec"]["method"]) == "lora dpo" and render.method_cell(sft["spec"]["method"]) == "full"


def test_cli_submits_dpo_from_flags_and_get_says_so(api, tiny_models, capsys):
    with api.client() as admin:
        token = admin.post("/v1/tokens", json={"tenant": "carol"}).json()["token"]
    user = ["--url", api.url, "--token", token]
    code = main([*user, "-o", "id", "submit", "--model", str(tiny_models["gpt2"]), "--train", str(PAIRS),
                 "--objective", "dpo", "--beta", "0.25", "--max-steps", "3", "--batch-size", "4", "--seq-len", "128"])
    out, err = capsys.readouterr()
    assert code == 0, err
    job_id = out.strip()
    assert main([*user, "get", job_id]) == 0
    assert "(lora, objective dpo, beta 0.25)" in capsys.readouterr().out
    assert main([*user, "jobs"]) == 0
    assert "lora dpo" in capsys.readouterr().out
    # the spec's own rule, said before anything is uploaded
    code = main([*user, "submit", "--model", str(tiny_models["gpt2"]), "--train", str(TRAIN), "--objective", "dpo",
                 "--format", "chat"])
    assert code != 0 and "dataset.format" in capsys.readouterr().err


def test_fine_tuning_refuses_a_validation_file_of_another_format(api, tiny_models):
    alice = api.tenant("alice")
    pairs, chat = upload(alice, PAIRS).json()["id"], upload(alice, TRAIN).json()["id"]
    answer = create(alice, tiny_models, pairs, {"type": "dpo"}, validation_file=chat)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "validation_file"
    assert f"{chat} holds chat records, the training file preference" in answer.json()["error"]["message"]
