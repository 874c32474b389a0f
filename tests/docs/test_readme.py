"""The README's commands, run as written: a fresh folder holding the checkout's examples and virtualenv,
the commands of a block fenced `bash train`, `bash quickstart` or `bash plan`, in order, in one bash. Only
the port differs (the machine is shared: the API gets a free one, and TUNEWRIGHT_URL points the CLI at it)."""

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def block(name: str) -> str:
    blocks = re.findall(rf"```bash {name}\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert len(blocks) == 1, f"the README has one `bash {name}` block"
    return blocks[0]


def quickstart() -> str:
    return block("quickstart")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_written(script: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`script` in one bash in `folder` (beside the checkout's examples and virtualenv), stopping at the
    first failing command; the API it started in the background is stopped whatever happens."""
    for name in ("examples", ".venv"):
        (folder / name).symlink_to(ROOT / name)
    env = {**os.environ, **env, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(["bash", "-c", "set -euo pipefail\ntrap 'kill %1 2>/dev/null || true' EXIT\n" + script],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=900)


def log_of(done: subprocess.CompletedProcess, folder: Path) -> str:
    serve_log = folder / "serve.log"
    return f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n" + (serve_log.read_text()[-2000:]
                                                               if serve_log.exists() else "")


def test_the_quickstart_block_is_what_the_test_runs():
    script = quickstart()
    for command in ("tunewright serve", "tunewright submit examples/local/lora-chat.yaml --watch",
                    "tunewright download $JOB", "python examples/local/generate.py"):
        assert command in script


@pytest.mark.slow  # trains the quickstart's job (one to two minutes on 2 cores)
def test_the_readme_quickstart_runs_as_written(tmp_path):
    port = free_port()
    script = quickstart().replace("tunewright serve ", f"tunewright serve --port {port} ")
    env = {"TUNEWRIGHT_URL": f"http://127.0.0.1:{port}"}
    done = run_as_written(script, tmp_path, env | {"TUNEWRIGHT_TOKEN": ""})
    assert done.returncode == 0, log_of(done, tmp_path)
    answer = done.stdout.strip().splitlines()[-1]
    assert answer == "negative", done.stdout[-2000:]  # the answer, and nothing after it: generation stopped
    assert "succeeded [" in done.stdout and (tmp_path / "my-adapter" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow  # trains the quickstart's job through `tunewright train` (one to two minutes on 2 cores)
def test_the_readme_one_command_path_runs_as_written(tmp_path):
    """Issue 37: from `make venv` to a trained, downloaded, loaded adapter with one `tunewright train`."""
    script = block("train")
    assert "tunewright train examples/local/lora-chat.yaml" in script and "tunewright serve" not in script
    done = run_as_written(script, tmp_path, {"TUNEWRIGHT_TOKEN": "", "TUNEWRIGHT_URL": ""})
    assert done.returncode == 0, log_of(done, tmp_path)
    assert done.stdout.strip().splitlines()[-1] == "negative", done.stdout[-2000:]
    assert (tmp_path / "my-adapter" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / ".tunewright" / "tunewright.db").is_file()  # where a later `tunewright serve` finds the job


@pytest.mark.slow  # starts the API in a fresh shell
def test_the_readme_plan_runs_as_written(tmp_path):
    """Describe a pool, then plan the cluster example on it: the block as written, with an admin token."""
    port = free_port()
    admin = "readme-admin-token"
    serve = (f"source .venv/bin/activate\nTUNEWRIGHT_ADMIN_TOKEN={admin} tunewright serve --port {port} > serve.log "
             "2>&1 &\ntunewright status --wait 60\n")
    done = run_as_written(serve + block("plan"), tmp_path,
                          {"TUNEWRIGHT_URL": f"http://127.0.0.1:{port}", "TUNEWRIGHT_TOKEN": admin})
    assert done.returncode == 0, log_of(done, tmp_path)
    assert "h100" in done.stdout and "plan:" in done.stdout and "predicted:" in done.stdout, done.stdout
