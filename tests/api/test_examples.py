"""Every example is submitted: the local ones run on this machine through the CLI (shortened to a few
steps), the cluster ones are planned on the example pool (they name volumes only a cluster has; the operator
tests apply them with kubectl)."""

import os
from pathlib import Path

import pytest
import yaml

from tests.api.conftest import ADMIN, wait_for
from tunewright_api.cli import main
from tunewright_jobs.tiny import DATA_DIR

ROOT = Path(__file__).resolve().parents[2]
LOCAL = sorted((ROOT / "examples" / "local").glob("*.yaml"))
CLUSTER_JOBS = [p for p in sorted((ROOT / "examples" / "cluster").glob("*.yaml"))
                if yaml.safe_load(p.read_text())["kind"] == "FineTuneJob"]


@pytest.fixture
def kit_dir(tmp_path, tiny_models, monkeypatch):
    """A folder holding tiny-kit/ as `python -m tunewright_jobs.tiny build --out tiny-kit` lays it out."""
    kit = tmp_path / "tiny-kit"
    (kit / "data").mkdir(parents=True)
    for kind in ("gpt2", "llama"):
        (kit / f"tiny-{kind}").symlink_to(tiny_models[kind])
    for name in ("train.jsonl", "validation.jsonl"):
        (kit / "data" / name).symlink_to(DATA_DIR / name)
    monkeypatch.chdir(tmp_path)  # the examples name ./tiny-kit/...
    return tmp_path


@pytest.mark.slow  # trains four short jobs
def test_the_local_examples_run(server, kit_dir, capsys):
    assert [p.name for p in LOCAL] == ["forced-strategy.yaml", "full-finetune.yaml", "lora-chat.yaml",
                                       "qlora-chat.yaml"]
    with server.client() as admin:
        token = admin.post("/v1/tokens", json={"tenant": "examples"}).json()["token"]
    for example in LOCAL:
        assert main(["--url", server.url, "--token", token, "-o", "id", "submit", str(example), "--max-steps",
                     "3"]) == 0, capsys.readouterr().err
        job_id = capsys.readouterr().out.strip()
        with server.client(token) as user:
            done = wait_for(user, job_id, {"succeeded", "failed"})
        assert done["status"] == "succeeded", (example.name, done["error"])
        spec = yaml.safe_load(example.read_text())["spec"]
        assert done["plan"]["strategy"] == spec.get("resources", {}).get("strategy", done["plan"]["strategy"])
        assert done["spec"]["method"]["type"] == spec["method"]["type"]


@pytest.mark.parametrize("example", CLUSTER_JOBS, ids=lambda p: p.name)
def test_the_cluster_examples_plan_on_the_example_pool(server, example, capsys):
    pool = yaml.safe_load((ROOT / "examples" / "cluster" / "gpupool-h100.yaml").read_text())
    fields = ("gpu", "gpusPerNode", "maxNodes", "intraNode", "interNode", "pricePerGPUHour", "hostMemoryGiB")
    with server.client() as admin:
        assert admin.post("/v1/pools", json={"name": "h100", **{k: pool["spec"][k] for k in fields}}).is_success
    assert main(["--url", server.url, "--token", ADMIN, "plan", str(example), "--pool", "h100", "--dataset-tokens",
                 "50000000"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    spec = yaml.safe_load(example.read_text())["spec"]
    assert "on pool h100" in out and f"plan:      {spec['resources'].get('strategy', '')}" in out
    assert os.path.basename(spec["model"]["source"]).split("-")[0] in out
