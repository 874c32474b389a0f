"""The REST API against a real server: auth, envelopes, files, the job lifecycle, isolation, restarts."""

import http.client
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import ADMIN, TRAIN, VALIDATION, Server, tiny_spec, upload, wait_for


def test_health_is_open_and_everything_else_needs_a_token(server):
    with server.client(token=None) as anonymous:
        assert anonymous.get("/healthz").json() == {"status": "ok"}
        assert anonymous.get("/readyz").json()["status"] == "ready"
        assert "tunewright_jobs" in anonymous.get("/metrics").text
        for method, path in [("GET", "/v1/jobs"), ("GET", "/v1/files"), ("POST", "/v1/tokens")]:
            response = anonymous.request(method, path)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
    with server.client(token="tw-wrong") as wrong:
        assert wrong.get("/v1/jobs").json()["error"]["message"] == "invalid token"


def test_only_admins_issue_tokens(server):
    alice = server.tenant("alice")
    response = alice.post("/v1/tokens", json={"tenant": "mallory"})
    assert response.status_code == 403
    bad = server.client().post("/v1/tokens", json={"tenant": "Not Valid"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "tenant"


def test_upload_validates_with_line_numbers(server, tmp_path):
    alice = server.tenant("alice")
    good = upload(alice, TRAIN).json()
    assert (good["format"], good["examples"], good["object"]) == ("chat", 800, "file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n'
                   '{"messages": [{"role": "user", "content": "only a question"}]}\nnot json\n')
    response = upload(alice, bad, "mine.jsonl")
    assert response.status_code == 400  # as OpenAI answers a malformed upload
    error = response.json()["error"]
    assert error["param"] == "file" and error["code"] == "invalid_file"
    assert str(server.settings.data_dir.resolve()) not in error["message"]  # nothing of the server's layout
    assert "mine.jsonl:2: no assistant message" in error["message"] and "mine.jsonl:3: not valid JSON" in error["message"]
    assert [f["id"] for f in alice.get("/v1/files").json()["data"]] == [good["id"]]
    assert alice.get(f"/v1/files/{good['id']}/content").content == TRAIN.read_bytes()


def test_job_spec_errors_name_the_field(backend_server, tiny_models):
    alice = backend_server.tenant("alice")
    response = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], "/etc/passwd"))
    assert response.status_code == 422 and response.json()["error"]["param"] == "dataset.train"
    response = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], "file-" + "0" * 24))
    assert response.json()["error"]["code"] == "file_not_found"
    spec = tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"])
    spec["method"]["type"] = "qlora"
    response = alice.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and response.json()["error"]["param"] == "method.type"


@pytest.mark.slow  # trains a job (over 10 s here)
def test_job_runs_to_completion_with_telemetry_events_and_checkpoints(server, tiny_models):
    alice = server.tenant("alice")
    train, validation = upload(alice, TRAIN).json()["id"], upload(alice, VALIDATION).json()["id"]
    job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, validation)).json()
    assert job["status"] == "queued" and job["plan"]["strategy"] == "ddp" and job["plan"]["workers"] == 2
    done = wait_for(alice, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["step"] == 10 and done["progress"]["totalSteps"] == 10
    assert done["progress"]["trainedTokens"] > 0
    assert done["result"]["evalAfter"]["valLoss"] < done["result"]["evalBefore"]["valLoss"]
    metrics = alice.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [m["step"] for m in metrics] == list(range(1, 11)) and all(m["loss"] > 0 for m in metrics)
    assert [m["step"] for m in alice.get(f"/v1/jobs/{job['id']}/metrics?max_points=4").json()["data"]][-1] == 10
    events = alice.get(f"/v1/jobs/{job['id']}/events").json()["data"]
    assert events[0]["message"] == "succeeded" and events[-1]["message"].startswith("queued; plan: local pool")
    assert any(e["type"] == "metrics" for e in events)
    # measured on the 2 gloo workers by the runtime's profiler window (steps 3-4), and reported on the job
    telemetry = done["telemetry"]
    assert 0 < telemetry["commShareExposed"] <= telemetry["commShare"] <= telemetry["commShareMaxRank"] <= 1
    assert telemetry["commMeasuredAtStep"] == 4 and telemetry["mfu"] is None  # CPU: no peak FLOP/s to divide by
    assert any(e["message"].startswith("step 4: communication") for e in events)
    # registered by the runtime as it committed them, with the training loss at that step
    checkpoints = alice.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
    assert [c["stepNumber"] for c in checkpoints] == [10, 5]
    assert all(c["metrics"]["trainLoss"] > 0 and Path(c["fineTunedModelCheckpoint"]).is_dir() for c in checkpoints)
    assert checkpoints[0]["metrics"]["trainLoss"] == pytest.approx(metrics[-1]["loss"])
    logs = alice.get(f"/v1/jobs/{job['id']}/logs?lines=5").json()["data"]
    assert len(logs) == 5 and all(isinstance(line, str) for line in logs)
    assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409
    assert alice.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").status_code == 400  # OpenAI's answer there
    # the exported adapter, file by file, exactly as written; nothing outside the export is reachable
    listed = {a["path"]: a["bytes"] for a in alice.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]}
    export = Path(done["result"]["export"]["adapter"])
    assert "adapter/adapter_config.json" in listed and listed == {
        p.relative_to(export.parent).as_posix(): p.stat().st_size for p in export.parent.rglob("*") if p.is_file()}
    config = alice.get(f"/v1/jobs/{job['id']}/artifacts/adapter/adapter_config.json")
    assert config.content == (export / "adapter_config.json").read_bytes()
    for outside in ("../../job.json", "../telemetry.token", "/etc/passwd", "%2e%2e/%2e%2e/job.json"):
        assert alice.get(f"/v1/jobs/{job['id']}/artifacts/{outside}").status_code == 404, outside
    # deleted: its records and run folder go; its results file stays the tenant's
    results = alice.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["result_files"]
    assert alice.delete(f"/v1/jobs/{job['id']}").json()["deleted"] is True
    assert alice.get(f"/v1/jobs/{job['id']}").status_code == 404 and not export.exists()
    assert not Path(server.settings.data_dir / "jobs" / job["id"]).exists()
    assert alice.get(f"/v1/files/{results[0]}").json()["purpose"] == "fine-tune-results"


