"""The real operator (`kopf run`) against an emulated API server over HTTP, the test playing KubeRay.

Scenarios: submit → planned → RayJob created → running → succeeded with its cost; infeasible; unschedulable;
suspend and resume; delete with cleanup; a spec the CRD refuses; and an operator killed at every write it
makes while starting a job, then restarted, ending with exactly one RayJob and a consistent status.
"""

from __future__ import annotations

import copy
import hashlib
import subprocess
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from tests.support.apiserver import FakeApiServer, crd_document
from tests.support.emulated import (
    CRDS,
    ROOT,
    Operator,
    client_for,
    crds_installed,
    resources,
    secret_token,
    wait_for,
)
from tunewright_core.crds import SCHEMA_DIGEST
from tunewright_core.k8s import KubernetesError
from tunewright_core.names import TOKEN_HASH_ANNOTATION

pytestmark = pytest.mark.slow

POOL = yaml.safe_load((ROOT / "examples" / "cluster" / "gpupool-h100.yaml").read_text())
JOB = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "llama-lora"},
       "spec": {"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "lora"},
                "dataset": {"train": "pvc://datasets/support/train.jsonl"},
                "hyperparameters": {"maxSteps": 500, "globalBatchSize": 64},
                "checkpoint": {"storage": "pvc://checkpoints/llama", "everySteps": 100}}}


def job_in(namespace: str, **spec_changes) -> dict:
    job = copy.deepcopy(JOB)
    job["metadata"]["namespace"] = namespace
    job["spec"].update(spec_changes)
    return job


@pytest.fixture(scope="module")
def server():
    server = crds_installed().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(server):
    cluster = client_for(server)
    cluster.create(POOL)
    return cluster


