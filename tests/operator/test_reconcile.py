"""The reconciler against an in-memory API server, playing KubeRay by writing the RayJob's status:
submit → planned → RayJob created → running → succeeded; infeasible; no pool; unschedulable; suspend and
resume; and an operator killed before every write of a reconcile ends with exactly one of each object."""

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta

import pytest

from tests.support.fake_cluster import Crash, FakeCluster
from tunewright_core.names import TOKEN_HASH_ANNOTATION
from tunewright_operator.manifests import ClusterSettings, Target, ray_job_name
from tunewright_operator.reconcile import reconcile

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SETTINGS = ClusterSettings(api_url="http://tunewright-api.tunewright.svc:8000", job_token_key=b"k" * 32)
POOL = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "h100"},
        "spec": {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 2, "intraNode": "nvlink4", "interNode": "ib-8x400g",
                 "pricePerGPUHour": 2.5, "workerImage": "example/worker:0.1.0", "default": True}}
SPEC = {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "lora"},
        "dataset": {"train": "pvc://datasets/support/train.jsonl"},
        "hyperparameters": {"maxSteps": 500, "globalBatchSize": 64},
        "checkpoint": {"storage": "pvc://checkpoints/llama", "everySteps": 100}}


def finetunejob(spec=None, name="llama-lora") -> dict:
    return {"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}"}, "spec": spec or SPEC}


def cluster_with(*objects, crash_after=None) -> FakeCluster:
    cluster = FakeCluster(crash_after_writes=crash_after)
    for obj in objects:
        cluster.add(obj)
    return cluster


def run(cluster, name="llama-lora", at=NOW):
    return reconcile(cluster.get("FineTuneJob", "team-a", name), cluster, SETTINGS, at)


def job_status(cluster, name="llama-lora") -> dict:
    return cluster.get("FineTuneJob", "team-a", name)["status"]


def rayjob(cluster, name="llama-lora") -> dict:
    (found,) = cluster.list("RayJob", "team-a")
    return found


def kuberay_writes(cluster, status: dict) -> None:
    found = rayjob(cluster)
    cluster.objects[("RayJob", "team-a", found["metadata"]["name"])]["status"] = status


def test_submitted_planned_created_running_succeeded():
    cluster = cluster_with(POOL, finetunejob())
    outcome = run(cluster)
    status = job_status(cluster)
    assert outcome.phase == status["phase"] == "Queued"
    assert status["plan"]["pool"] == "h100" and status["plan"]["strategy"] in ("single", "ddp", "fsdp", "hsdp")
    assert status["rayJobName"] == ray_job_name(Target("team-a", "llama-lora", "uid-llama-lora", "x"))
    assert (cluster.count("RayJob"), cluster.count("ConfigMap"), cluster.count("Secret")) == (1, 1, 1)
    assert [e["reason"] for e in cluster.events] == ["Planned", "RayJobCreated", "WaitingForKubeRay"]
    kuberay_writes(cluster, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                             "dashboardURL": "llama-head-svc:8265", "startTime": "2026-12-01T12:01:00Z"})
    assert run(cluster, at=NOW + timedelta(minutes=1)).phase == "Running"
    status = job_status(cluster)
    assert status["dashboardURL"] == "llama-head-svc:8265" and status["startTime"].startswith("2026-12-01T12:01")
    running = {c["type"]: c for c in status["conditions"]}["Running"]
    assert (running["status"], running["reason"]) == ("True", "Training")
    kuberay_writes(cluster, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                             "startTime": "2026-12-01T12:01:00Z", "endTime": "2026-12-01T13:00:00Z"})
    outcome = run(cluster, at=NOW + timedelta(hours=1))
    assert outcome.phase == "Succeeded"
    assert job_status(cluster)["completionTime"].startswith("2026-12-01T13:00")
    writes = cluster.writes
    run(cluster, at=NOW + timedelta(hours=2))
    assert cluster.writes == writes  # finished: nothing more to say


def test_an_infeasible_job_fails_with_the_planners_reasons_before_any_gpu_is_requested():
    spec = {**SPEC, "model": {"source": "meta-llama/Llama-3.1-70B"}, "method": {"type": "full"},
            "resources": {"maxGPUs": 1}}
    cluster = cluster_with(POOL, finetunejob(spec))
    outcome = run(cluster)
    assert (outcome.phase, outcome.reason) == ("Failed", "NoPlan") and "does not fit" in outcome.message
    assert cluster.count("RayJob") == cluster.count("Secret") == 0
    failed = {c["type"]: c for c in job_status(cluster)["conditions"]}["Failed"]
    assert failed["status"] == "True" and "does not fit" in failed["message"]
    assert cluster.events[-1]["type"] == "Warning"


