"""Requests at the edges: OpenAI's status for an invalid request, ids and paths no file or row can have, who
sees each job in /metrics, and what killed uploads leave behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from tests.api.conftest import ADMIN, TRAIN, Server, tiny_spec, upload
from tests.api.test_model_sources import exported_job
from tunewright_api.models import Job, Tenant
from tunewright_api.services.files import STALE_PARTIAL_SECONDS


def test_the_openai_routes_answer_an_invalid_request_with_400_as_openai_does(server, tiny_models):
    from openai import BadRequestError, OpenAI

    alice = server.tenant("alice")
    client = OpenAI(base_url=f"{server.url}/v1", api_key=alice.headers["Authorization"].removeprefix("Bearer "),
                    max_retries=0)
    train = upload(alice, TRAIN).json()["id"]
    invalid = [  # (call, the parameter the answer names)
        (lambda: client.fine_tuning.jobs.create(model=str(tiny_models["gpt2"]), training_file="train.jsonl"),
         "training_file"),  # the service's own check
        (lambda: client.fine_tuning.jobs.create(model=str(tiny_models["gpt2"]), training_file=train,
                                                extra_body={"budget_usd": -1}), "budget_usd"),  # the body's schema
        (lambda: client.fine_tuning.jobs.list(limit=0), "limit"),  # a query parameter
        (lambda: client.files.create(file=TRAIN.open("rb"), purpose="assistants"), "purpose"),
    ]
    for call, param in invalid:
        with pytest.raises(BadRequestError) as err:
            call()
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == param
        assert set(err.value.body) == {"message", "type", "param", "code"} and err.value.body["message"]
    # the native routes keep theirs
    spec = tiny_spec(tiny_models["gpt2"], train, learningRate=-1)
    native = alice.post("/v1/jobs", json=spec)
    assert native.status_code == 422 and native.json()["error"]["param"] == "hyperparameters.learningRate"


def test_a_misspelt_key_is_answered_with_the_key_it_meant_on_every_route_that_reads_a_spec(server):
    alice = server.tenant("alice")
    spec = tiny_spec(Path("models/tiny"), "file-" + "0" * 24, learningRte=1e-4)
    job = alice.post("/v1/jobs", json=spec)
    assert job.status_code == 422 and job.json()["error"]["param"] == "hyperparameters.learningRte"
    assert job.json()["error"]["message"] == "hyperparameters.learningRte: unknown key; did you mean learningRate?"
    del spec["hyperparameters"]["learningRte"]
    spec["method"]["lora"]["targetModule"] = ["q_proj"]
    plan = alice.post("/v1/plans", json={"spec": spec, "pool": "h100"})
    assert plan.status_code == 422 and plan.json()["error"]["param"] == "spec.method.lora.targetModule"
    assert plan.json()["error"]["message"] == ("spec.method.lora.targetModule: unknown key; did you mean "
                                               "targetModules?")
    openai = alice.post("/v1/fine_tuning/jobs", json={"model": "m", "training_file": "file-x", "lora": {"rnak": 8},
                                                      "max_stesp": 10})
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "lora.rnak"
    assert openai.json()["error"]["message"] == ("lora.rnak: unknown key; the keys here are: r, alpha, dropout, "
                                                 "target_modules, quantization; max_stesp: unknown key; did you mean "
                                                 "max_steps?")


def test_ids_and_paths_no_file_or_row_can_have_are_refused_naming_them(server, tiny_models):
    """A NUL or an over-long name never reaches the database or the filesystem (which fail, not answer)."""
    alice = server.tenant("alice")
    export = exported_job(server, "alice", tiny_models["gpt2"])
    job_id = export.parents[2].name
    artifacts = f"/v1/jobs/{job_id}/artifacts"
    assert alice.get(f"{artifacts}/merged/config.json").status_code == 200
    for method, path, why in [("GET", f"{artifacts}/merged%00.json", "control character"),
                              ("GET", f"{artifacts}/{'a' * 300}", "at most 255"),
                              ("GET", f"{artifacts}/{'/'.join(['a' * 200] * 25)}", "at most 4096"),
                              ("GET", "/v1/jobs/ftjob-%00", "control character"),
                              ("GET", f"/v1/jobs?after=ftjob-{'a' * 300}", "at most 255"),
                              ("DELETE", "/v1/tokens/tok-%0A", "control character"),
                              ("GET", "/v1/pools/h%00", "control character"),
                              ("GET", "/ui/app%00.js", "control character")]:
        answer = alice.request(method, path)
        assert answer.status_code == 422, (path, answer.text)
        assert why in answer.json()["error"]["message"] and answer.json()["error"]["param"], answer.text
    # within the bounds, but longer than a path may be once under the export's folder: no such file
    deep = alice.get(f"{artifacts}/{'/'.join(['a' * 200] * 19)}")
    assert deep.status_code == 404 and deep.json()["error"]["param"] == "path"
    assert alice.get("/v1/fine_tuning/jobs/ftjob-%00").status_code == 400  # OpenAI's status there
    assert alice.get("/v1/files?after=file-%00").status_code == 400
    worker = httpx.post(f"{server.url}/v1/internal/jobs/ftjob-%00/telemetry", json={"records": []},
                        headers={"Authorization": "Bearer tw-anything"})
    assert worker.status_code == 422 and worker.json()["error"]["param"] == "job_id"


def test_only_the_metrics_or_an_admin_token_sees_tenants_and_jobs_in_metrics(tmp_path):
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0, metrics_token="tw-scraper") as server:
        server.tenant("alice").close()
        run_dir = tmp_path / "run"
        runtime = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(run_dir)])
        try:
            with Session(server.app.state.engine) as session:  # a running job, as the local backend follows it
                alice = session.exec(select(Tenant).where(Tenant.name == "alice")).one()
                job = Job(tenant_id=alice.id, status="running", model="gpt2", spec={}, step=7, pid=runtime.pid,
                          run_dir=str(run_dir))
                session.add(job)
                session.commit()
                job_id = job.id
            per_job = f'tunewright_job_step{{job_id="{job_id}",tenant="alice"}} 7'
            anyone = httpx.get(f"{server.url}/metrics")
            assert anyone.status_code == 200 and 'tunewright_jobs{status="running"} 1' in anyone.text
            assert job_id not in anyone.text and "alice" not in anyone.text
            assert "need the metrics token" in anyone.text  # a comment: scrapers skip it, people read it
            for token in ("tw-scraper", ADMIN):
                assert per_job in httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
            tenant_token = server.tenant("bob").headers["Authorization"]
            assert httpx.get(f"{server.url}/metrics", headers={"Authorization": tenant_token}).status_code == 403
            assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer tw-wrong"}).status_code == 401
        finally:
            runtime.kill()
            runtime.wait()


def test_what_killed_uploads_left_is_swept_and_live_uploads_are_not(tmp_path):
    data = tmp_path / "data"
    folder = data / "files" / "tenant-x"
    folder.mkdir(parents=True)
    killed, live = folder / "file-killed.partial", folder / "file-live.partial"
    for partial in (killed, live):
        partial.write_text("{}")
    long_ago = time.time() - STALE_PARTIAL_SECONDS - 60
    os.utime(killed, (long_ago, long_ago))
    with Server(data, local_ray=False) as server:
        # at start-up: the old one only (a live one may be another API replica's, on shared storage)
        assert not killed.exists() and live.exists()
        alice = server.tenant("alice")
        first = upload(alice, TRAIN)
        assert first.status_code == 200
        own = next((data / "files").glob("tenant-*/file-*.jsonl")).parent
        left = own / "file-left.partial"
        left.write_text("{}")
        os.utime(left, (long_ago, long_ago))
        assert upload(alice, TRAIN).status_code == 200 and not left.exists()  # and before each upload


def test_names_kept_as_text_refuse_control_characters_naming_the_field(server):
    """A suffix becomes part of the fine-tuned model's name, a token's name is listed; a NUL is what
    PostgreSQL's text refuses (a 500, before)."""
    alice = server.tenant("alice")
    refused = alice.post("/v1/fine_tuning/jobs", json={"model": "gpt2", "training_file": upload(alice, TRAIN).json()["id"],
                                                       "suffix": "v1\x00"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix", refused.text
    refused = server.client().post("/v1/tokens", json={"tenant": "bob", "name": "ci\x00"})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "name", refused.text
