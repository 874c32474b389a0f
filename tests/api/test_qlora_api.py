"""QLoRA through the API: method.lora.quantization on the native spec, on the OpenAI-compatible route's `lora` and
on the CLI (beside it, full fine-tuning's --optimizer-state); a plan on a GPU pool that chooses a 4-bit base over CPU offload and says why; and, slow, the local
QLoRA example trained through the CLI, downloaded, and loaded with PEFT onto a 4-bit base."""

from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.api.conftest import TRAIN, Server, upload, wait_for
from tunewright_api.backends.local import cpu_plan
from tunewright_api.cli import build_parser, main, render, spec_from_args
from tunewright_api.errors import ApiError
from tunewright_core.spec import FineTuneJobSpec
from tunewright_jobs.model import keep_codes_as_trained, nf4_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local" / "qlora-chat.yaml"
CLUSTER_EXAMPLE = ROOT / "examples" / "cluster" / "finetunejob-qlora-70b.yaml"


@pytest.fixture
def api(tmp_path):
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as server:
        yield server


def test_the_openai_route_takes_the_bases_quantization(api, tiny_models):
    alice = api.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    answer = alice.post("/v1/fine_tuning/jobs", json={
        "model": str(tiny_models["llama"]), "training_file": train, "max_steps": 4, "seq_len": 128,
        "lora": {"r": 8, "quantization": "nf4"}})
    assert answer.status_code == 200, answer.text
    spec = alice.get(f"/v1/jobs/{answer.json()['id']}").json()["spec"]
    assert spec["method"]["lora"]["quantization"] == "nf4" and spec["method"]["lora"]["r"] == 8
    refused = alice.post("/v1/fine_tuning/jobs", json={"model": str(tiny_models["llama"]), "training_file": train,
                                                       "lora": {"quantization": "int3"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora.quantization"


def test_a_plan_for_70b_on_one_h200_chooses_a_four_bit_base_over_offload(api):
    with api.client() as admin:
        assert admin.post("/v1/pools", json={"name": "h200", "gpu": "H200", "gpusPerNode": 1, "maxNodes": 1,
                                             "intraNode": "nvlink4", "pricePerGPUHour": 3.5,
                                             "hostMemoryGiB": 2048}).status_code == 201
        spec = yaml.safe_load(CLUSTER_EXAMPLE.read_text())["spec"]
        answer = admin.post("/v1/plans", json={"pool": "h200", "spec": spec})
    assert answer.status_code == 200, answer.text
    plan = answer.json()["plan"]
    assert plan["quantization"] == "nf4" and not plan["cpuOffload"] and plan["strategy"] == "single"
    assert "quantization auto chose nf4 (QLoRA): a bf16 base fits only with CPU offload" in plan["explanation"]


def flags(*argv) -> Namespace:
    return build_parser().parse_args(["submit", *argv])


def test_cli_flags_and_listing_say_the_base():
    spec = spec_from_args(flags("--model", "org/m", "--train", "t.jsonl", "--quantization", "nf4"))
    assert spec["method"] == {"lora": {"quantization": "nf4"}}
    spec = spec_from_args(flags("--model", "org/m", "--train", "t.jsonl", "--method", "full", "--optimizer-state",
                                "auto"))
    assert spec["method"] == {"type": "full"} and spec["hyperparameters"] == {"optimizerState": "auto"}
    nf4 = {"type": "lora", "lora": {"quantization": "nf4"}}
    assert render.method_cell(nf4) == "qlora" and render.method_cell({**nf4, "objective": "dpo"}) == "qlora dpo"
    assert render.method_cell({"type": "lora", "lora": {"quantization": "auto"}}) == "lora"
    job = {"id": "ftjob-1", "status": "queued", "model": "org/m", "progress": {"step": 0},
           "createdAt": "2026-01-01T00:00:00+00:00", "plan": None, "spec": {"method": nf4}}
    assert "model:     org/m (lora, objective sft, base nf4 (4-bit, QLoRA))" in render.job_text(job)


@pytest.mark.slow  # trains a short job
def test_the_local_qlora_example_trains_downloads_and_loads_with_peft(server, tiny_models, tmp_path, monkeypatch,
                                                                       capsys):
    (tmp_path / "tiny-kit").mkdir()
    (tmp_path / "tiny-kit" / "tiny-llama").symlink_to(tiny_models["llama"])
    (tmp_path / "tiny-kit" / "data").symlink_to(TRAIN.parent)
    monkeypatch.chdir(tmp_path)
    with server.client() as admin:
        token = admin.post("/v1/tokens", json={"tenant": "examples"}).json()["token"]
    user = ["--url", server.url, "--token", token]
    assert main([*user, "-o", "id", "submit", str(EXAMPLE), "--max-steps", "4"]) == 0, capsys.readouterr().err
    job_id = capsys.readouterr().out.strip()
    with server.client(token) as client:
        done = wait_for(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert main([*user, "download", job_id, "--dir", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], quantization_config=nf4_config(torch.float32),
                                                device_map={"": "cpu"}, dtype=torch.float32)
    keep_codes_as_trained(base)
    adapter = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged").eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("quantization", "strategy", "planned"), [
    ("nf4", "auto", "nf4"), ("nf4", "ddp", "nf4"), ("auto", "auto", "none"), ("none", "fsdp", "none"),
])
def test_the_local_plan_loads_the_base_the_spec_asks_for(quantization, strategy, planned):
    spec = FineTuneJobSpec.model_validate({"model": {"source": "m"}, "dataset": {"train": "file-1"},
                                           "method": {"lora": {"quantization": quantization}},
                                           "resources": {"strategy": strategy}})
    assert cpu_plan(spec, workers=2).quantization == planned


def test_the_local_plan_refuses_to_shard_a_four_bit_base():
    spec = FineTuneJobSpec.model_validate({"model": {"source": "m"}, "dataset": {"train": "file-1"},
                                           "method": {"lora": {"quantization": "nf4"}},
                                           "resources": {"strategy": "fsdp"}})
    with pytest.raises(ApiError, match="a 4-bit .nf4. base is not sharded"):
        cpu_plan(spec, workers=2)


@pytest.mark.parametrize(("state", "planned"), [("bf16", "bf16"), ("auto", "fp32"), ("fp32", "fp32")])
def test_the_local_plan_holds_the_optimizer_state_the_spec_asks_for(state, planned):
    spec = FineTuneJobSpec.model_validate({"model": {"source": "m"}, "dataset": {"train": "file-1"},
                                           "method": {"type": "full"}, "hyperparameters": {"optimizerState": state}})
    plan = cpu_plan(spec, workers=2)
    assert plan.optimizer_state == planned
    assert ("bf16 weights and moments" in plan.explanation) is (planned == "bf16")


def test_the_local_plan_refuses_fp8():
    spec = FineTuneJobSpec.model_validate({"model": {"source": "m"}, "dataset": {"train": "file-1"},
                                           "resources": {"precision": "fp8"}})
    with pytest.raises(ApiError, match="fp8 products run on a GPU's FP8 tensor cores"):
        cpu_plan(spec, workers=2)
