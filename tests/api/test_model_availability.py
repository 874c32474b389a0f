"""A hub model that cannot be had is refused at submit, in a second, naming the model, where it was looked
for and what to do (issue 37): this machine's Hugging Face cache first, then one bounded request to the hub;
on a cluster only a hub that says the model does not exist refuses it (the workers fetch it themselves)."""

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import TRAIN, Server, tiny_spec, upload
from tunewright_api.services import hub


def cached(cache: Path, name: str) -> None:
    snapshot = cache / f"models--{name.replace('/', '--')}" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


@pytest.mark.parametrize(("env", "expected"), [
    ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, Path("/c/hub")),
    ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, Path("/h/hub")),
    ({"XDG_CACHE_HOME": "/x"}, Path("/x/huggingface/hub")),
    ({}, Path.home() / ".cache" / "huggingface" / "hub"),
])
def test_the_cache_is_where_huggingface_hub_keeps_it(env, expected):
    assert hub.cache_folder(env) == expected


def answering(status: int, seen: list | None = None) -> httpx.Client:
    def respond(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status)
    return httpx.Client(transport=httpx.MockTransport(respond))


@pytest.mark.parametrize(("status", "found", "missing", "says"), [
    (200, True, False, "on the hub (https://huggingface.co)"),
    (302, True, False, "on the hub"),
    (404, False, True, "has no model org/model at main (HTTP 404)"),
    (401, False, False, "refuses it without access (HTTP 401: a gated or private model"),
    (403, False, False, "HF_TOKEN"),
    (500, False, False, "answered HTTP 500"),
])
def test_the_hub_is_asked_for_the_model_s_config(status, found, missing, says):
    seen = []
    got = hub.on_hub("org/model", {"HF_TOKEN": "hf_secret"}, answering(status, seen))
    assert (got.found, got.missing) == (found, missing) and says in got.said
    (request,) = seen
    assert request.method == "HEAD" and str(request.url) == "https://huggingface.co/org/model/resolve/main/config.json"
    assert request.headers["Authorization"] == "Bearer hf_secret"


def test_the_hub_is_not_asked_offline_nor_where_the_model_is_cached(tmp_path):
    seen = []
    assert "HF_HUB_OFFLINE" in hub.on_hub("org/model", {"HF_HUB_OFFLINE": "1"}, answering(200, seen)).said
    cached(tmp_path, "org/model")
    got = hub.availability("org/model", {"HF_HUB_CACHE": str(tmp_path)}, answering(404, seen))
    assert got.found and str(tmp_path) in got.said and seen == []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: a connection is refused at once


@pytest.mark.parametrize(("status", "runs_here", "refused"), [
    ("unreachable", True, "could not be reached"),
    ("unreachable", False, None),  # a cluster's workers may reach it
    ("missing", True, "has no model"),
    ("missing", False, "has no model"),
])
def test_what_is_refused_where(tmp_path, status, runs_here, refused):
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
           "HF_TOKEN_PATH": str(tmp_path / "no-token")}
    client = answering(404) if status == "missing" else None
    why = hub.refusal("hf://org/model", hub.availability("org/model", env, client), runs_here)
    if refused is None:
        assert why is None
        return
    assert why.startswith("model hf://org/model cannot be had: not in this machine's Hugging Face cache")
    assert refused in why and str(tmp_path) in why and "To fix:" in why


@pytest.fixture
def quiet_server(tmp_path, monkeypatch):
    """The local backend with no hub to reach and an empty cache; nothing is launched."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as s:
        yield s


def test_a_hub_model_this_machine_cannot_have_is_refused_at_submit_in_a_second(quiet_server, tmp_path):
    alice = quiet_server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    started = time.monotonic()
    refused = alice.post("/v1/jobs", json=tiny_spec("Qwen/Qwen2.5-0.5B-Instruct", train))
    assert time.monotonic() - started < 2
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "model.source" and error["code"] == "model_not_found"
    assert "Qwen/Qwen2.5-0.5B-Instruct" in error["message"] and str(tmp_path / "hf-cache") in error["message"]
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in error["message"]
    # the OpenAI-compatible route, at job creation as OpenAI does
    openai = alice.post("/v1/fine_tuning/jobs", json={"model": "Qwen/Qwen2.5-0.5B-Instruct", "training_file": train})
    assert openai.status_code == 400 and "cannot be had" in openai.text
    cached(tmp_path / "hf-cache", "Qwen/Qwen2.5-0.5B-Instruct")  # once cached, accepted
    assert alice.post("/v1/jobs", json=tiny_spec("Qwen/Qwen2.5-0.5B-Instruct", train)).status_code == 201


def test_a_hub_that_does_not_answer_in_time_is_not_waited_for(monkeypatch):
    """A name lookup is not bounded by httpx's timeout: the request is given up at the deadline."""
    monkeypatch.setattr(hub, "HUB_TIMEOUT_SECONDS", 0.1)

    def hang(request: httpx.Request) -> httpx.Response:
        time.sleep(2)
        return httpx.Response(200)

    started = time.monotonic()
    got = hub.on_hub("org/model", {}, httpx.Client(transport=httpx.MockTransport(hang)))
    assert time.monotonic() - started < 1 and not got.found and "did not answer within 0.1 s" in got.said


def test_the_revision_is_asked_for_and_a_saved_login_is_used(tmp_path):
    seen = []
    (tmp_path / "token").write_text("hf_saved\n")
    hub.on_hub("org/model", {"HF_HOME": str(tmp_path)}, answering(200, seen), revision="v1.0/rc")
    (request,) = seen
    assert str(request.url).endswith("/org/model/resolve/v1.0%2Frc/config.json")
    assert request.headers["Authorization"] == "Bearer hf_saved"


def test_a_404_to_an_authenticated_question_refuses_only_where_the_run_is_here(tmp_path):
    """With a token, a 404 may be another account's private model: a cluster's workers may hold access."""
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_TOKEN": "hf_mine"}
    found = hub.availability("org/private", env, answering(404))
    assert found.missing and found.authenticated
    assert hub.refusal("org/private", found, runs_here=False) is None
    assert "has no model org/private at main" in hub.refusal("org/private", found, runs_here=True)
