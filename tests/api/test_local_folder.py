"""One local API per data folder (backends.local_folder): the API that starts holds the folder's lock for its
life and says where it answers; another `serve` on the folder is refused, naming it; `tunewright train` uses it."""

import json
import os

import pytest

from tunewright_api.backends.local_folder import RECORD_FILE, FolderServed, claim, release, serving_url
from tunewright_api.cli import main
from tunewright_api.cli.client import REFUSED


def test_the_folder_is_claimed_once_and_says_where_its_api_answers(tmp_path):
    assert serving_url(tmp_path) is None
    lock = claim(tmp_path, "http://127.0.0.1:8123")
    try:
        assert serving_url(tmp_path) == "http://127.0.0.1:8123"
        assert (tmp_path / RECORD_FILE).stat().st_mode & 0o777 == 0o600
        with pytest.raises(FolderServed, match=(
                rf"the data folder {tmp_path} is served by another tunewright API \(process {os.getpid()} at "
                r"http://127.0.0.1:8123\): use it \(tunewright --url http://127.0.0.1:8123 ...\), or give this one "
                r"a folder of its own \(TUNEWRIGHT_DATA_DIR\)")):
            claim(tmp_path, "http://127.0.0.1:9000")
        assert serving_url(tmp_path) == "http://127.0.0.1:8123"  # the refused claim changed nothing
    finally:
        release(tmp_path, lock)
    assert serving_url(tmp_path) is None and not (tmp_path / RECORD_FILE).exists()


def test_a_record_left_by_a_killed_api_claims_nothing(tmp_path):
    """A killed API's lock went with its process; its record stays behind and is replaced."""
    (tmp_path / RECORD_FILE).write_text(json.dumps({"pid": 1, "url": "http://127.0.0.1:1"}))
    (tmp_path / "server.lock").touch()
    assert serving_url(tmp_path) is None
    lock = claim(tmp_path, "http://127.0.0.1:8124")
    release(tmp_path, lock)


def test_serve_refuses_a_folder_another_api_serves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TUNEWRIGHT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TUNEWRIGHT_BACKEND", raising=False)
    lock = claim(tmp_path, "http://127.0.0.1:8125")
    try:
        code = main(["serve", "--port", "0"])
    finally:
        release(tmp_path, lock)
    err = capsys.readouterr().err
    assert code == REFUSED and err.startswith(f"error: the data folder {tmp_path} is already served by the API at "
                                              "http://127.0.0.1:8125: use it (tunewright --url ...)"), err


def test_an_api_started_on_a_served_folder_refuses_to_start_and_one_that_stops_lets_it_go(tmp_path):
    """The claim the local backend makes as it starts (what holds when two start at once), and gives back as it
    stops: the next API on the folder starts."""
    from fastapi.testclient import TestClient

    from tunewright_api.main import create_app
    from tunewright_api.settings import Settings

    settings = Settings(data_dir=tmp_path, admin_token="tw-admin-test", public_url="http://127.0.0.1:8126",
                        local_ray=False)
    with TestClient(create_app(settings)) as first:
        assert first.get("/healthz").status_code == 200 and serving_url(tmp_path) == "http://127.0.0.1:8126"
        with pytest.raises(FolderServed, match="is served by another tunewright API"), \
                TestClient(create_app(settings.model_copy(update={"public_url": "http://127.0.0.1:8127"}))):
            pass
    assert serving_url(tmp_path) is None
    with TestClient(create_app(settings)) as again:
        assert again.get("/healthz").status_code == 200
