"""The `api` extra alone installs and starts the API: no numpy, torch or Ray in a fresh virtualenv.

The API image installs only that extra; what it needs of the runtime (the dataset validator) must run there.
"""

import os
import shutil
import subprocess
import time
import venv
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import ADMIN, TRAIN, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_api_extra_installs_and_serves_in_a_fresh_venv(tmp_path):
    source = tmp_path / "source"  # a copy: an install from the checkout would build in it
    for folder in ("api", "core", "jobs", "operator"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source / file)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{source}[api]"], capture_output=True,
                             text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    missing = subprocess.run([str(python), "-c", "import importlib.util as u; "
                              "print([m for m in ('numpy', 'torch', 'ray', 'transformers') if u.find_spec(m)])"],
                             capture_output=True, text=True, timeout=60)
    assert missing.stdout.strip() == "[]", "the api extra pulled in the runtime's dependencies"
    port = free_port()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TUNEWRIGHT_DATA_DIR": str(tmp_path / "data"),
           "TUNEWRIGHT_ADMIN_TOKEN": ADMIN}
    server = subprocess.Popen([str(env_dir / "bin" / "tunewright"), "serve", "--port", str(port)], env=env,
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {ADMIN}"},
                          timeout=30) as client:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, server.stdout.read()[-3000:]
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the API did not become ready in 60 s"
                time.sleep(0.3)
            with TRAIN.open("rb") as fh:  # the runtime's validator runs in the API's environment
                uploaded = client.post("/v1/files", files={"file": ("train.jsonl", fh)}, data={"purpose": "fine-tune"})
            assert uploaded.status_code == 200, uploaded.text
            assert uploaded.json()["format"] == "chat" and uploaded.json()["examples"] > 0
            assert client.get("/v1/pools").json()["data"][0]["name"] == "local"
    finally:
        server.terminate()
        server.wait(timeout=30)