def test_cancel_stops_the_run(server, tiny_models):
    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()
    running = wait_for(alice, job["id"], {"running"})
    assert running["status"] == "running"
    # "running" is committed before the run is started (intent first): its process comes a moment later
    deadline = time.monotonic() + 30
    while (pid := _pid(server, job["id"])) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = alice.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _pid(server, job_id):
    from sqlmodel import Session

    from tunewright_api.models import Job

    with Session(server.app.state.engine) as session:
        return session.get(Job, job_id).pid


def test_tenants_never_see_each_other(backend_server, tiny_models):
    alice, bob = backend_server.tenant("alice"), backend_server.tenant("bob")
    file_id = upload(alice, TRAIN).json()["id"]
    job_id = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], file_id)).json()["id"]
    alices_token = backend_server.client().get("/v1/tokens?tenant=alice").json()["data"][0]["id"]
    ids = {"file_id": file_id, "job_id": job_id, "fine_tuning_job_id": job_id, "token_id": alices_token,
           "path": "adapter/adapter_config.json"}
    covered = 0
    # every route that takes an id, as the OpenAPI schema lists them: a new route is covered by construction
    for template, operations in bob.get("/openapi.json").json()["paths"].items():
        if not re.search(r"{\w+}", template) or template.startswith(("/v1/internal", "/v1/pools")):
            continue  # the workers' routes take the job's token; pools are shared by every tenant
        for method in operations:
            response = bob.request(method.upper(), template.format(**ids))
            if template.startswith("/v1/tokens"):  # an administrator's route: refused before any lookup
                assert response.status_code == 403, (method, template, response.text)
                continue
            assert response.status_code == 404, (method, template, response.text)
            assert response.json()["error"]["type"] == "not_found_error"
            covered += 1
    assert covered >= 15  # files: 3; native jobs: 8; OpenAI jobs: get, cancel, events, checkpoints
    assert bob.get("/v1/jobs").json()["data"] == [] and bob.get("/v1/files").json()["data"] == []
    assert bob.request("POST", f"/v1/internal/jobs/{job_id}/telemetry", json={"records": []}).status_code == 401
    alice.post(f"/v1/jobs/{job_id}/cancel")