@pytest.fixture(scope="module")
def operator(server, cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("operator")
    running = Operator(server.write_kubeconfig(folder / "kubeconfig"), folder / "operator.log").start()
    yield running
    running.stop()


@pytest.fixture
def namespace(cluster, request) -> str:
    name = request.node.name.removeprefix("test_").replace("_", "-")[:50].strip("-")
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def status_of(cluster, namespace, name="llama-lora") -> dict:
    found = cluster.get("FineTuneJob", namespace, name)
    return (found or {}).get("status") or {}


def phase_is(cluster, namespace, *phases, name="llama-lora"):
    return lambda: status_of(cluster, namespace, name).get("phase") in phases and status_of(cluster, namespace, name)


def kuberay_writes(cluster, namespace: str, status: dict) -> None:
    (rayjob,) = cluster.list("RayJob", namespace)
    cluster.patch_status("RayJob", namespace, rayjob["metadata"]["name"], status)


def reasons(cluster, namespace) -> list[str]:
    return [e["reason"] for e in sorted(cluster.list("Event", namespace), key=lambda e: e["metadata"]["name"])]


def test_submitted_planned_running_succeeded_with_cost(server, cluster, operator, namespace):
    cluster.create(job_in(namespace))
    status = wait_for(lambda: status_of(cluster, namespace).get("rayJobName") and status_of(cluster, namespace),
                      what="the RayJob to be created", operator=operator)
    assert status["phase"] == "Queued" and status["plan"]["strategy"] and status["plan"]["gpus"] >= 1
    job = cluster.get("FineTuneJob", namespace, "llama-lora")
    assert job["metadata"]["finalizers"] == ["tunewright.dev/cleanup"]
    (rayjob,) = cluster.list("RayJob", namespace)
    assert rayjob["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert not [p for p in server.pruned if p[0].startswith("RayJob/")], server.pruned
    secret = cluster.get("Secret", namespace, f"{rayjob['metadata']['name']}-telemetry")
    assert job["metadata"]["annotations"][TOKEN_HASH_ANNOTATION] and secret_token(secret).startswith("tw-")
    assert cluster.get("ConfigMap", namespace, f"{rayjob['metadata']['name']}-config")

    started = datetime.now(UTC) - timedelta(hours=1)
    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                        "startTime": started.strftime("%Y-%m-%dT%H:%M:%SZ")})
    running = wait_for(phase_is(cluster, namespace, "Running"), what="Running", operator=operator)
    assert running["telemetry"]["costUSD"] >= round(running["plan"]["gpus"] * 2.5, 2)  # an hour held at $2.5

    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                                        "endTime": (started + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")})
    done = wait_for(phase_is(cluster, namespace, "Succeeded"), what="Succeeded", operator=operator)
    assert done["telemetry"]["costUSD"] == round(done["plan"]["gpus"] * 2 * 2.5, 2)
    assert done["completionTime"].startswith((started + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M"))
    assert {"Planned", "RayJobCreated", "Training", "Succeeded"} <= set(reasons(cluster, namespace))


def test_infeasible_job_fails_with_the_planners_reasons_and_requests_no_gpu(cluster, operator, namespace):
    cluster.create(job_in(namespace, method={"type": "full"}, model={"source": "hf://meta-llama/Llama-3.1-70B"},
                          resources={"maxGPUs": 8, "budgetUSD": 5}))
    failed = wait_for(phase_is(cluster, namespace, "Failed"), what="Failed", operator=operator)
    (condition,) = [c for c in failed["conditions"] if c["type"] == "Failed"]
    assert condition["reason"] == "NoPlan" and "budget" in condition["message"]
    assert cluster.list("RayJob", namespace) == []
    event = next(e for e in cluster.list("Event", namespace) if e["reason"] == "NoPlan")
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "FineTuneJob"


def test_unschedulable_pods_are_named_in_the_condition(cluster, operator, namespace):
    cluster.create(job_in(namespace))
    wait_for(lambda: cluster.list("RayJob", namespace), what="the RayJob", operator=operator)
    pod = cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "llama-head", "namespace": namespace, "labels": {"ray.io/cluster": "llama-raycluster"}},
        "spec": {"containers": [{"name": "ray-head", "image": "example/worker:0.1.0"}]}})
    cluster.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "llama-head.1", "namespace": namespace},
                    "involvedObject": {"kind": "Pod", "name": "llama-head", "namespace": namespace,
                                       "uid": pod["metadata"]["uid"]},
                    "type": "Warning", "reason": "FailedScheduling",
                    "message": "0/8 nodes are available: 8 Insufficient nvidia.com/gpu.",
                    "lastTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Initializing", "rayClusterName": "llama-raycluster"})
    status = wait_for(lambda: any(c["reason"] == "Unschedulable" for c in status_of(cluster, namespace)["conditions"])
                      and status_of(cluster, namespace), what="Unschedulable", operator=operator)
    (condition,) = [c for c in status["conditions"] if c["reason"] == "Unschedulable"]
    assert "Insufficient nvidia.com/gpu" in condition["message"] and status["phase"] == "Queued"


def test_suspend_and_resume_through_the_spec(cluster, operator, namespace):
    cluster.create(job_in(namespace))
    wait_for(lambda: cluster.list("RayJob", namespace), what="the RayJob", operator=operator)
    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
    wait_for(phase_is(cluster, namespace, "Running"), what="Running", operator=operator)

    cluster.patch("FineTuneJob", namespace, "llama-lora", {"spec": {"suspend": True}})
    wait_for(lambda: cluster.list("RayJob", namespace)[0]["spec"].get("suspend") is True,
             what="the RayJob suspended", operator=operator)
    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Suspended", "jobStatus": "STOPPED"})
    suspended = wait_for(phase_is(cluster, namespace, "Suspended"), what="Suspended", operator=operator)
    assert any(c["type"] == "Suspended" and c["status"] == "True" for c in suspended["conditions"])

    cluster.patch("FineTuneJob", namespace, "llama-lora", {"spec": {"suspend": False}})
    wait_for(lambda: cluster.list("RayJob", namespace)[0]["spec"].get("suspend") is False,
             what="the RayJob resumed", operator=operator)
    kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
    wait_for(phase_is(cluster, namespace, "Running"), what="Running again", operator=operator)
    assert len(cluster.list("RayJob", namespace)) == 1


