"""One local API per data folder (backends.local_folder): the API that starts holds the folder's lock for its
life and says where it answers; another `serve` on the folder is refused, naming it; `tunewright train` uses it."""

import json
import os

import pytest

from tunewright_api.backends.local_folder import RECORD_FILE, FolderServed, claim, release, serving_url
from tunewright_api.cli import main, reachable_url
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
    try:
        assert json.loads((tmp_path / RECORD_FILE).read_text()) == {"pid": os.getpid(), "url": "http://127.0.0.1:8124"}
        assert serving_url(tmp_path) == "http://127.0.0.1:8124"
    finally:
        release(tmp_path, lock)


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
                                           ("::", "http://[::1]:8000"), ("fe80::1", "http://[fe80::1]:8000"),
                                           ("box.lan", "http://box.lan:8000")])
def test_the_recorded_address_is_one_to_reach_the_server_at(host, url):
    assert reachable_url(host, 8000) == url


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
    admin = {"Authorization": "Bearer tw-admin-test"}
    with TestClient(create_app(settings)) as first:
        assert first.get("/healthz").status_code == 200 and serving_url(tmp_path) == "http://127.0.0.1:8126"
        another = settings.model_copy(update={"public_url": "http://127.0.0.1:8127", "admin_token": "tw-other"})
        with pytest.raises(FolderServed, match="is served by another tunewright API"), \
                TestClient(create_app(another)):
            pass
        # refused before it touched the folder: the first API's admin token still works (bootstrapping another
        # admin token replaces the previous one)
        assert first.post("/v1/tokens", json={"tenant": "t"}, headers=admin).status_code == 201
    assert serving_url(tmp_path) is None
    with TestClient(create_app(settings)) as again:
        assert again.get("/healthz").status_code == 200


def test_train_on_a_served_folder_says_when_that_api_has_another_admin_token(tmp_path):
    from tests.api.conftest import Server
    from tunewright_api.cli.client import RequestFailed
    from tunewright_api.cli.local import LocalApi

    with Server(tmp_path / "data", local_ray=False) as serve:
        attached = LocalApi(tmp_path / "data", "tw-not-its-token", tmp_path / "api.log", serving=serving_url(tmp_path / "data"))
        with pytest.raises(RequestFailed, match=(rf"the API serving {tmp_path / 'data'} at {serve.url} was started with "
                                                 r"another admin token than this command has: give this command that "
                                                 r"one \(TUNEWRIGHT_ADMIN_TOKEN\)")), attached:
            pass


def test_the_demo_refuses_to_restart_a_folder_an_api_serves(tmp_path, monkeypatch, capsys):
    from tunewright_api import demo

    (tmp_path / "api").mkdir()
    lock = claim(tmp_path / "api", "http://127.0.0.1:8128")
    monkeypatch.setattr("sys.argv", ["demo", "--out", str(tmp_path)])
    try:
        assert demo.main() == 1
        assert (tmp_path / "api" / RECORD_FILE).exists()  # nothing of the folder was removed
    finally:
        release(tmp_path / "api", lock)
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'api'} is served by the API at http://127.0.0.1:8128")