@pytest.mark.slow  # trains a job (over 10 s here)
def test_restart_reattaches_live_runs_and_fails_lost_ones(tmp_path, tiny_models, database_url):
    data = tmp_path / "data"
    with Server(data, local_ray=False, database_url=database_url) as first:
        alice = first.tenant("alice")
        token = alice.headers["Authorization"]
        train = upload(alice, TRAIN).json()["id"]
        # outlives the first API (startup alone takes seconds), short enough for the suite
        live = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=150)).json()["id"]
        wait_for(alice, live, {"running"})
        lost = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    # The API is down: the live run goes on; the queued one never started. Make a "running" job whose
    # process died while the API was away.
    from sqlmodel import Session

    from tunewright_api.db import make_engine
    from tunewright_api.models import Job

    engine = make_engine(first.settings.resolved_database_url)
    with Session(engine) as session:
        job = session.get(Job, lost)
        job.status, job.pid, job.run_dir = "running", 999999, str(data / "jobs" / lost)
        session.add(job)
        session.commit()
    engine.dispose()
    # the same address, as a restarted service has: the live run's telemetry reaches the new process
    with Server(data, port=first.port, local_ray=False, database_url=database_url) as second:
        alice = second.client(token.removeprefix("Bearer "))
        assert alice.get(f"/v1/jobs/{lost}").json()["status"] == "failed"
        assert "API restarted" in alice.get(f"/v1/jobs/{lost}").json()["error"]["message"]
        assert wait_for(alice, live, {"succeeded", "failed"})["status"] == "succeeded"
        events = [e["message"] for e in alice.get(f"/v1/jobs/{live}/events?limit=1000").json()["data"]]
        assert any(m.startswith("re-attached to process") for m in events)  # not merely found finished
        assert alice.get(f"/v1/jobs/{live}/metrics").json()["data"][-1]["step"] == 150


def test_bare_500s_are_enveloped(server, monkeypatch):
    from tunewright_api.services import files

    monkeypatch.setattr(files, "validate_dataset", lambda path: (_ for _ in ()).throw(RuntimeError("boom")))
    response = upload(server.client(), TRAIN)
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("internal error (RuntimeError)")


def test_a_500_keeps_the_connection_open(server, monkeypatch):
    from tunewright_api.services import jobs

    monkeypatch.setattr(jobs, "page_of_jobs", lambda **_: (_ for _ in ()).throw(RuntimeError("boom")))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(2):  # the second request goes over the same socket: it fails if the server closed it
        connection.request("GET", "/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"})
        response = connection.getresponse()
        body = json.loads(response.read())
        assert response.status == 500 and response.getheader("connection") != "close"
        assert body["error"]["message"].startswith("internal error (RuntimeError)")
    connection.close()



