"""A real API server (uvicorn on a loopback port, in this process) over SQLite, and clients per tenant."""

import json
import os
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml

from tests.api.postgres import PostgresServer
from tunewright_api.main import create_app
from tunewright_api.settings import Settings
from tunewright_jobs.tiny import DATA_DIR

ADMIN = "tw-admin-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, port: int | None = None, **settings):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = Settings(**{"data_dir": data_dir, "admin_token": ADMIN, "public_url": self.url, **settings})
        self.app = create_app(self.settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "API did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def client(self, token: str | None = ADMIN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def tenant(self, name: str) -> httpx.Client:
        with self.client() as admin:
            response = admin.post("/v1/tokens", json={"tenant": name})
        assert response.status_code == 201, response.text
        return self.client(response.json()["token"])


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    pg = PostgresServer(Path(tempfile.mkdtemp(prefix="tunewright-pg-")))
    if not pg.available:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries are missing: .ci/run must install Debian's postgresql")
        pytest.skip("PostgreSQL is not installed on this machine")
    pg.start()
    yield pg
    pg.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """The same API suite runs on SQLite (the default) and on a real PostgreSQL server."""
    if request.param == "sqlite":
        return None
    pg = request.getfixturevalue("postgres")
    return pg.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def server(tmp_path, database_url):
    with Server(tmp_path / "data", local_ray=False, database_url=database_url) as s:
        yield s


@pytest.fixture
def emulated_cluster(monkeypatch, tmp_path):
    """An emulated API server holding the KubeRay and tunewright CRDs and the example GPUPool (default), as
    the API's kubernetes backend finds it through KUBECONFIG."""
    from tests.support.emulated import ROOT, client_for, crds_installed

    emulator = crds_installed().start()
    monkeypatch.setenv("KUBECONFIG", str(emulator.write_kubeconfig(tmp_path / "kubeconfig")))
    client_for(emulator).create(yaml.safe_load((ROOT / "examples" / "cluster" / "gpupool-h100.yaml").read_text()))
    yield emulator
    emulator.stop()


@pytest.fixture(params=["local", "kubernetes"])
def backend_server(request, tmp_path):
    """The same API tests on both backends: this machine, and a cluster (FineTuneJobs for the operator)."""
    if request.param == "local":
        with Server(tmp_path / "data", local_ray=False) as s:
            yield s
        return
    request.getfixturevalue("emulated_cluster")
    with Server(tmp_path / "data", backend="kubernetes", kubernetes_sync_seconds=0.3,
                kubernetes_checkpoint_storage="pvc://tunewright-checkpoints") as s:
        yield s


def upload(client: httpx.Client, path: Path, name: str | None = None) -> httpx.Response:
    with path.open("rb") as fh:
        return client.post("/v1/files", files={"file": (name or path.name, fh)}, data={"purpose": "fine-tune"})


def tiny_spec(model_dir: Path, train_id: str, validation_id: str | None = None, **hyper) -> dict:
    return {
        "model": {"source": str(model_dir)},
        "method": {"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "dataset": {"train": train_id, "validation": validation_id, "format": "chat"},
        "hyperparameters": {"maxSteps": 10, "learningRate": 5e-3, "globalBatchSize": 4, "seqLen": 128, **hyper},
        "checkpoint": {"everySteps": 5},
    }


def wait_for(client: httpx.Client, job_id: str, statuses: set[str], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, json.dumps(job)[:2000]
        time.sleep(0.3)


TRAIN, VALIDATION = DATA_DIR / "train.jsonl", DATA_DIR / "validation.jsonl"
