"""The API's kubernetes backend, with the real operator (`kopf run`) on an emulated API server, the test
playing KubeRay and the runtime (the workers' calls, with the token the operator made).

Pure parts first (tenant → namespace, what the API takes from a FineTuneJob), then the scenarios: a job
submitted through the API runs to `succeeded` with its progress in both the API and the FineTuneJob's
status; a FineTuneJob made with kubectl is its namespace's tenant's job and no one else's; cancel
suspends then deletes; deleting the FineTuneJob cancels the job.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.api.conftest import TRAIN, Server, upload
from tests.support.emulated import Operator, client_for, secret_token, wait_for
from tunewright_api.backends.kubernetes import TENANT_LABEL, observed, tenant_namespace, tenant_of_namespace
from tunewright_api.errors import ApiError
from tunewright_core.names import (
    JOB_ID_ANNOTATION,
    MODEL_SHAPE_ANNOTATION,
    PLAN_ANNOTATION,
    TOKEN_HASH_ANNOTATION,
    job_id_of,
)
from tunewright_core.plan_of_record import adopted_plan
from tunewright_core.records import CheckpointRecord, EndRecord, ExportPaths, StartRecord, StepRecord
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan
from tunewright_core.status import Observation, with_condition

NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)


def test_tenant_namespaces_round_trip_and_stay_valid_names():
    assert tenant_namespace("tw-", "team-a") == "tw-team-a"
    assert tenant_of_namespace("tw-", "tw-team-a") == "team-a"
    assert tenant_of_namespace("tw-", "kube-system") is None and tenant_of_namespace("tw-", "tw-") is None
    with pytest.raises(ApiError, match="over 63 characters"):
        tenant_namespace("tw-", "a" * 62)


def status_after(*observations: Observation, **extra) -> dict:
    """A FineTuneJob status as the operator writes it after these observations, one a minute."""
    conditions = []
    for minute, observation in enumerate(observations):
        conditions = with_condition(conditions, observation, 1, NOW + timedelta(minutes=minute))
    return {"phase": observations[-1].phase, "conditions": [c.model_dump(by_alias=True, mode="json")
                                                              for c in conditions], **extra}


PLANNED = Observation("Planned", "Planned", "fsdp on 8 GPUs")
UNSCHEDULABLE = Observation("Queued", "Unschedulable", "0/8 nodes are available")
TRAINING = Observation("Running", "Training", "the Ray job is running")


@pytest.mark.parametrize(("status", "expected"), [
    ({}, ("queued", "Submitted")),
    (status_after(PLANNED), ("queued", "Planned")),
    (status_after(PLANNED, UNSCHEDULABLE), ("queued", "Unschedulable")),
    (status_after(PLANNED, UNSCHEDULABLE, TRAINING), ("running", "Training")),
    (status_after(PLANNED, TRAINING, Observation("Suspended", "Suspended", "held")), ("queued", "Suspended")),
    (status_after(PLANNED, TRAINING, Observation("Failed", "BackoffLimitExceeded", "3 attempts")),
     ("failed", "BackoffLimitExceeded")),
    (status_after(PLANNED, TRAINING, Observation("Succeeded", "Succeeded", "done")), ("succeeded", "Succeeded")),
    # a field a newer operator (or kopf) adds, or a status this API cannot read, never stops the following
    (status_after(PLANNED, TRAINING, kopf={"progress": {}}, newField=1), ("running", "Training")),
    ({"phase": "Running", "conditions": "garbage"}, ("running", "Running")),
])
def test_what_the_api_takes_from_a_finetunejob(status, expected):
    seen = observed({"metadata": {"annotations": {TOKEN_HASH_ANNOTATION: "ab" * 32}}, "status": status})
    assert (seen.status, seen.reason) == expected and seen.token_hash == "ab" * 32


SPEC = {"model": {"source": "hf://meta-llama/Llama-3.2-1B"}, "method": {"type": "lora"},
        "hyperparameters": {"maxSteps": 20, "globalBatchSize": 16, "seqLen": 512},
        "checkpoint": {"storage": "pvc://checkpoints/team", "everySteps": 10}}


@pytest.fixture
def cluster_api(emulated_cluster, tmp_path):
    """The API on the kubernetes backend and the operator, both on the emulated cluster."""
    with Server(tmp_path / "data", backend="kubernetes", kubernetes_sync_seconds=0.3) as api:
        operator = Operator(emulated_cluster.write_kubeconfig(tmp_path / "operator-kubeconfig"),
                            tmp_path / "operator.log", env={"TUNEWRIGHT_API_URL": api.url}).start()
        try:
            yield api, client_for(emulated_cluster), operator
        finally:
            operator.stop()


def api_job(client: httpx.Client, job_id: str, *statuses: str, operator=None, what="") -> dict:
    return wait_for(lambda: (job := client.get(f"/v1/jobs/{job_id}").json()).get("status") in statuses and job,
                    what=what or f"job {job_id} {'/'.join(statuses)}", operator=operator)


def kuberay_writes(cluster, namespace: str, status: dict) -> None:
    (rayjob,) = cluster.list("RayJob", namespace)
    cluster.patch_status("RayJob", namespace, rayjob["metadata"]["name"], status)



@pytest.mark.slow
def test_a_job_submitted_through_the_api_runs_on_the_cluster(cluster_api, emulated_cluster):
    api, cluster, operator = cluster_api
    alice = api.tenant("team-a")
    train = upload(alice, TRAIN).json()["id"]
    submitted = alice.post("/v1/jobs", json={**SPEC, "dataset": {"train": train}})
    assert submitted.status_code == 201, submitted.text
    job = submitted.json()
    ftj = cluster.get("FineTuneJob", "tw-team-a", job["id"])
    assert ftj["metadata"]["annotations"][JOB_ID_ANNOTATION] == job["id"] and ftj["spec"]["dataset"]["train"] == train
    assert cluster.get("Namespace", None, "tw-team-a")["metadata"]["labels"]["tunewright.dev/tenant"] == "team-a"
    # the API's plan is the plan of record: what the operator reads back of the FineTuneJob adopts it
    pool = cluster.get("GPUPool", None, job["plan"]["pool"])
    assert adopted_plan(ftj["metadata"]["annotations"][PLAN_ANNOTATION], FineTuneJobSpec.model_validate(ftj["spec"]),
                        pool["metadata"]["name"], GPUPoolSpec.model_validate(pool["spec"])
                        ) == JobPlan.model_validate(job["plan"])

    rayjob = wait_for(lambda: cluster.list("RayJob", "tw-team-a"), what="the RayJob", operator=operator)[0]
    name = rayjob["metadata"]["name"]
    started = datetime.now(UTC) - timedelta(minutes=30)
    kuberay_writes(cluster, "tw-team-a", {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                          "startTime": started.strftime("%Y-%m-%dT%H:%M:%SZ")})
    running = api_job(alice, job["id"], "running", operator=operator)
    assert running["plan"] == cluster.get("FineTuneJob", "tw-team-a", job["id"])["status"]["plan"]

    # the driver's output, from the head pod (nothing while its container starts)
    kuberay_writes(cluster, "tw-team-a", {"rayClusterName": f"{name}-raycluster"})
    cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-head", "namespace": "tw-team-a",
        "labels": {"ray.io/cluster": f"{name}-raycluster", "ray.io/node-type": "head"}},
        "spec": {"containers": [{"name": "ray-head", "image": "example/worker:0.1.0"}]}})
    assert alice.get(f"/v1/jobs/{job['id']}/logs").json()["data"] == []
    emulated_cluster.pod_logs[("tw-team-a", f"{name}-head")] = "".join(f"line {i}\n" for i in range(50))
    assert alice.get(f"/v1/jobs/{job['id']}/logs?lines=3").json()["data"] == ["line 47", "line 48", "line 49"]

    # the workers: the dataset and the telemetry endpoint from their config, with the operator's token
    token = secret_token(cluster.get("Secret", "tw-team-a", f"{name}-telemetry"))
    config = json.loads(cluster.get("ConfigMap", "tw-team-a", f"{name}-config")["data"]["job.json"])
    headers = {"Authorization": f"Bearer {token}"}
    dataset = httpx.get(config["dataset"]["train"], headers=headers)
    assert dataset.status_code == 200 and dataset.content == TRAIN.read_bytes()
    assert httpx.get(config["dataset"]["train"], headers={"Authorization": "Bearer forged"}).status_code == 401
    other = config["dataset"]["train"].rsplit("/", 1)[0] + "/" + upload(alice, TRAIN).json()["id"]
    assert httpx.get(other, headers=headers).status_code == 404  # a file the job does not name
    records = [StartRecord(step=0, total_steps=20, steps_per_epoch=20, strategy="ddp", workers=8, device="cuda",
                           micro_batch_size=2, grad_accum=1, global_batch_size=16, seq_len=512, parameters=10**9,
                           trainable_parameters=10**7, train_examples=100, truncated_examples=0),
               StepRecord(step=5, epoch=0, loss=1.5, learning_rate=1e-4, grad_norm=0.5, tokens=40960,
                          tokens_per_second=9000.0, step_seconds=4.5, data_seconds=0.01,
                          forward_backward_seconds=4.0, optimizer_seconds=0.4)]
    receipt = httpx.post(config["metrics"]["endpoint"], headers=headers,
                         json={"records": [r.model_dump(mode="json") for r in records]})
    assert receipt.status_code == 200 and receipt.json()["accepted"] == 2, receipt.text
    assert alice.get(f"/v1/jobs/{job['id']}").json()["progress"]["step"] == 5

    # the operator shows the API's numbers in the FineTuneJob's status (kubectl get ftj: PROGRESS)
    kuberay_writes(cluster, "tw-team-a", {"dashboardURL": "http://head:8265"})  # any RayJob change wakes it
    status = wait_for(lambda: (s := cluster.get("FineTuneJob", "tw-team-a", job["id"])["status"]).get(
        "progress", {}).get("step") == 5 and s, what="progress in the FineTuneJob", operator=operator)
    assert status["progress"]["percent"] == 25.0 and status["telemetry"]["costUSD"] > 0

    output = f"{config['checkpoint']['storage']}/{name}"  # what the runtime writes, as the pods see it
    ended = [CheckpointRecord(step=10, uri=f"{output}/checkpoint-10", train_loss=1.2, keep_last=2),
             EndRecord(step=20, steps=20, final_loss=1.0, eval_before=None, eval_after=None,
                       export=ExportPaths(adapter=f"{output}/output/adapter"), strategy="ddp", workers=8,
                       resumed_from_step=0)]
    assert httpx.post(config["metrics"]["endpoint"], headers=headers,
                      json={"records": [r.model_dump(mode="json") for r in ended]}).json()["accepted"] == 2
    adapter = f"pvc://checkpoints/team/{name}/output/adapter"  # where a user finds it: on the claim
    assert alice.get(f"/v1/jobs/{job['id']}").json()["result"]["export"]["adapter"] == adapter
    checkpoints = alice.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert checkpoints[0]["fine_tuned_model_checkpoint"] == f"pvc://checkpoints/team/{name}/checkpoint-10"

    kuberay_writes(cluster, "tw-team-a", {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                                          "endTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    done = api_job(alice, job["id"], "succeeded", operator=operator)
    assert done["finishedAt"] and done["startedAt"]
    assert alice.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["fine_tuned_model"].endswith(job["id"])
    download = alice.get(f"/v1/jobs/{job['id']}/artifacts")  # the files are on the claim, not on this server
    assert download.status_code == 409 and adapter in download.json()["error"]["message"]
    messages = [e["message"] for e in alice.get(f"/v1/jobs/{job['id']}/events?limit=100").json()["data"]]
    assert any(m.startswith("Running (Training)") for m in messages)
    assert any(m.startswith("Succeeded (Succeeded)") for m in messages)


@pytest.mark.slow
def test_a_job_made_with_kubectl_is_its_namespaces_tenants_only(cluster_api):
    api, cluster, operator = cluster_api
    alice, bob = api.tenant("team-a"), api.tenant("team-b")
    # an administrator hands tw-team-a to team-a by its label; tw-team-b has no label (made by someone who
    # may create namespaces, before team-b ever submitted): it is not team-b's, and the API will not use it
    labelled = {"tw-team-a": "team-a", "tw-team-b": None, "tw-nobody": "nobody", "tw-wrong": "team-b"}
    for namespace, tenant in [*labelled.items(), ("default", None)]:
        if namespace != "default":
            cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": namespace, "labels": {TENANT_LABEL: tenant} if tenant else {}}})
        cluster.create({"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
                        "metadata": {"name": "by-hand", "namespace": namespace},
                        "spec": {**SPEC, "dataset": {"train": "pvc://datasets/train.jsonl"}}})
    taken = bob.post("/v1/jobs", json={**SPEC, "dataset": {"train": upload(bob, TRAIN).json()["id"]}})
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "tenant"
    assert "not labelled tunewright.dev/tenant=team-b" in taken.json()["error"]["message"]
    made = cluster.get("FineTuneJob", "tw-team-a", "by-hand")
    job_id = job_id_of(made["metadata"])
    listed = wait_for(lambda: alice.get("/v1/jobs").json()["data"], what="the kubectl job in the API")
    assert [j["id"] for j in listed] == [job_id] and listed[0]["spec"]["model"]["source"] == SPEC["model"]["source"]
    assert bob.get("/v1/jobs").json()["data"] == [] and bob.get(f"/v1/jobs/{job_id}").status_code == 404
    wait_for(lambda: cluster.list("RayJob", "tw-team-a"), what="its RayJob", operator=operator)
    events = [e["message"] for e in alice.get(f"/v1/jobs/{job_id}/events").json()["data"]]
    assert "created as FineTuneJob tw-team-a/by-hand (kubectl)" in events
    # the RayJob exists once the operator has planned; the API follows the plan at its next listing
    planned = wait_for(lambda: (job := alice.get(f"/v1/jobs/{job_id}").json()).get("plan") and job,
                       what="the operator's plan in the API", operator=operator)
    assert planned["status"] == "queued" and planned["plan"]["pool"] == "h100"

    cluster.delete("FineTuneJob", "tw-team-a", "by-hand")  # kubectl delete: the job is cancelled
    cancelled = api_job(alice, job_id, "cancelled", operator=operator, what="cancelled after kubectl delete")
    assert cancelled["finishedAt"]


@pytest.mark.slow
def test_cancel_suspends_then_deletes_the_finetunejob(cluster_api):
    api, cluster, operator = cluster_api
    alice = api.tenant("team-a")
    train = upload(alice, TRAIN).json()["id"]
    job = alice.post("/v1/jobs", json={**SPEC, "dataset": {"train": train}}).json()
    wait_for(lambda: cluster.list("RayJob", "tw-team-a"), what="the RayJob", operator=operator)
    cancelled = alice.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    wait_for(lambda: cluster.get("FineTuneJob", "tw-team-a", job["id"]) is None, what="the FineTuneJob gone",
             operator=operator)
    assert cluster.list("RayJob", "tw-team-a") == [] and cluster.list("Secret", "tw-team-a") == []
    assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409
    time.sleep(1)  # a few syncs later the job is still cancelled, not re-created from a lingering listing
    assert alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"


@pytest.mark.slow
def test_a_model_the_api_can_read_is_planned_by_the_operator_from_its_shape(cluster_api, tiny_models):
    api, cluster, operator = cluster_api
    alice = api.tenant("team-a")
    train = upload(alice, TRAIN).json()["id"]
    job = alice.post("/v1/jobs", json={**SPEC, "model": {"source": str(tiny_models["llama"])},
                                       "dataset": {"train": train}}).json()
    shape = json.loads(cluster.get("FineTuneJob", "tw-team-a", job["id"])["metadata"]["annotations"][
        MODEL_SHAPE_ANNOTATION])
    assert shape["num_hidden_layers"] == 2
    wait_for(lambda: cluster.list("RayJob", "tw-team-a"), what="a RayJob planned from the shape", operator=operator)


def test_what_the_operator_would_refuse_is_refused_at_submit_and_openai_jobs_get_the_default_storage(
        emulated_cluster, tmp_path):
    cluster = client_for(emulated_cluster)
    with Server(tmp_path / "bare", backend="kubernetes") as api:
        alice = api.tenant("team-a")
        train = upload(alice, TRAIN).json()["id"]
        for storage, field in ((None, "checkpoint.storage"), ("s3://bucket/x", "checkpoint.storage")):
            spec = {**SPEC, "dataset": {"train": train}, "checkpoint": {"storage": storage} if storage else {}}
            refused = alice.post("/v1/jobs", json=spec)
            assert refused.status_code == 422 and refused.json()["error"]["param"] == field, refused.text
        assert cluster.list("FineTuneJob") == []  # nothing half-made
        no_storage = alice.post("/v1/fine_tuning/jobs", json={"model": SPEC["model"]["source"], "training_file": train})
        assert no_storage.status_code == 400 and "checkpoint.storage" in no_storage.text
    with Server(tmp_path / "defaults", backend="kubernetes",
                kubernetes_checkpoint_storage="pvc://tunewright-checkpoints") as api:
        alice = api.tenant("team-a")
        train = upload(alice, TRAIN).json()["id"]
        created = alice.post("/v1/fine_tuning/jobs", json={"model": SPEC["model"]["source"], "training_file": train})
        assert created.status_code == 200, created.text
        ftj = cluster.get("FineTuneJob", "tw-team-a", created.json()["id"])
        assert ftj["spec"]["checkpoint"]["storage"] == "pvc://tunewright-checkpoints"
        assert alice.get(f"/v1/jobs/{created.json()['id']}").json()["spec"]["checkpoint"]["storage"] == (
            "pvc://tunewright-checkpoints")


@pytest.fixture
def cluster_api_alone(emulated_cluster, tmp_path):
    """The API on the kubernetes backend with no operator: the test writes what the operator would."""
    with Server(tmp_path / "data", backend="kubernetes", kubernetes_sync_seconds=0.2) as api:
        yield api, client_for(emulated_cluster), api.app.state.backend


def test_a_job_is_not_cancelled_because_following_it_failed(cluster_api_alone, monkeypatch):
    api, cluster, backend = cluster_api_alone
    alice = api.tenant("team-a")
    job = alice.post("/v1/jobs", json={**SPEC, "dataset": {"train": upload(alice, TRAIN).json()["id"]}}).json()
    monkeypatch.setattr("tunewright_api.backends.kubernetes.VANISHED_AFTER_SECONDS", 0.0)

    def broken(*_):
        raise RuntimeError("a status this API cannot follow")

    monkeypatch.setattr(backend, "_follow", broken)
    time.sleep(1.5)  # several syncs, each failing to follow it: it is listed, so it is not gone
    assert alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    monkeypatch.undo()
    monkeypatch.setattr("tunewright_api.backends.kubernetes.VANISHED_AFTER_SECONDS", 0.0)
    cluster.delete("FineTuneJob", "tw-team-a", job["id"])
    assert api_job(alice, job["id"], "cancelled", what="cancelled once really gone")["status"] == "cancelled"


def test_a_finetunejob_the_api_is_still_recording_is_not_taken_for_a_kubectl_one(cluster_api_alone):
    api, cluster, backend = cluster_api_alone
    alice = api.tenant("team-a")
    alice.post("/v1/jobs", json={**SPEC, "dataset": {"train": upload(alice, TRAIN).json()["id"]}})  # the namespace
    orphan = cluster.create({"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {
        "name": "ftjob-0123456789abcdef01234567", "namespace": "tw-team-a",
        "labels": {"app.kubernetes.io/managed-by": "tunewright-api"},
        "annotations": {"tunewright.dev/job-id": "ftjob-0123456789abcdef01234567"}},
        "spec": {**SPEC, "dataset": {"train": "pvc://datasets/train.jsonl"}}})
    time.sleep(1)  # syncs meanwhile: its submit may still be committing the row
    assert alice.get(f"/v1/jobs/{orphan['metadata']['name']}").status_code == 404
    adopted = wait_for(lambda: alice.get(f"/v1/jobs/{orphan['metadata']['name']}").status_code == 200,
                       what="the orphan adopted after the grace", timeout=15)
    assert adopted
    events = [e["message"] for e in alice.get(f"/v1/jobs/{orphan['metadata']['name']}/events").json()["data"]]
    assert any("its submit did not complete: adopted" in m for m in events)


def test_until_it_runs_a_kubectl_edit_of_the_spec_is_the_jobs_spec(cluster_api_alone):
    api, cluster, backend = cluster_api_alone
    alice = api.tenant("team-a")
    job = alice.post("/v1/jobs", json={**SPEC, "dataset": {"train": upload(alice, TRAIN).json()["id"]}}).json()
    cluster.patch("FineTuneJob", "tw-team-a", job["id"], {"spec": {"hyperparameters": {"maxSteps": 40}}})
    wait_for(lambda: alice.get(f"/v1/jobs/{job['id']}").json()["spec"]["hyperparameters"]["maxSteps"] == 40,
             what="the edited spec in the API")
    cluster.patch_status("FineTuneJob", "tw-team-a", job["id"], {"phase": "Queued", "rayJobName": "x-123456"})
    time.sleep(0.6)
    cluster.patch("FineTuneJob", "tw-team-a", job["id"], {"spec": {"hyperparameters": {"maxSteps": 80}}})
    time.sleep(1)  # running: the operator ignores the edit (SpecChangeIgnored), and so does the job
    assert alice.get(f"/v1/jobs/{job['id']}").json()["spec"]["hyperparameters"]["maxSteps"] == 40