@pytest.mark.slow  # trains a job (over 10 s here)
def test_the_official_openai_client_works(server, tiny_models):
    from openai import NotFoundError, OpenAI

    alice = server.tenant("alice")
    client = OpenAI(base_url=f"{server.url}/v1", api_key=alice.headers["Authorization"].removeprefix("Bearer "))
    with TRAIN.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.bytes == TRAIN.stat().st_size
    assert client.files.retrieve(uploaded.id).filename == "train.jsonl"
    job = client.fine_tuning.jobs.create(
        model=str(tiny_models["gpt2"]), training_file=uploaded.id, suffix="demo", seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}},
        extra_body={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "max_steps": 6, "seq_len": 128},
    )
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running") and job.seed == 3
    second = client.fine_tuning.jobs.create(model=str(tiny_models["gpt2"]), training_file=uploaded.id,
                                            extra_body={"max_steps": 100000, "seq_len": 128})
    page = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in page.data] == [second.id] and page.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(after=second.id, limit=5).data] == [job.id]
    assert client.fine_tuning.jobs.cancel(second.id).status == "cancelled"
    deadline = time.monotonic() + 240
    while (current := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert current.status == "succeeded", current.error
    assert current.trained_tokens > 0
    assert current.fine_tuned_model == f"ft:{tiny_models['gpt2'].name}:demo:{job.id}"  # a name, not a path
    results = client.files.content(current.result_files[0]).text.splitlines()
    assert results[0].startswith("step,train_loss,valid_loss") and len(results) == 1 + 6
    assert current.hyperparameters.n_epochs == 1 and current.hyperparameters.batch_size == 4
    events = client.fine_tuning.jobs.list_events(job.id, limit=50).data
    assert events[0].message == "succeeded"
    assert any(e.type == "metrics" and e.data["step"] == 6 for e in events)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoints[0].step_number == 6 and checkpoints[0].fine_tuning_job_id == job.id
    with pytest.raises(NotFoundError) as err:
        client.fine_tuning.jobs.retrieve("ftjob-does-not-exist")
    assert err.value.body["type"] == "not_found_error"


H100_POOL = {"name": "h100", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 2, "intraNode": "nvlink4",
             "interNode": "ib-8x400g", "pricePerGPUHour": 4.0}


def test_pools_and_dry_run_plans(server, tiny_models):
    alice = server.tenant("alice")
    assert alice.post("/v1/pools", json=H100_POOL).status_code == 403
    assert server.client().post("/v1/pools", json=H100_POOL).status_code == 201
    assert server.client().post("/v1/pools", json=H100_POOL).status_code == 409
    # a pool that learns its links (opt-in): nothing measured yet; forgetting is the admin's
    learning = server.client().post("/v1/pools", json={**H100_POOL, "name": "learns", "learnLinks": True}).json()
    assert (learning["learnLinks"], learning["measuredLinks"], learning["measuredEfficiency"]) == (True, None, None)
    assert alice.delete("/v1/pools/learns/measured-links").status_code == 403
    assert server.client().delete("/v1/pools/learns/measured-links").json()["measuredLinks"] is None
    assert server.client().delete("/v1/pools/nowhere/measured-links").status_code == 404
    pools = alice.get("/v1/pools").json()["data"]
    assert [p["name"] for p in pools] == ["local", "h100", "learns"] and pools[0]["workers"] == 2
    spec = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "full"},
            "dataset": {"train": "file-x"}, "hyperparameters": {"maxSteps": 1000, "globalBatchSize": 64}}
    answer = alice.post("/v1/plans", json={"spec": spec, "pool": "h100"}).json()
    plan = answer["plan"]
    # 8B full fine-tuning does not fit one 80 GB GPU: sharded over several, the cheapest that fits
    assert answer["model"]["parameters"] > 8e9 and plan["gpus"] >= 2 and plan["strategy"] in ("fsdp", "hsdp")
    assert plan["predicted"]["peakMemoryGiB"] < 80 and plan["predicted"]["costUSD"] > 0 and plan["pool"] == "h100"
    assert {r["strategy"] for r in plan["rejected"]} >= {"single", "ddp"}
    # the same pool described in the request (a dry run on hardware no admin registered): the same plan
    inline = {k: v for k, v in H100_POOL.items() if k != "name"}
    described = alice.post("/v1/plans", json={"spec": spec, "poolSpec": inline}).json()
    assert described["pool"] == described["plan"]["pool"] == "described"
    assert {**described["plan"], "pool": "h100"} == plan
    assert [p["name"] for p in alice.get("/v1/pools").json()["data"]] == ["local", "h100", "learns"]  # nothing was kept
    for body in ({"spec": spec}, {"spec": spec, "pool": "h100", "poolSpec": inline}):
        neither_or_both = alice.post("/v1/plans", json=body)
        assert neither_or_both.status_code == 422 and neither_or_both.json()["error"]["param"] == "pool"
    bad = alice.post("/v1/plans", json={"spec": spec, "poolSpec": {**inline, "gpusPerNode": 0}})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "poolSpec.gpusPerNode"
    local_model = alice.post("/v1/plans", json={"spec": {**spec, "model": {"source": str(tiny_models["llama"])}},
                                                "pool": "h100"})
    assert local_model.status_code == 200 and local_model.json()["model"]["layers"] == 2  # read its config.json
    unknown = alice.post("/v1/plans", json={"spec": {**spec, "model": {"source": "hf://nobody/nothing"}}, "pool": "h100"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "spec.model.source"
    local = alice.post("/v1/plans", json={"spec": spec, "pool": "local"})
    assert local.status_code == 422 and "planner models GPU pools" in local.json()["error"]["message"]
    tiny = {**spec, "model": {"source": "meta-llama/Llama-3.1-70B"}, "resources": {"maxGPUs": 1}}
    no_plan = alice.post("/v1/plans", json={"spec": tiny, "pool": "h100"})
    assert no_plan.status_code == 422 and "does not fit" in no_plan.json()["error"]["message"]


@pytest.mark.slow  # trains a job (over 10 s here)
def test_the_queue_runs_one_job_at_a_time(server, tiny_models):
    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    first = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    second = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=3)).json()["id"]
    wait_for(alice, first, {"running"})
    deadline = time.monotonic() + 120
    while alice.get(f"/v1/jobs/{first}").json()["progress"]["step"] < 2:  # many scheduler ticks with a free queue
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert alice.get(f"/v1/jobs/{second}").json()["status"] == "queued"  # max_running_jobs = 1
    cancelled = alice.post(f"/v1/jobs/{first}/cancel").json()
    done = wait_for(alice, second, {"succeeded", "failed"})
    assert done["status"] == "succeeded" and done["startedAt"] >= cancelled["finishedAt"]
    spec = tiny_spec(tiny_models["gpt2"], train)
    held = alice.post("/v1/jobs", json={**spec, "suspend": True})
    assert held.status_code == 422 and held.json()["error"]["param"] == "suspend"