def test_a_misspelt_key_fails_the_job_naming_the_key_it_meant():
    spec = {**SPEC, "hyperparameters": {**SPEC["hyperparameters"], "learningRte": 1e-4}}
    cluster = cluster_with(POOL, finetunejob(spec))
    outcome = run(cluster)
    assert (outcome.phase, outcome.reason) == ("Failed", "InvalidSpec")
    failed = {c["type"]: c for c in job_status(cluster)["conditions"]}["Failed"]
    assert failed["message"] == "spec.hyperparameters.learningRte: unknown key; did you mean learningRate?"
    assert cluster.count("RayJob") == 0


def test_without_a_pool_the_job_waits_and_says_what_to_do():
    cluster = cluster_with(finetunejob())
    outcome = run(cluster)
    assert (outcome.phase, outcome.reason) == ("Pending", "PoolNotFound")
    assert "default: true" in outcome.message
    cluster.add(POOL)
    assert run(cluster).phase == "Queued" and cluster.count("RayJob") == 1


def test_an_unschedulable_cluster_says_which_resource_is_short():
    cluster = cluster_with(POOL, finetunejob())
    run(cluster)
    kuberay_writes(cluster, {"jobDeploymentStatus": "Initializing", "rayClusterName": "llama-raycluster-abc"})
    cluster.add({"kind": "Pod", "metadata": {"name": "llama-raycluster-abc-worker-0", "namespace": "team-a",
                                             "labels": {"ray.io/cluster": "llama-raycluster-abc"}}})
    cluster.add({"kind": "Event", "metadata": {"name": "e1", "namespace": "team-a"}, "type": "Warning",
                 "reason": "FailedScheduling", "involvedObject": {"name": "llama-raycluster-abc-worker-0"},
                 "message": "0/8 nodes are available: 8 Insufficient nvidia.com/gpu."})
    outcome = run(cluster)
    assert (outcome.phase, outcome.reason) == ("Queued", "Unschedulable")
    running = {c["type"]: c for c in job_status(cluster)["conditions"]}["Running"]
    assert running["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in running["message"]
    assert (cluster.events[-1]["type"], cluster.events[-1]["reason"]) == ("Warning", "Unschedulable")
    events = len(cluster.events)
    run(cluster)
    assert len(cluster.events) == events  # said once, not at every look


def test_suspend_holds_the_rayjob_and_resume_releases_it():
    cluster = cluster_with(POOL, finetunejob())
    run(cluster)
    kuberay_writes(cluster, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
    run(cluster)
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"suspend": True}})
    run(cluster)
    assert rayjob(cluster)["spec"]["suspend"] is True
    kuberay_writes(cluster, {"jobDeploymentStatus": "Suspended", "jobStatus": "STOPPED"})
    assert run(cluster).phase == "Suspended"
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"suspend": False}})
    run(cluster)
    assert rayjob(cluster)["spec"]["suspend"] is False and cluster.count("RayJob") == 1


def test_a_spec_change_before_anything_runs_is_planned_again():
    cluster = cluster_with(cluster_pool := {**POOL, "spec": {**POOL["spec"], "default": False}}, finetunejob(
        {**SPEC, "resources": {"pool": "missing"}}))
    assert run(cluster).reason == "PoolNotFound"
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"resources": {"pool": cluster_pool["metadata"]
                                                                                  ["name"]}}})
    assert run(cluster).phase == "Queued" and job_status(cluster)["observedGeneration"] == 2


def test_operator_killed_before_any_write_ends_with_exactly_one_of_everything():
    complete = cluster_with(POOL, finetunejob())
    run(complete)
    for crash_after in range(complete.writes):
        cluster = cluster_with(POOL, finetunejob(), crash_after=crash_after)
        with pytest.raises(Crash):
            run(cluster)
        cluster.crash_after = None  # the restarted operator
        assert run(cluster).phase == "Queued", crash_after
        assert (cluster.count("RayJob"), cluster.count("ConfigMap"), cluster.count("Secret")) == (1, 1, 1)
        (secret,) = cluster.stored("Secret")  # (the operator itself never reads one: FakeCluster forbids it)
        token = secret.get("stringData", {}).get("token") or base64.b64decode(secret["data"]["token"]).decode()
        annotations = cluster.get("FineTuneJob", "team-a", "llama-lora")["metadata"]["annotations"]
        assert annotations[TOKEN_HASH_ANNOTATION] == hashlib.sha256(token.encode()).hexdigest()
        assert job_status(cluster)["plan"] == job_status(complete)["plan"]


