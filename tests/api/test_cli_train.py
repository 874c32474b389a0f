"""`tunewright train` (a job on this machine, from its spec file to a downloaded adapter, on an API of its own),
`tunewright explain-spec` (the spec's fields, from the CRD's schema) and where `download` says the adapter is."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from sqlmodel import Session, select

from tests.api.conftest import ADMIN, TRAIN, VALIDATION, Server, tiny_spec
from tunewright_api.cli import main
from tunewright_api.models import Job, Tenant


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow  # starts an API and a Ray cluster, and trains a tiny model (a minute or more here)
def test_train_runs_a_spec_file_to_a_downloaded_adapter_and_leaves_the_job_to_serve(tiny_models, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_models["gpt2"], str(TRAIN), str(VALIDATION), maxSteps=3)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEWRIGHT_")}  # serve's defaults
    tunewright = Path(sys.executable).with_name("tunewright")
    done = subprocess.run([tunewright, "train", spec.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    job_id = re.search(r"submitted (ftjob-\w+): local pool", out).group(1)
    assert "succeeded [" in out and "step 3/3" in out  # the progress `submit --watch` shows
    assert f"job                {job_id} (succeeded)" in out and "validation loss    " in out  # the summary
    name, adapter = out.splitlines()[-1].split(maxsplit=1)  # last: the adapter's own folder, downloaded
    assert (name, Path(adapter)) == ("adapter", tmp_path / job_id / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in Path(adapter).iterdir()}
    with pytest.raises(httpx.TransportError):  # the API it started is down
        httpx.get(re.search(r"dashboard +(http://127\.0\.0\.1:\d+)/ui/", out).group(1) + "/healthz")

    # serve's default data folder holds the job: a later server lists it to the token train kept there
    data_dir = tmp_path / ".tunewright"
    assert {"admin.token", "local.token", "tunewright.db"} <= {p.name for p in data_dir.iterdir()}
    with Server(data_dir, local_ray=False) as later, later.client((data_dir / "local.token").read_text()) as local:
        listed = local.get("/v1/jobs").json()["data"]
    assert [(j["id"], j["status"]) for j in listed] == [(job_id, "succeeded")]


@pytest.mark.slow  # trains a tiny model on an API started here
def test_train_beside_a_running_serve_submits_to_it_and_leaves_it_up(tiny_models, tmp_path, monkeypatch, capsys):
    """Two APIs on one data folder would each schedule its jobs: `train` finds the folder's API and uses it."""
    data_dir = tmp_path / "data"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNEWRIGHT_DATA_DIR", str(data_dir))
    monkeypatch.setenv("TUNEWRIGHT_ADMIN_TOKEN", ADMIN)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(tiny_spec(tiny_models["gpt2"], str(TRAIN), maxSteps=2)))
    with Server(data_dir, local_ray=False) as serve:
        code, out, err = run(capsys, "train", "job.yaml")
        assert code == 0, out + err
        assert out.startswith(f"using the API already serving {data_dir} at {serve.url}\n")
        job_id = re.search(r"submitted (ftjob-\w+): local pool", out).group(1)
        assert f"dashboard          {serve.url}/ui/#token=" in out and "the API has stopped" not in out
        assert httpx.get(f"{serve.url}/healthz").status_code == 200  # still up
        with serve.client((data_dir / "local.token").read_text()) as local:
            assert local.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    assert (tmp_path / job_id / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize(("mistake", "says"), [
    ({"hyperparameters": {"learningRate": -1}}, "hyperparameters.learningRate: Input should be greater than 0"),
    ({"hyperparameters": {"learningRte": 1e-4}}, "hyperparameters.learningRte: unknown key; did you mean "
                                                 "learningRate?"),
    ({"dataset": {"train": "trian.jsonl"}}, "dataset.train: no file trian.jsonl here"),
])
def test_train_refuses_a_wrong_spec_before_starting_anything(tiny_models, tmp_path, monkeypatch, capsys, mistake,
                                                            says):
    """Exit 2, the field named, and no API started: serve's data folder is not even made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNEWRIGHT_DATA_DIR", raising=False)
    spec = tiny_spec(tiny_models["gpt2"], str(TRAIN))
    for section, fields in mistake.items():
        spec[section].update(fields)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    code, out, err = run(capsys, "train", "job.yaml")
    assert (code, out) == (2, "") and err.startswith("error: job.yaml: ") and says in err, err
    assert not (tmp_path / ".tunewright").exists()


def test_explain_spec_lists_the_top_level_fields(capsys):
    code, out, _ = run(capsys, "explain-spec")
    assert code == 0 and out.startswith("FineTuneJob spec: What to fine-tune")
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line and not line.startswith("(")}
    assert list(rows)[1:] == ["model", "method", "dataset", "hyperparameters", "resources", "checkpoint",
                              "evaluation", "suspend"]
    assert rows["model"].endswith("The model to start from. (required)")
    assert re.fullmatch(r"suspend +boolean +false +Hold the job without running it\.", rows["suspend"])


def test_explain_spec_says_a_fields_type_default_bounds_and_description(capsys):
    code, out, _ = run(capsys, "explain-spec", "hyperparameters.learningRate")
    assert code == 0 and out.splitlines() == ["hyperparameters.learningRate", "type:         number",
                                              "default:      0.0002", "bounds:       > 0, <= 1",
                                              "description:  Peak learning rate."]
    code, out, _ = run(capsys, "explain-spec", "method.type")
    assert "bounds:       one of lora, full" in out and "default:      lora" in out
    code, out, _ = run(capsys, "-o", "json", "explain-spec", "hyperparameters.seqLen")  # the CRD's own schema
    assert json.loads(out) == {"default": 2048, "description": "Tokens per packed sequence (at most the model's "
                               "positions).", "minimum": 0, "exclusiveMinimum": True, "maximum": 1048576,
                               "type": "integer"}


def test_explain_spec_of_an_object_adds_its_rules_and_fields(capsys):
    code, out, _ = run(capsys, "explain-spec", "hyperparameters")
    assert code == 0 and "type:         object" in out and "description:  Optimization." in out
    assert "rules:        set globalBatchSize or globalBatchTokens, not both" in out  # the CRD's CEL rules
    assert re.search(r"^learningRate +number +0\.0002 +Peak learning rate\.$", out, re.MULTILINE)
    code, out, _ = run(capsys, "explain-spec", "dataset.train")
    assert out.startswith("dataset.train (required)\n")


@pytest.mark.parametrize(("path", "says"), [
    ("hyperparameters.learningRte", "did you mean hyperparameters.learningRate?"),
    ("learningRate", "did you mean hyperparameters.learningRate?"),  # a field at the wrong level
    ("budget", "did you mean resources.budgetUSD?"),
    ("method.type.foo", "method.type is a single value (string), with no fields"),
    ("optimizer", "the fields at the top are: model, method, dataset, hyperparameters, resources"),
])
def test_explain_spec_of_an_unknown_field_is_a_usage_error_with_what_it_meant(capsys, path, says):
    code, out, err = run(capsys, "explain-spec", path)
    assert (code, out) == (2, "") and err.startswith(f"error: explain-spec: the FineTuneJob spec has no field {path}; ")
    assert says in err, err


def test_download_says_the_folder_that_holds_the_adapter(server, tiny_models, tmp_path, capsys):
    """stdout keeps the folder the files went to (scripts read it); the adapter's own folder, the one to load,
    is named beside it (stderr) and in -o json."""
    with server.client() as admin:
        token = admin.post("/v1/tokens", json={"tenant": "carol"}).json()["token"]
    with Session(server.app.state.engine) as session:  # a succeeded job, its export where the local backend puts it
        carol = session.exec(select(Tenant).where(Tenant.name == "carol")).one()
        job = Job(tenant_id=carol.id, status="succeeded", model=str(tiny_models["gpt2"]), spec={})
        job.run_dir = str(server.settings.data_dir.resolve() / "jobs" / job.id)
        exported = Path(job.run_dir) / "output" / "final" / "adapter"
        exported.mkdir(parents=True)
        (exported / "adapter_config.json").write_text("{}")
        shutil.copy(tiny_models["gpt2"] / "tokenizer.json", exported)
        job.result = {"export": {"adapter": str(exported)}}
        job_id = job.id
        session.add(job)
        session.commit()
    user = ["--url", server.url, "--token", token]
    code, out, err = run(capsys, *user, "download", job_id, "--dir", tmp_path / "got")
    adapter = tmp_path / "got" / "adapter"
    assert code == 0 and out == f"{adapter}\n" and err == ""  # the folder to load (issue 37)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "tokenizer.json").is_file()
    code, out, err = run(capsys, *user, "-o", "json", "download", job_id, "--dir", tmp_path / "again")
    assert json.loads(out) == {"job": job_id, "dir": str(tmp_path / "again"),
                               "adapter": str(tmp_path / "again" / "adapter")} and err == ""


def test_every_command_is_one_function_the_parser_names():
    """Dispatch is the parser's: each command names its function, so a command cannot be parsed and not run."""
    from tunewright_api.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps them only here)
    for name, sub in commands.items():
        assert sub.get_default("func").__name__ == "cmd_" + name.replace("-", "_"), name