@pytest.mark.slow
def test_jobs_run_on_a_local_ray_by_default(tmp_path, tiny_models, monkeypatch):
    # The API's environment has a secret and a Ray address (say, another checkout's cluster): the job's
    # processes get neither; it runs on the server's own Ray (issue 37: one for the server's life), whose
    # processes get neither either.
    monkeypatch.setenv("TUNEWRIGHT_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with Server(tmp_path / "data") as ray_server:  # local_ray defaults to True, as in production
        alice = ray_server.tenant("alice")
        train = upload(alice, TRAIN).json()["id"]
        job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=4)).json()
        running = wait_for(alice, job["id"], {"running", "succeeded", "failed"})
        children = ray_server.app.state.backend._children
        deadline = time.monotonic() + 120  # "running" is committed first; the run starts once the Ray answers
        while running["status"] == "running" and job["id"] not in children and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = children[job["id"]].pid if job["id"] in children else None
        head = json.loads((tmp_path / "data" / "ray.json").read_text())["pid"]
        seen = set()
        while pid and alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "running":
            # the driver, and the server's Ray: its daemons and the job's workers
            for other in (processes_of_session(pid) | processes_of_session(head)) - seen:
                environment = read_environ(other)
                assert ADMIN not in environment and "RAY_ADDRESS=127.0.0.1:1" not in environment, other
                seen.add(other)
            time.sleep(0.5)
        done = wait_for(alice, job["id"], {"succeeded", "failed"}, timeout=400)
        assert done["status"] == "succeeded", done["error"]
        assert len(seen) >= 3  # the driver, Ray and at least one worker were inspected
        log = (tmp_path / "data" / "jobs" / job["id"] / "run.log").read_text()
        assert "RayTrainWorker" in log and done["progress"]["step"] == 4


def processes_of_session(session_id: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if entry.name.isdigit() and int(fields[3]) == session_id:  # after ")": state ppid pgrp session
            found.add(int(entry.name))
    return found


def read_environ(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_cli_plan(server, tmp_path, capsys):
    from tunewright_api.cli import main

    server.client().post("/v1/pools", json={**H100_POOL, "name": "eth", "interNode": "eth-100g", "maxNodes": 4})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"source": "meta-llama/Llama-3.1-70B"}, "method": {"type": "full"},
                                "dataset": {"train": "file-x"},
                                "hyperparameters": {"maxSteps": 100, "globalBatchSize": 64}}))
    assert main(["--url", server.url, "--token", ADMIN, "plan", str(spec), "--pool", "eth"]) == 0
    out = capsys.readouterr().out
    assert "meta-llama/Llama-3.1-70B (70.55B) on pool eth" in out
    assert "rejected:  single: does not fit" in out and "all on Ethernet 100 Gb/s per node" in out


@pytest.mark.parametrize(("product", "key"), [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
                                              ("NVIDIA-A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
                                              ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("Tesla T4", None)])
def test_gpu_product_names(product, key):
    from tunewright_core.planner.hardware import gpu_from_product_name

    assert gpu_from_product_name(product) == key


def test_jobs_on_local_gpus_are_planned_and_predicted(tmp_path, tiny_models):
    """With GPUs, the local backend plans each job through the planner and stores the predictions."""
    with Server(tmp_path / "data", local_ray=False, local_gpus=2, local_gpu_type="H200",
                local_price_per_gpu_hour=7.9) as gpu_server:
        alice = gpu_server.tenant("alice")
        train = upload(alice, TRAIN).json()["id"]
        job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["llama"], train, maxSteps=100)).json()
        plan = job["plan"]
        assert plan["device"] == "gpu" and plan["strategy"] in ("single", "ddp", "fsdp") and plan["explanation"].startswith(
            "local pool (2 x H200)")
        assert plan["predicted"]["stepSeconds"] > 0 and plan["predicted"]["costUSD"] > 0 and plan["gpus"] == plan["workers"]
        assert job["status"] == "queued"
        unknown = Server(tmp_path / "other", local_ray=False, local_gpus=1, local_gpu_type="TPU")
        with unknown:
            bob = unknown.tenant("bob")
            response = bob.post("/v1/jobs", json=tiny_spec(tiny_models["llama"], upload(bob, TRAIN).json()["id"]))
            assert response.status_code == 422 and "TUNEWRIGHT_LOCAL_GPU_TYPE" in response.json()["error"]["message"]