def test_deleting_a_job_deletes_what_it_created_at_once():
    from tunewright_operator.reconcile import clean_up

    cluster = cluster_with(POOL, finetunejob(), finetunejob(name="other"))
    run(cluster)
    run(cluster, name="other")
    deleted = clean_up(cluster.get("FineTuneJob", "team-a", "llama-lora"), cluster)
    assert [d.split("/")[0] for d in deleted] == ["RayJob", "ConfigMap", "Secret"]
    assert (cluster.count("RayJob"), cluster.count("ConfigMap"), cluster.count("Secret")) == (1, 1, 1)  # the other's
    assert clean_up(cluster.get("FineTuneJob", "team-a", "llama-lora"), cluster) == []  # idempotent


def test_a_job_being_deleted_gets_nothing_new():
    job = finetunejob()
    job["metadata"]["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    cluster = cluster_with(POOL, job)
    assert run(cluster).reason == "Deleting" and cluster.count("RayJob") == cluster.count("Secret") == 0


def test_a_change_a_running_job_cannot_take_is_said_not_ignored():
    cluster = cluster_with(POOL, finetunejob())
    run(cluster)
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"resources": {"maxGPUs": 2}}})
    run(cluster)
    ignored = {c["type"]: c for c in job_status(cluster)["conditions"]}["SpecApplied"]
    assert (ignored["status"], ignored["reason"]) == ("False", "SpecChangeIgnored")
    assert [e["reason"] for e in cluster.events].count("SpecChangeIgnored") == 1
    run(cluster)
    assert [e["reason"] for e in cluster.events].count("SpecChangeIgnored") == 1  # said once
    assert cluster.count("RayJob") == 1
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"resources": {"maxGPUs": None}}})
    run(cluster)
    applied = {c["type"]: c for c in job_status(cluster)["conditions"]}["SpecApplied"]
    assert (applied["status"], applied["reason"]) == ("True", "Applied")


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_change_after_the_job_ended_is_said_not_silently_accepted(phase):
    cluster = cluster_with(POOL, finetunejob())
    run(cluster)
    kuberay_writes(cluster, {"jobDeploymentStatus": "Complete" if phase == "Succeeded" else "Failed",
                             "jobStatus": phase.upper(), "endTime": "2026-12-01T13:00:00Z"})
    assert run(cluster).phase == phase
    writes = cluster.writes
    assert run(cluster).reason == "Finished" and cluster.writes == writes  # an ended job is left alone
    cluster.patch("FineTuneJob", "team-a", "llama-lora", {"spec": {"hyperparameters": {"maxSteps": 900}}})
    assert run(cluster).reason == "JobEnded"
    status = job_status(cluster)
    applied = {c["type"]: c for c in status["conditions"]}["SpecApplied"]
    assert (applied["status"], applied["reason"]) == ("False", "JobEnded") and phase in applied["message"]
    assert "create a new FineTuneJob" in applied["message"]
    assert status["phase"] == phase and status["observedGeneration"] == 2 and cluster.count("RayJob") == 1
    assert [e["reason"] for e in cluster.events].count("JobEnded") == 1
    assert run(cluster).reason == "Finished"
    assert [e["reason"] for e in cluster.events].count("JobEnded") == 1  # said once


def test_the_operator_reads_no_secret_and_its_token_survives_a_restart():
    """The token is derived from the operator's key: made again after a restart (for the API's summary)
    without reading the Secret, which the chart no longer lets it read."""
    from tunewright_operator.manifests import job_token

    asked = []
    cluster = cluster_with(POOL, finetunejob())
    reconcile(cluster.get("FineTuneJob", "team-a", "llama-lora"), cluster, SETTINGS, NOW,
              lambda target, token: asked.append(token))
    (secret,) = cluster.stored("Secret")
    assert secret["stringData"]["token"] == job_token(SETTINGS, Target("team-a", "llama-lora", "uid-llama-lora", ""))
    assert asked == [secret["stringData"]["token"]]
    other_key = ClusterSettings(api_url=SETTINGS.api_url, job_token_key=b"o" * 32)
    assert job_token(other_key, Target("team-a", "llama-lora", "uid-llama-lora", "")) != asked[0]


