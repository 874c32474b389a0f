"""Datasets named by URL (an upload on the API, on a cluster) are fetched with the job's token, whole or not
at all, and a refusal says which dataset and what the server answered."""

import http.server
import threading

import pytest

from tunewright_jobs.config import JobConfig
from tunewright_jobs.dataset_files import DatasetError
from tunewright_jobs.remote_data import fetch, localize_datasets

BODY = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 50
TOKEN = "tw-job-token"


@pytest.fixture(scope="module")
def api():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "invalid telemetry token for this job"}}')
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/internal/jobs/ftjob-1/files"
    server.shutdown()


def config(tmp_path, train: str) -> JobConfig:
    return JobConfig.model_validate({
        "name": "job", "output_dir": str(tmp_path / "out"), "model": {"source": str(tmp_path)},
        "dataset": {"train": train}, "checkpoint": {"storage": str(tmp_path / "ckpt")},
        "hyperparameters": {"max_steps": 1, "global_batch_size": 1}})


def test_a_url_dataset_lands_on_the_shared_storage(api, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEWRIGHT_TELEMETRY_TOKEN", TOKEN)
    local = localize_datasets(config(tmp_path, f"{api}/file-1"))
    assert local.dataset.train == str(tmp_path / "out" / "data" / "train.jsonl")
    assert (tmp_path / "out" / "data" / "train.jsonl").read_bytes() == BODY
    assert not list((tmp_path / "out" / "data").glob(".*partial"))


def test_a_local_dataset_is_left_alone(tmp_path):
    cfg = config(tmp_path, str(tmp_path / "train.jsonl"))
    assert localize_datasets(cfg) is cfg


def test_a_refusal_names_the_dataset_and_the_answer_and_leaves_no_file(api, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEWRIGHT_TELEMETRY_TOKEN", "wrong")
    with pytest.raises(DatasetError, match=r"^dataset.train: .* answered 401: .*invalid telemetry token"):
        localize_datasets(config(tmp_path, f"{api}/file-1"))
    assert not list((tmp_path / "out" / "data").iterdir())


def test_a_dataset_over_the_bound_is_refused_whole(api, tmp_path):
    with pytest.raises(DatasetError, match="larger than 100 bytes"):
        fetch(f"{api}/file-1", tmp_path / "train.jsonl", TOKEN, "dataset.train", max_bytes=100)
    assert list(tmp_path.iterdir()) == []