def test_telemetry_takes_good_records_refuses_bad_ones_and_counts_a_step_once(server, tiny_models, tmp_path):
    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    running = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    queued = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    token = (server.settings.data_dir / "jobs" / queued / "telemetry.token").read_text()  # it never runs here
    step = {"event": "step", "step": 1, "epoch": 0, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 1.0,
            "tokens": 400, "tokens_per_second": 4e3, "step_seconds": 0.1, "data_seconds": 0.0,
            "forward_backward_seconds": 0.08, "optimizer_seconds": 0.02}
    with server.client(token) as worker:
        url = f"/v1/internal/jobs/{queued}/telemetry"
        body = json.dumps({"records": [step, {**step, "step": "one"}, {**step, "loss": float("nan")}]})  # as the runtime
        answer = worker.post(url, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["accepted"] == 2 and [r["index"] for r in answer.json()["rejected"]] == [1]
        assert worker.post(url, json={"records": [{**step, "tokens": 300, "loss": 2.0}]}).json()["accepted"] == 1
    job = alice.get(f"/v1/jobs/{queued}").json()
    assert job["progress"]["trainedTokens"] == 300 and job["progress"]["loss"] == 2.0  # the latest record wins
    assert [(m["step"], m["tokens"]) for m in alice.get(f"/v1/jobs/{queued}/metrics").json()["data"]] == [(1, 300)]
    for job_id in (queued, running):
        alice.post(f"/v1/jobs/{job_id}/cancel")
    with server.client(token) as worker:  # a cancelled job takes no more records: its progress stays
        late = worker.post(f"/v1/internal/jobs/{queued}/telemetry", json={"records": [{**step, "step": 2}]})
    assert late.status_code == 410 and alice.get(f"/v1/jobs/{queued}").json()["progress"]["step"] == 1


def test_a_job_keeps_bounded_metric_points_and_events(tmp_path, tiny_models, monkeypatch):
    from tunewright_api.services import telemetry

    monkeypatch.setattr(telemetry, "MAX_METRIC_POINTS", 40)
    monkeypatch.setattr(telemetry, "MAX_METRICS_EVENTS", 30)
    with Server(tmp_path / "data", local_ray=False, max_running_jobs=0) as server:  # the job stays queued
        alice = server.tenant("alice")
        job = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], upload(alice, TRAIN).json()["id"])).json()
        token = (server.settings.data_dir / "jobs" / job["id"] / "telemetry.token").read_text()
        step = {"event": "step", "epoch": 0, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 1.0, "tokens": 10,
                "tokens_per_second": 4e3, "step_seconds": 0.1, "data_seconds": 0.0,
                "forward_backward_seconds": 0.08, "optimizer_seconds": 0.02}
        with server.client(token) as worker:
            for first in range(1, 301, 20):
                batch = [{**step, "step": n} for n in range(first, first + 20)]
                assert worker.post(f"/v1/internal/jobs/{job['id']}/telemetry", json={"records": batch}).is_success
            # a resumed run sends recent steps again: they are still there, so their tokens count once
            again = [{**step, "step": n} for n in range(291, 301)]
            assert worker.post(f"/v1/internal/jobs/{job['id']}/telemetry", json={"records": again}).is_success
        steps = [p["step"] for p in alice.get(f"/v1/jobs/{job['id']}/metrics?maxPoints=10000").json()["data"]]
        assert len(steps) <= 40 and steps[0] == 1 and steps[-20:] == list(range(281, 301))
        assert alice.get(f"/v1/jobs/{job['id']}").json()["progress"]["trainedTokens"] == 300 * 10
        events = alice.get(f"/v1/jobs/{job['id']}/events?limit=1000").json()["data"]
        assert len([e for e in events if e["type"] == "metrics"]) <= 30
        assert events[0]["message"] == "step 300: training loss=2.5000"  # the newest are kept
        assert events[-1]["message"].startswith("queued")  # lifecycle events are never dropped


def test_concurrent_first_tokens_of_a_tenant_make_one_tenant(server):
    from concurrent.futures import ThreadPoolExecutor

    def create(_):
        with server.client() as admin:
            return admin.post("/v1/tokens", json={"tenant": "newcomer"})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(create, range(16)))
    assert [a.status_code for a in answers] == [201] * 16, [a.text for a in answers if a.status_code != 201]
    assert len({a.json()["id"] for a in answers}) == 16  # sixteen tokens...
    with server.client() as admin:  # ...of one tenant
        assert len(admin.get("/v1/tokens?tenant=newcomer").json()["data"]) == 16
    for answer in answers:
        with server.client(answer.json()["token"]) as user:
            assert user.get("/v1/jobs").status_code == 200


