"""The CLI against a real API: the newcomer's path from a spec file to a downloaded adapter, its errors (one
line on stderr, naming the field and the fix), exit codes, output formats, pipes and completion."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.api.conftest import ADMIN, TRAIN, VALIDATION, tiny_spec
from tunewright_api.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def user(server, capsys):
    code, out, _ = run(capsys, "--url", server.url, "--token", ADMIN, "-o", "json", "tokens", "create", "carol")
    assert code == 0
    return ["--url", server.url, "--token", json.loads(out)["token"]]


@pytest.mark.slow  # trains a job (over 10 s here)
def test_from_a_spec_file_to_a_downloaded_adapter(server, user, tiny_models, tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
                                    "metadata": {"name": "x"},
                                    "spec": tiny_spec(tiny_models["gpt2"], str(TRAIN), str(VALIDATION), maxSteps=4)}))
    code, out, _ = run(capsys, *user, "submit", spec, "--watch")  # uploads the local files, then watches
    assert code == 0 and "submitted ftjob-" in out and "succeeded [" in out and "step 4/4" in out
    assert re.search(r"succeeded \[.*comm \d+% \(\d+% exposed\)", out)  # the measured share, on the last line
    job_id = re.search(r"submitted (ftjob-\w+)", out).group(1)

    # the same files again: found by their checksum, not uploaded a second time
    assert run(capsys, *user, "submit", spec, "--max-steps", "2")[0] == 0
    code, out, _ = run(capsys, *user, "-o", "json", "files", "list")
    assert sorted(f["filename"] for f in json.loads(out) if f["purpose"] == "fine-tune") == ["train.jsonl",
                                                                                              "validation.jsonl"]
    code, out, _ = run(capsys, *user, "jobs", "--status", "succeeded")
    assert code == 0 and out.startswith("ID") and job_id in out and "succeeded" in out
    code, out, _ = run(capsys, *user, "get", job_id)
    assert f"download:  tunewright download {job_id}" in out and "adapter:" in out
    code, out, _ = run(capsys, *user, "events", job_id, "--all")
    lines = out.splitlines()
    assert "queued; plan" in lines[0] and lines[-1].endswith("succeeded")  # oldest first, nothing lost
    code, out, _ = run(capsys, *user, "-o", "json", "metrics", job_id)
    assert [p["step"] for p in json.loads(out)] == [1, 2, 3, 4]
    code, out, _ = run(capsys, *user, "-o", "yaml", "checkpoints", job_id)
    assert yaml.safe_load(out)[0]["stepNumber"] == 4
    code, out, _ = run(capsys, *user, "logs", job_id, "-n", "3")
    assert code == 0 and len(out.splitlines()) == 3
    code, out, _ = run(capsys, *user, "logs", job_id, "-f")  # a finished job: its log, then the command ends
    assert code == 0 and out.strip()

    # downloaded, and loaded as a user would: PEFT on the base model, with the exported tokenizer
    code, out, _ = run(capsys, *user, "download", job_id, "--dir", tmp_path / "got")
    adapter = tmp_path / "got" / "adapter"
    assert code == 0 and out.strip() == str(adapter) and (adapter / "adapter_config.json").is_file()
    assert not list((tmp_path / "got").rglob("*.partial"))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]), adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    assert model.generate(**tokenizer("hello", return_tensors="pt"), max_new_tokens=2).shape[-1] >= 2

    code, out, _ = run(capsys, *user, "delete", job_id)
    assert code == 0 and out.strip() == f"deleted {job_id}"
    code, _, err = run(capsys, *user, "get", job_id)
    assert code == 1 and err.strip() == f"error: 404: job_id: no job {job_id}"


def test_errors_are_one_line_naming_the_field_and_the_fix(server, user, tiny_models, tmp_path, capsys):
    gpt2 = str(tiny_models["gpt2"])
    code, _, err = run(capsys, *user, "submit", "--model", gpt2, "--train", tmp_path / "capitals_trian.jsonl")
    assert code == 1 and err.count("\n") == 1
    assert "dataset.train: no file" in err and "capitals_trian.jsonl" in err and "tunewright files list" in err
    code, _, err = run(capsys, *user, "submit", "--model", tmp_path / "no-model", "--train", TRAIN)
    assert code == 1 and "model.source: no model folder" in err
    # two mistakes in one spec: both named, each path once
    spec = tmp_path / "bad.yaml"
    bad = tiny_spec(tiny_models["gpt2"], str(TRAIN))
    bad["method"]["lora"]["rank"] = 8
    bad["hyperparameters"]["learningRate"] = -1
    spec.write_text(yaml.safe_dump(bad))
    code, _, err = run(capsys, *user, "submit", spec)
    assert code == 1 and err.count("\n") == 1
    assert "method.lora.rank: unknown key; the keys here are: r, alpha, dropout, targetModules" in err
    assert "hyperparameters.learningRate" in err
    assert err.count("method.lora.rank") == 1
    # the refused submit left none of its uploads behind
    assert json.loads(run(capsys, *user, "-o", "json", "files", "list")[1]) == []
    code, _, err = run(capsys, "--url", server.url, "--token", "wrong", "jobs")
    assert code == 1 and "401: invalid token (give a token with --token or TUNEWRIGHT_TOKEN" in err
    code, _, err = run(capsys, "--url", "http://127.0.0.1:9", "jobs")
    assert code == 3 and "cannot reach the API at http://127.0.0.1:9" in err
    code, _, err = run(capsys, *user, "plan", "--model", "meta-llama/Llama-3.1-8B", "--pool", "nope")
    assert code == 2 and "give a spec file" in err  # usage: exit 2


def test_a_misspelt_key_in_a_spec_file_is_answered_with_the_key_it_meant(server, user, tmp_path, capsys):
    spec = tmp_path / "typo.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec("Qwen/Qwen2.5-0.5B", "file-" + "0" * 24, learningRte=1e-4)))
    code, _, err = run(capsys, *user, "submit", spec)
    assert code == 1 and err == "error: 422: hyperparameters.learningRte: unknown key; did you mean learningRate?\n"


def test_lists_say_when_they_are_empty_and_plans_name_the_flag(server, user, tmp_path, capsys):
    code, out, err = run(capsys, *user, "jobs")
    assert code == 0 and out == "" and err.strip() == "No jobs."
    code, out, _ = run(capsys, *user, "-o", "json", "jobs")
    assert json.loads(out) == []
    code, out, _ = run(capsys, "--url", server.url, "--token", ADMIN, "pools", "create", "h100x8", "--gpu", "H100",
                       "--gpus-per-node", "8", "--max-nodes", "2", "--intra-node", "nvlink4", "--inter-node",
                       "ib-8x400g", "--price", "2.5", "--host-memory-gib", "2048")
    assert code == 0 and "h100x8" in out and "nvlink4 / ib-8x400g" in out
    code, out, _ = run(capsys, *user, "pools", "get", "h100x8")
    assert code == 0 and "$2.50" in out
    code, out, _ = run(capsys, *user, "pools", "get", "h100x8", "-o", "json")  # -o after the command as well
    assert code == 0 and json.loads(out)["hostMemoryGiB"] == 2048 and json.loads(out)["learnLinks"] is False
    code, out, _ = run(capsys, *user, "files", "upload", TRAIN, "-o", "json", VALIDATION)  # and between targets
    assert code == 0 and [f["filename"] for f in json.loads(out)] == ["train.jsonl", "validation.jsonl"]
    code, out, _ = run(capsys, *user, "files", "upload", TRAIN, "-o", "json", "--", VALIDATION)
    assert code == 0 and [f["filename"] for f in json.loads(out)] == ["train.jsonl", "validation.jsonl"]
    with pytest.raises(SystemExit) as refused:  # argparse's own exit, as for every usage error it finds
        run(capsys, *user, "files", "list", "--bogus")
    assert refused.value.code == 2 and "tunewright: error: unrecognized arguments: --bogus" in \
        capsys.readouterr().err
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"model": {"source": "meta-llama/Llama-3.1-8B-Instruct"},
                                "dataset": {"train": "file-" + "0" * 24}}))
    code, _, err = run(capsys, *user, "plan", spec, "--pool", "h100x8")  # an instruct variant of a catalog model
    assert code == 1 and "maxSteps: needed when the dataset's size is unknown (give --dataset-tokens N" in err
    code, out, _ = run(capsys, *user, "plan", spec, "--pool", "h100x8", "--dataset-tokens", "2000000")
    assert code == 0 and "on pool h100x8" in out and "predicted:" in out
    # the band, and what it extrapolates from (LoRA on several GPUs: every published run is full fine-tuning)
    assert "likely:" in out and "(P10-P90)" in out and "band:      P10-P90 from" in out


def test_version_completion_and_pipes(server, user):
    cli = [sys.executable, "-m", "tunewright_api.cli"]
    assert subprocess.run([*cli, "--version"], capture_output=True, text=True).stdout.startswith("tunewright 0.")
    script = subprocess.run([*cli, "completion", "bash"], capture_output=True, text=True).stdout
    completed = subprocess.run(["bash", "-c", script + "\nCOMP_WORDS=(tunewright jo); COMP_CWORD=1; _tunewright; "
                                "echo ${COMPREPLY[@]}; COMP_WORDS=(tunewright logs ftjob-1 --fo); COMP_CWORD=3; "
                                "_tunewright; echo ${COMPREPLY[@]}"], capture_output=True, text=True)
    assert completed.stdout.split("\n")[:2] == ["jobs", "--follow"], completed
    # a reader that leaves before the output is written (`| head`) is no error
    env = {**os.environ, "TUNEWRIGHT_URL": server.url, "TUNEWRIGHT_TOKEN": user[-1]}
    proc = subprocess.Popen([*cli, "-o", "yaml", "pools", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


@pytest.mark.slow  # trains a job (over 10 s here)
def test_a_small_dataset_trains_with_the_defaults(server, user, tiny_models, tmp_path, capsys):
    """150 examples and no sizes given: the sizes follow from the data instead of failing in the queue; sizes
    the data cannot fill are refused at once, with what would fit."""
    small = tmp_path / "mine.jsonl"
    small.write_text("".join(TRAIN.read_text().splitlines(keepends=True)[:150]))
    code, out, err = run(capsys, *user, "submit", "--model", tiny_models["gpt2"], "--train", small, "--max-steps",
                         "3", "--watch")
    assert code == 0, err
    job_id = re.search(r"submitted (ftjob-\w+)", out).group(1)
    code, out, _ = run(capsys, *user, "-o", "json", "get", job_id)
    hyper = json.loads(out)["spec"]["hyperparameters"]
    assert hyper["seqLen"] == 128 and "globalBatchSize" not in hyper  # 150 examples fill batches of 16
    code, out, _ = run(capsys, *user, "events", job_id)
    assert "sized from the data: seqLen 128" in out
    code, _, err = run(capsys, *user, "submit", "--model", tiny_models["gpt2"], "--train", small, "--batch-size",
                       "4096")
    assert code == 1 and "hyperparameters.globalBatchSize: at most " in err and "sequences a step, not 4096" in err
    assert "one epoch (150 examples) holds about" in err


@pytest.mark.slow  # starts a run (over 10 s here)
def test_a_watched_job_that_fails_says_why_in_one_line(server, user, tiny_models, tmp_path, capsys):
    """A model folder whose config.json is fine but whose weights are missing passes the submit and fails in
    the run: `submit --watch` exits 1 with the run's reason on one line and where its output is."""
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_models["gpt2"], broken, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    code, out, err = run(capsys, *user, "submit", "--model", broken, "--train", TRAIN, "--max-steps", "2", "--watch")
    job_id = re.search(r"submitted (ftjob-\w+)", out).group(1)
    assert code == 1 and re.search(r"^failed +\[", out, re.MULTILINE), out
    first, second = err.splitlines()
    assert first.startswith(f"error: job {job_id} failed: OSError: Error no file named model.safetensors")
    assert len(first) < 400 and "Traceback" not in err  # the reason, not torchrun's report that follows it
    assert second.strip() == f"the run's output: tunewright logs {job_id}"


@pytest.mark.parametrize(("content", "says"), [(None, "no such file (give the path of a spec file"),
                                               ("model: [unclosed", "while parsing a flow sequence")])
def test_a_spec_file_that_cannot_be_read_is_a_usage_error(capsys, tmp_path, content, says):
    """Exit 2 (the command line is wrong, as the README says), before any request: no API is needed."""
    spec = tmp_path / "job.yaml"
    if content is not None:
        spec.write_text(content)
    code, out, err = run(capsys, "--url", "http://127.0.0.1:9", "--token", "x", "submit", spec)
    assert (code, out) == (2, "") and err.startswith(f"error: {spec}: ") and says in err, err