def test_deleting_a_job_removes_everything_it_created(cluster, operator, namespace):
    cluster.create(job_in(namespace))
    wait_for(lambda: cluster.list("RayJob", namespace), what="the RayJob", operator=operator)
    cluster.delete("FineTuneJob", namespace, "llama-lora")
    wait_for(lambda: cluster.get("FineTuneJob", namespace, "llama-lora") is None, what="the job gone",
             operator=operator)
    assert [cluster.list(kind, namespace) for kind in ("RayJob", "ConfigMap", "Secret")] == [[], [], []]


def test_the_crd_refuses_a_bad_spec_naming_the_field(cluster, namespace):
    with pytest.raises(KubernetesError) as refused:
        cluster.create(job_in(namespace, method={"type": "qlora"}))
    assert refused.value.status == 422 and "spec.method.type" in str(refused.value)


def test_the_operator_stops_on_an_earlier_releases_crd_naming_the_fields_and_the_fix(tmp_path):
    """A cluster whose GPUPool CRD a chart from before measuredEfficiency installed (Helm never upgraded it):
    the operator exits at startup, and its log names the CRD, the field and the command that fixes it."""
    installed = [crd_document(path) for path in sorted(CRDS.glob("*.yaml"))]
    (pools,) = [crd for crd in installed if crd["metadata"]["name"] == "gpupools.tunewright.dev"]
    del pools["metadata"]["annotations"][SCHEMA_DIGEST]
    del pools["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "measuredEfficiency"]
    server = FakeApiServer(list(resources()), installed=installed).start()
    operator = Operator(server.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path / "operator.log")
    try:
        assert operator.start().process.wait(60) != 0
    finally:
        operator.stop()
        server.stop()
    log = operator.tail(400)
    assert ("failed permanently: gpupools.tunewright.dev is another release's and would refuse or prune what this "
            "one writes (.status.measuredEfficiency: missing): apply this release's CRDs (`helm show crds CHART") in log
    assert "| kubectl apply --server-side --force-conflicts -f -`" in log, log


def test_gpupools_carry_no_finalizer_that_would_outlive_the_operator(cluster, operator):
    """Discovery runs in one loop, not a kopf timer per pool (which needs a finalizer): a pool that still has
    the finalizer from an earlier operator loses it, so deleting pools after the operator never hangs."""
    older = copy.deepcopy(POOL)
    older["metadata"] = {"name": "from-an-earlier-operator", "finalizers": ["tunewright.dev/cleanup"]}
    older["spec"]["default"] = False  # the module's jobs keep one default pool
    cluster.create(older)
    for name in ("h100", "from-an-earlier-operator"):
        wait_for(lambda n=name: (cluster.get("GPUPool", None, n).get("status") or {}).get("observedGeneration")
                 and not cluster.get("GPUPool", None, n)["metadata"].get("finalizers"),
                 what=f"GPUPool {name} discovered, with no finalizer", operator=operator)
    operator.stop()  # as `helm uninstall` does, before it deletes the pools it made
    try:
        cluster.delete("GPUPool", None, "from-an-earlier-operator")
        wait_for(lambda: cluster.get("GPUPool", None, "from-an-earlier-operator") is None,
                 what="the pool deleted with no operator running")
    finally:
        operator.start()


def test_an_operator_killed_at_every_write_ends_with_one_rayjob(tmp_path):
    """The operator is SIGKILLed the moment the API server has applied its n-th write (before it reads the
    answer), for n = 1, 2, ... until a start completes unkilled; each time a new operator finishes the job.
    An API server of its own: no other operator may write (or reconcile) meanwhile."""
    server = crds_installed().start()
    try:
        cluster = client_for(server)
        cluster.create(POOL)
        kill_at = 1
        while kill_then_recover(server, cluster, tmp_path, kill_at):
            kill_at += 1
    finally:
        server.stop()
    assert kill_at > 5  # starting a job takes several writes: each was a kill point


def kill_then_recover(server, cluster, folder, kill_at: int) -> bool:
    """True when the operator was killed at write `kill_at` (False: it started the job with fewer writes)."""
    namespace, kubeconfig = f"sweep-{kill_at}", server.write_kubeconfig(folder / "kubeconfig")
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    first = Operator(kubeconfig, folder / f"operator-{kill_at}.log").start()
    base = server.writes
    server.on_write = lambda count: count == base + kill_at and first.kill()
    try:
        cluster.create(job_in(namespace))
        wait_for(lambda: first.process.poll() is not None or status_of(cluster, namespace).get("rayJobName"),
                 what=f"a kill at write {kill_at} or the job started", operator=first)
        killed = first.process.poll() is not None
    finally:
        server.on_write = None
        first.stop()
    second = Operator(kubeconfig, folder / f"operator-{kill_at}-again.log").start()
    try:
        wait_for(lambda: status_of(cluster, namespace).get("rayJobName"), what=f"recovery after write {kill_at}",
                 operator=second)
        kuberay_writes(cluster, namespace, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        wait_for(phase_is(cluster, namespace, "Running"), what="Running after the restart", operator=second)
    finally:
        second.stop()
    (rayjob,) = cluster.list("RayJob", namespace)
    job = cluster.get("FineTuneJob", namespace, "llama-lora")
    assert len(cluster.list("ConfigMap", namespace)) == len(cluster.list("Secret", namespace)) == 1
    secret = cluster.get("Secret", namespace, f"{rayjob['metadata']['name']}-telemetry")
    assert job["metadata"]["annotations"][TOKEN_HASH_ANNOTATION] == hashlib.sha256(
        secret_token(secret).encode()).hexdigest()
    assert job["metadata"]["finalizers"] == ["tunewright.dev/cleanup"]
    return killed


KUBECTL = ROOT / ".tools" / "bin" / "kubectl"


def test_kubectl_apply_get_describe_delete(server, cluster, operator, tmp_path):
    """A real kubectl (1.35, fetched by `make tools`) through the user's path: apply the examples, list them
    with the printer columns, describe one with its events, delete it and wait for the cleanup."""
    assert KUBECTL.exists(), f"{KUBECTL} is missing: run `make tools` (CI's `make test` does)"
    env = {"KUBECONFIG": str(server.write_kubeconfig(tmp_path / "kubeconfig")), "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin"}

    def kubectl(*args, ok=True):
        done = subprocess.run([str(KUBECTL), *args], env=env, capture_output=True, text=True, timeout=60)
        assert (done.returncode == 0) == ok, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    applied = kubectl("apply", "--validate=false", "-n", "team-a", "-f", str(ROOT / "examples" / "cluster"))
    assert "finetunejob.tunewright.dev/llama-8b-support-lora created" in applied
    wait_for(lambda: status_of(cluster, "team-a", "llama-8b-support-lora").get("rayJobName"),
             what="the example's RayJob", operator=operator)

    listed = kubectl("get", "ftj", "-n", "team-a").splitlines()
    assert listed[0].split() == ["NAME", "PHASE", "STRATEGY", "GPUS", "PROGRESS", "MFU", "COMM", "COST", "AGE"]
    row = next(line.split() for line in listed if line.startswith("llama-8b-support-lora"))
    plan = status_of(cluster, "team-a", "llama-8b-support-lora")["plan"]
    assert row[1:4] == ["Queued", plan["strategy"], str(plan["gpus"])]
    assert "RAYJOB" in kubectl("get", "ftj", "-n", "team-a", "-o", "wide").splitlines()[0]
    assert "h100" in kubectl("get", "tunewright", "-A")

    described = kubectl("describe", "ftj", "-n", "team-a", "llama-8b-support-lora")
    events = described.split("Events:")[1]
    assert "RayJobCreated" in events and "Planned" in events and "tunewright-operator" in events

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job_in("team-a", method={"type": "qlora"})))
    assert "spec.method.type" in kubectl("apply", "--validate=false", "-f", str(bad), ok=False)

    kubectl("delete", "ftj", "-n", "team-a", "llama-8b-support-lora", "--timeout=30s")
    assert status_of(cluster, "team-a", "qwen-7b-full")  # the other job is untouched
    assert cluster.get("FineTuneJob", "team-a", "llama-8b-support-lora") is None
    assert not [r for r in cluster.list("RayJob", "team-a") if r["metadata"]["name"].startswith("llama-8b")]