@pytest.mark.parametrize("header", [b"Bearer ", b"Bearer", b"bearer    ", b"Bearer \t", b"Basic abc", b""])
def test_an_empty_or_foreign_authorization_is_401_not_500(server, header):
    import socket

    # raw bytes: HTTP clients refuse to send a header value with trailing spaces, but anyone can
    request = (b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               + (b"Authorization: " + header + b"\r\n" if header else b"") + b"\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"401", answer[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["type"] == "authentication_error"


def test_the_openai_client_pages_through_events_and_checkpoints_to_the_end(server, tiny_models):
    from openai import OpenAI

    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    running = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    queued = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    token = (server.settings.data_dir / "jobs" / queued / "telemetry.token").read_text()
    step = {"event": "step", "epoch": 0, "loss": 2.5, "learning_rate": 1e-3, "grad_norm": 1.0, "tokens": 4,
            "tokens_per_second": 4e3, "step_seconds": 0.1, "data_seconds": 0.0, "forward_backward_seconds": 0.08,
            "optimizer_seconds": 0.02}
    records = [{**step, "step": n} for n in range(1, 6)] + [
        {"event": "checkpoint", "step": n, "uri": f"/ckpt/step_{n:08d}", "train_loss": 2.0, "keep_last": 10}
        for n in (2, 4, 5)]
    with server.client(token) as worker:
        assert worker.post(f"/v1/internal/jobs/{queued}/telemetry", json={"records": records}).status_code == 200
    client = OpenAI(base_url=f"{server.url}/v1", api_key=alice.headers["Authorization"].removeprefix("Bearer "))
    events = list(client.fine_tuning.jobs.list_events(queued, limit=2))  # auto-pagination must end
    assert len(events) == len({e.id for e in events}) == 1 + 5 + 3  # queued, five steps, three checkpoints
    assert events[-1].message.startswith("queued")
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(queued, limit=1))
    assert [c.step_number for c in checkpoints] == [5, 4, 2]
    bad = alice.get(f"/v1/fine_tuning/jobs/{queued}/events?after=yesterday")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    for job_id in (queued, running):
        alice.post(f"/v1/jobs/{job_id}/cancel")


def test_cancel_acts_on_the_job_as_it_is_not_as_it_was_read(server, tiny_models):
    """The race of issue 15 item 1, made deterministic: the job is read while queued, the scheduler starts
    it, then the cancel lands. Its training process must end, and the queue must not start another."""
    from sqlmodel import Session

    from tunewright_api.models import Job

    backend = server.app.state.backend
    backend.stop()  # the scheduler runs when this test says
    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    first = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    second = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    with Session(server.app.state.engine) as stale_session:
        stale = stale_session.get(Job, first)
        assert stale.status == "queued"
        backend.tick()  # starts the first job, in its own session
        pid = _pid(server, first)
        assert pid is not None
        backend.cancel(stale_session, stale)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    backend.tick()
    assert alice.get(f"/v1/jobs/{first}").json()["status"] == "cancelled"
    assert alice.get(f"/v1/jobs/{second}").json()["status"] == "running"  # one at a time, the first truly gone
    alice.post(f"/v1/jobs/{second}/cancel")