def test_a_model_outside_the_catalog_is_planned_from_its_annotated_shape():
    from tunewright_core.names import MODEL_SHAPE_ANNOTATION
    from tunewright_core.planner.models import CATALOG, hf_config

    spec = {**SPEC, "model": {"source": "pvc://models/our-llama"}}
    unknown = cluster_with(POOL, finetunejob(spec))
    assert run(unknown).phase == "Failed"
    assert MODEL_SHAPE_ANNOTATION in job_status(unknown)["conditions"][0]["message"]

    shaped = finetunejob(spec)
    shaped["metadata"]["annotations"] = {
        MODEL_SHAPE_ANNOTATION: json.dumps(hf_config(CATALOG["meta-llama/Llama-3.1-8B"]))}
    cluster = cluster_with(POOL, shaped)
    assert run(cluster).phase == "Queued" and job_status(cluster)["plan"]["strategy"]



@pytest.mark.parametrize(("shape", "says"), [
    ('{"hidden_size": 4096}', "]: model config.json of pvc://models/our-llama lacks 'num_attention_heads'"),
    ('{"model_type": "gpt2", "n_embd": 768}', "]: lacks or mistypes 'n_layer'"),
    ('{"num_attention_heads": 0}', "].num_attention_heads: must be a positive integer, got 0"),
    ('{"hidden_size": 4096.5}', "].hidden_size: must be a positive integer"),
    ('{"num_attention_heads": 8, "hidden_size": "4096", "num_hidden_layers": 2, "intermediate_size": 8,'
     ' "vocab_size": 8}', "]: lacks or mistypes"),
    ("[1, 2]", "]: a JSON object of config.json's keys, not list"),
    ('{"hidden_size": ', "]: not JSON"),
    ('{"x": "' + "y" * 20000 + '"}', "]: longer than 16384 characters"),
])
def test_a_bad_model_shape_fails_the_job_naming_the_annotation(shape, says):
    from tunewright_core.names import MODEL_SHAPE_ANNOTATION

    job = finetunejob({**SPEC, "model": {"source": "pvc://models/our-llama"}})
    job["metadata"]["annotations"] = {MODEL_SHAPE_ANNOTATION: shape}
    cluster = cluster_with(POOL, job)
    assert run(cluster).phase == "Failed"
    message = job_status(cluster)["conditions"][0]["message"]
    assert message.startswith(f"metadata.annotations[{MODEL_SHAPE_ANNOTATION}") and says in message, message


def test_the_api_plan_of_record_is_adopted_while_its_spec_and_pool_match(monkeypatch):
    """One plan per job: the operator runs the plan the API made and wrote onto the FineTuneJob, without
    planning again; a plan written for another spec is not adopted (the job is planned here)."""
    from tunewright_core.names import PLAN_ANNOTATION
    from tunewright_core.plan_of_record import plan_annotation
    from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan
    from tunewright_operator import reconcile as reconciler

    api_plan = JobPlan(pool="h100", strategy="fsdp", workers=16, gpus=16, nodes=2, micro_batch=1, grad_accum=4,
                       explanation="the API's plan of record")
    spec, pool = FineTuneJobSpec.model_validate(SPEC), GPUPoolSpec.model_validate(POOL["spec"])
    job = finetunejob()
    job["metadata"]["annotations"] = {PLAN_ANNOTATION: plan_annotation(spec, "h100", pool, api_plan)}

    def no_planning(*args, **kwargs):
        raise AssertionError("the operator planned a job whose plan of record matched")

    with monkeypatch.context() as patched:
        patched.setattr(reconciler, "plan_job", no_planning)
        cluster = cluster_with(POOL, job)
        assert run(cluster).phase == "Queued"
    assert JobPlan.model_validate(job_status(cluster)["plan"]) == api_plan
    assert rayjob(cluster)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 2

    other = spec.model_copy(update={"hyperparameters": spec.hyperparameters.model_copy(update={"max_steps": 7})})
    stale = finetunejob()
    stale["metadata"]["annotations"] = {PLAN_ANNOTATION: plan_annotation(other, "h100", pool, api_plan)}
    cluster = cluster_with(POOL, stale)
    assert run(cluster).phase == "Queued"
    assert job_status(cluster)["plan"]["explanation"] != api_plan.explanation
