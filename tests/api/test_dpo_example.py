"""The local DPO example runs on this machine through the CLI (shortened to a few steps), as
test_examples.py runs the other local examples: the tiny kit's GPT-2, the shipped preference pairs."""

from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.api.conftest import wait_for
from tunewright_api.cli import main
from tunewright_api.cli.render import evaluation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local" / "dpo" / "dpo-lora.yaml"


@pytest.mark.slow  # trains a short job
def test_the_local_dpo_example_runs(server, tiny_models, tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny-kit").mkdir()
    (tmp_path / "tiny-kit" / "tiny-gpt2").symlink_to(tiny_models["gpt2"])
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the example names ./examples/local/data/...
    monkeypatch.chdir(tmp_path)
    with server.client() as admin:
        token = admin.post("/v1/tokens", json={"tenant": "examples"}).json()["token"]
    assert main(["--url", server.url, "--token", token, "-o", "id", "submit", str(EXAMPLE), "--max-steps",
                 "3"]) == 0, capsys.readouterr().err
    job_id = capsys.readouterr().out.strip()
    with server.client(token) as user:
        done = wait_for(user, job_id, {"succeeded", "failed"})
        metrics = user.get(f"/v1/jobs/{job_id}/metrics").json()["data"]
    assert done["status"] == "succeeded", done["error"]
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    assert done["spec"]["method"]["objective"] == spec["method"]["objective"] == "dpo"
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("rewardMargin" in m and "preferenceAccuracy" in m for m in metrics), metrics[-1]
    # the adapter it exports holds the trained weights (DDP on the local pool exported an empty one once)
    assert (done["plan"]["strategy"], done["plan"]["workers"]) == ("ddp", 2)
    adapter = load_file(Path(done["result"]["export"]["adapter"]) / "adapter_model.safetensors")
    assert adapter and all(".lora_" in name for name in adapter)
    said = dict(evaluation(done["result"]))  # `tunewright get` and the run's summary: dpo's own scores
    assert said["preference accuracy"].count("%") == 2 and "reward margin" in said, said