@pytest.mark.parametrize(("config", "source_length"), [
    ({"model_type": "llama"}, None),  # no model keys
    ({"model_type": "gpt2", "n_embd": 64}, None),  # GPT-2 layout, keys missing
    ("not json at all", None),
    ([1, 2, 3], None),
    (None, 5000),  # a source longer than any path
])
def test_plans_refuse_unusable_models_naming_the_field(server, tmp_path, config, source_length):
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    source = "x" * source_length if source_length else str(model)
    server.client().post("/v1/pools", json=H100_POOL)
    spec = {"model": {"source": source}, "dataset": {"train": "file-x"}, "hyperparameters": {"maxSteps": 10}}
    answer = server.client().post("/v1/plans", json={"spec": spec, "pool": "h100"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "spec.model.source"


def test_telemetry_and_diagnosis_of_a_job_from_its_records(server, tiny_models, capsys):
    """What a worker posts (steps, a profiler window with its GPU kernels, a checkpoint) comes back as the
    job's telemetry over time and its diagnosis; `tunewright explain` prints it."""
    from tunewright_api.cli import main

    alice = server.tenant("alice")
    train = upload(alice, TRAIN).json()["id"]
    running = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    queued = alice.post("/v1/jobs", json=tiny_spec(tiny_models["gpt2"], train, maxSteps=100000)).json()["id"]
    token = (server.settings.data_dir / "jobs" / queued / "telemetry.token").read_text()  # it never runs here
    steps = [{"event": "step", "step": s, "epoch": 0, "loss": 3.0 - s / 10, "learning_rate": 1e-3, "grad_norm": 1.0,
              "tokens": 4000, "tokens_per_second": 40e3, "step_seconds": 0.1, "data_seconds": 0.01,
              "forward_backward_seconds": 0.08, "optimizer_seconds": 0.01,
              **({"sm_active_share": 0.62, "tensor_active_share": 0.41, "dram_bandwidth_share": 0.2,
                  "kernel_active_share": 0.99} if s == 10 else {"gpu_activity_unavailable": "a CPU run: no GPU to read"})}
             for s in range(1, 11)]
    window = {"event": "comm", "step": 10, "profiled_steps": 2, "profiled_step_seconds": 0.1, "comm_share": 0.2,
              "comm_share_exposed": 0.1, "comm_seconds_per_step": 0.02, "exposed_comm_seconds_per_step": 0.01,
              "comm_share_max_rank": 0.25, "comm_share_exposed_max_rank": 0.12, "matmul_seconds_per_step": 0.04,
              "attention_seconds_per_step": 0.01, "other_compute_seconds_per_step": 0.03, "gpu_busy_share": 0.9,
              "wait_seconds_per_step": 0.008, "transfer_seconds_per_step": 0.012, "rank_own_seconds_min": 0.08,
              "rank_own_seconds_median": 0.085, "rank_own_seconds_max": 0.099, "slowest_rank": 1}
    checkpoint = {"event": "checkpoint", "step": 10, "uri": "/ckpt/10", "keep_last": 2, "seconds": 0.5}
    evaluations = [{"event": "eval", "step": s, "val_loss": 3.0 - s / 5, "val_token_accuracy": s / 20}
                   for s in (0, 10)]
    with server.client(token) as worker:
        answer = worker.post(f"/v1/internal/jobs/{queued}/telemetry",
                             json={"records": [evaluations[0], *steps, window, checkpoint, evaluations[1]]})
        assert answer.json()["accepted"] == 14, answer.text
    telemetry = alice.get(f"/v1/jobs/{queued}/telemetry").json()
    assert [p["step"] for p in telemetry["series"]] == list(range(1, 11))
    assert telemetry["comm"] == [{"step": 10, "commShare": 0.2, "commShareExposed": 0.1, "gpuBusyShare": 0.9,
                                  "waitSecondsPerStep": 0.008, "transferSecondsPerStep": 0.012, "slowestRank": 1,
                                  "rankOwnSeconds": {"min": 0.08, "median": 0.085, "max": 0.099}}]
    assert [p["smActive"] for p in telemetry["series"]] == [None] * 9 + [0.62]
    none = {"exactMatch": None, "preferenceAccuracy": None, "rewardMargin": None}  # (the last two: dpo's)
    assert telemetry["evaluations"] == [{"step": 0, "valLoss": 3.0, "valTokenAccuracy": 0.0, **none},
                                        {"step": 10, "valLoss": 1.0, "valTokenAccuracy": 0.5, **none}]
    latest = telemetry["latest"]
    assert latest["commShare"] == 0.2 and latest["gpuBusyShare"] == 0.9
    assert (latest["smActive"], latest["tensorActive"], latest["dramBandwidth"], latest["kernelActive"]) == \
        (0.62, 0.41, 0.2, 0.99) and latest["smActiveUnavailable"] is None
    assert latest["dataWaitShare"] == pytest.approx(0.1)
    found = alice.get(f"/v1/jobs/{queued}/diagnosis").json()
    assert found["status"] == "no prediction (CPU)" and found["measuredStepSeconds"] == pytest.approx(0.1)
    parts = {c["name"]: c["measuredSeconds"] for c in found["components"]}
    assert parts["checkpoints"] == pytest.approx(0.05) and parts["data wait"] == pytest.approx(0.01)
    assert parts["matrix products"] + parts["memory-bound and launches"] + parts["exposed communication"] \
        == pytest.approx(0.08)  # the window's kernels, scaled to the measured forward and backward
    assert server.tenant("bob").get(f"/v1/jobs/{queued}/diagnosis").status_code == 404
    user = alice.headers["Authorization"].removeprefix("Bearer ")
    assert main(["--url", server.url, "--token", user, "explain", queued]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("no prediction (CPU): a step takes 100 ms") and "matrix products" in printed
    assert "- checkpoints every 5 steps take 50% of the training time" in printed  # 0.5 s a checkpoint
    assert "8 ms is waiting for the slowest rank (rank 1) and 12 ms transfer" in printed
    assert "rank 1 is a straggler: its own work takes 99 ms a step against the ranks' median 85" in printed
    wait_for(alice, running, {"running"})
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text  # each job's: a token
    assert f'tunewright_job_step{{job_id="{running}",tenant="alice"}}' in metrics
    # the running job's steps are the CPU's: no SM-active sample, so no SM-active line (absent, not zero)
    assert f'tunewright_job_sm_active{{job_id="{running}"' not in metrics
    assert queued not in metrics  # queued: nothing measured to report as it runs
    assert re.search(r'tunewright_http_request_duration_seconds_count\{method="GET",'
                     r'route="/v1/jobs/\{job_id\}/diagnosis",status="200"\} [1-9]', metrics)
    assert f"/v1/jobs/{queued}" not in metrics  # routes by their template, never a job's id
    for job_id in (queued, running):
        alice.post(f"/v1/jobs/{job_id}/cancel")
