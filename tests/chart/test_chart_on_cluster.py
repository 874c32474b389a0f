"""The chart installed into the emulated API server with a real kubectl, then its operator and its API run
as the chart runs them: the Deployments' commands and environment (the admin token from the chart's own
Secret), each with its service account's credentials held to the chart's ClusterRoles. A job goes through
the REST API and one through kubectl, to the end and to cancellation; every request either made is allowed,
and the roles grant exactly an allow-list kept here, each grant used.

Run twice: with the operator's grant on jobs' ConfigMaps and Secrets cluster-wide, and held by Roles to the
namespaces of `operator.jobNamespaces` (made, as an administrator would, before the install).

Substituted, because no pod runs here: the API's address (loopback, not the Service's cluster DNS name), the
operator's health port (a free one on loopback, where the test asks the readiness probe's path as the kubelet
would), and the database (SQLite, not the bundled PostgreSQL pod).
"""

from __future__ import annotations

import base64
import re
import subprocess
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import yaml

from tests.api.conftest import TRAIN, Server, free_port, upload
from tests.chart.test_chart import CHART, HELM, VALUES
from tests.support.apiserver import FakeApiServer, service_account_kubeconfig
from tests.support.emulated import ROOT, Operator, client_for, resources, wait_for
from tunewright_api.settings import Settings

pytestmark = pytest.mark.slow
NAMESPACE = "tunewright"
KUBECTL = ROOT / ".tools" / "bin" / "kubectl"
# (apiGroup, resource, verb) each service account may use: a change to the chart's RBAC changes this on purpose
ALLOWED = {
    "operator": {
        *(("tunewright.dev", r, v) for r in ("finetunejobs", "gpupools") for v in ("get", "list", "watch", "patch")),
        ("tunewright.dev", "finetunejobs/status", "patch"), ("tunewright.dev", "gpupools/status", "patch"),
        *(("ray.io", "rayjobs", v) for v in ("get", "list", "watch", "create", "patch", "delete")),
        ("", "configmaps", "create"), ("", "configmaps", "delete"),
        ("", "secrets", "create"), ("", "secrets", "delete"),  # never read: it holds every job's token
        ("", "pods", "list"), ("", "nodes", "list"), ("", "events", "list"), ("", "events", "create"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "get"),  # ours by name: are they this release's?
    },
    "api": {
        ("", "namespaces", "get"), ("", "namespaces", "list"), ("", "namespaces", "create"),
        *(("tunewright.dev", "finetunejobs", v) for v in ("get", "list", "create", "patch", "delete")),
        ("tunewright.dev", "gpupools", "get"), ("tunewright.dev", "gpupools", "list"),
        ("tunewright.dev", "gpupools/status", "patch"), ("ray.io", "rayjobs", "get"), ("", "pods", "list"), ("", "pods/log", "get"),
    },
}


TENANT_NAMESPACES = {"tw-team-a": "team-a", "tw-team-b": "team-b"}


def granted(objects: list[dict], component: str) -> set[tuple[str, str, str]]:
    """What the component's ClusterRole and Roles (in any namespace) grant."""
    roles = [o for o in objects if o["kind"] in ("ClusterRole", "Role") and o["metadata"]["name"].endswith(f"-{component}")]
    assert [r["kind"] for r in roles].count("ClusterRole") == 1, roles
    return {(group, resource, verb) for role in roles for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def deployment(objects: list[dict], component: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(f"-{component}")]
    return found["spec"]["template"]["spec"]


def environment(container: dict, cluster) -> dict[str, str]:
    """The container's environment as the kubelet would set it (Secret references read from the cluster)."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            secret = cluster.get("Secret", NAMESPACE, ref["name"])
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return env


@pytest.mark.parametrize("values", [("several-pools",), ("several-pools", "job-namespaces")], ids="+".join)
def test_the_charts_operator_and_api_run_jobs_with_its_rbac(values, tmp_path, monkeypatch):
    rendered = tmp_path / "rendered.yaml"
    files = [arg for stem in values for arg in ("-f", str(next(v for v in VALUES if v.stem == stem)))]
    done = subprocess.run([str(HELM), "template", "tw", str(CHART), "--namespace", NAMESPACE, "--include-crds", *files],
                          capture_output=True, text=True, timeout=120, env={"HOME": str(tmp_path), "PATH": "/usr/bin"})
    assert done.returncode == 0, done.stderr
    rendered.write_text(done.stdout)
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    server = FakeApiServer(list(resources())).start()
    operator = None
    try:
        admin = client_for(server)
        admin.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        # tenants' namespaces an administrator made: team-b's always, team-a's too where Roles go into it (else
        # the API makes it on team-a's first job)
        job_namespaces = {o["metadata"]["namespace"] for o in objects if o["kind"] == "Role"}
        for namespace in {"tw-team-b"} | job_namespaces:
            admin.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": namespace, "labels": {"tunewright.dev/tenant": TENANT_NAMESPACES[namespace]}}})
        applied = subprocess.run([str(KUBECTL), "apply", "--validate=false", "-f", str(rendered)],
                                 capture_output=True, text=True, timeout=120,
                                 env={"KUBECONFIG": str(server.write_kubeconfig(tmp_path / "admin")),
                                      "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert applied.returncode == 0, applied.stderr
        for obj in objects:  # everything the chart makes exists
            resource = server._resource_by_kind(obj["apiVersion"], obj["kind"])
            key = (resource.group, resource.plural, obj["metadata"].get("namespace") if resource.namespaced else None,
                   obj["metadata"]["name"])
            assert server.call(lambda k=key: k in server.objects), key

        # the API, as its Deployment runs it
        api_pod = deployment(objects, "api")
        env = environment(api_pod["containers"][0], admin)
        assert api_pod["containers"][0]["command"][:2] == ["tunewright", "serve"] and env["TUNEWRIGHT_BACKEND"] == (
            "kubernetes")
        names = {k.removeprefix("TUNEWRIGHT_").lower() for k in env if k.startswith("TUNEWRIGHT_")}
        assert names <= set(Settings.model_fields), "the chart sets a TUNEWRIGHT_ variable the API ignores"
        for name, value in env.items():  # read as the API reads them: from its environment
            if name.startswith("TUNEWRIGHT_"):  # (TMPDIR names the pod's volume: not this machine's)
                monkeypatch.setenv(name, value)
        port = free_port()
        settings = {"admin_token": env["TUNEWRIGHT_ADMIN_TOKEN"], "database_url": None,
                    "public_url": f"http://127.0.0.1:{port}", "kubernetes_sync_seconds": 0.3}
        monkeypatch.setenv("KUBECONFIG", str(service_account_kubeconfig(
            server, tmp_path / "api-kubeconfig", NAMESPACE, api_pod["serviceAccountName"])))
        with Server(tmp_path / "api", port=port, **settings) as api:
            # the operator, as its Deployment runs it
            operator_pod = deployment(objects, "operator")
            container = operator_pod["containers"][0]
            (health,) = container["ports"]
            health_port = free_port()
            command = tuple(arg.replace(f"http://0.0.0.0:{health['containerPort']}/", f"http://127.0.0.1:{health_port}/")
                            for arg in container["command"])
            operator_env = {**environment(container, admin), "TUNEWRIGHT_API_URL": api.url}
            read = set(re.findall(r'os\.environ\.get\("(\w+)"', (ROOT / "operator" / "tunewright_operator" /
                                                                   "handlers.py").read_text()))
            assert set(operator_env) <= read, f"the chart sets {set(operator_env) - read}, which the operator ignores"
            operator = Operator(service_account_kubeconfig(server, tmp_path / "operator-kubeconfig", NAMESPACE,
                                                           operator_pod["serviceAccountName"]),
                                tmp_path / "operator.log", operator_env, command).start()
            run_jobs(api, admin, server, operator, env["TUNEWRIGHT_ADMIN_TOKEN"])
            probe = container["readinessProbe"]["httpGet"]
            assert probe["port"] in (health["name"], health["containerPort"]), probe
            ready = httpx.get(f"http://127.0.0.1:{health_port}{probe['path']}", timeout=10)
            assert ready.status_code == 200, ready.text  # what the kubelet would ask: the operator is ready
    finally:
        if operator:
            operator.stop()
        server.stop()

    refused = [a for a in server.audit if not a.allowed]
    assert refused == [], refused
    for component, account in (("operator", operator_pod["serviceAccountName"]),
                               ("api", api_pod["serviceAccountName"])):
        assert granted(objects, component) == ALLOWED[component]
        used = {(a.group, a.resource, a.verb) for a in server.audit
                if a.user == f"system:serviceaccount:{NAMESPACE}:{account}"}
        # with team-a's namespace made beforehand the API creates none: nothing else of its differs
        expected = ALLOWED[component] - ({("", "namespaces", "create")} if component == "api" and job_namespaces else set())
        assert used == expected, f"{component}: unused grants {expected - used}"


def run_jobs(api: Server, admin, server: FakeApiServer, operator: Operator, admin_token: str) -> None:
    """Every path the two service accounts take: submit, plan, run, logs, pools, kubectl jobs, cancel."""
    with api.client(admin_token) as root:
        token = root.post("/v1/tokens", json={"tenant": "team-a"}).json()["token"]
        other = root.post("/v1/tokens", json={"tenant": "team-b"}).json()["token"]
    alice, bob = api.client(token), api.client(other)
    admin.create({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    wait_for(lambda: (admin.get("GPUPool", None, "h100").get("status") or {}).get("nodes") == 1,
             what="the pool's nodes discovered", operator=operator)
    assert [p["name"] for p in alice.get("/v1/pools").json()["data"]] == ["h100", "h200", "l4"]

    spec = {"model": {"source": "hf://meta-llama/Llama-3.2-1B"}, "method": {"type": "lora"},
            "hyperparameters": {"maxSteps": 20, "globalBatchSize": 16, "seqLen": 512},
            "checkpoint": {"storage": "pvc://checkpoints/team"}, "dataset": {"train": upload(alice, TRAIN).json()["id"]}}
    dry_run = alice.post("/v1/plans", json={"spec": spec, "pool": "h200"})
    assert dry_run.status_code == 200 and dry_run.json()["plan"]["pool"] == "h200", dry_run.text
    submitted = alice.post("/v1/jobs", json=spec)
    assert submitted.status_code == 201, submitted.text
    job = submitted.json()
    rayjob = wait_for(lambda: admin.list("RayJob", "tw-team-a"), what="the RayJob", operator=operator)[0]
    name = rayjob["metadata"]["name"]
    admin.patch_status("RayJob", "tw-team-a", name, {"jobDeploymentStatus": "Initializing",
                                                     "rayClusterName": f"{name}-raycluster"})
    admin.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-head", "namespace": "tw-team-a",
        "labels": {"ray.io/cluster": f"{name}-raycluster", "ray.io/node-type": "head"}},
        "spec": {"containers": [{"name": "ray-head", "image": "example/worker:0.1.0"}]}})
    admin.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{name}-head.1", "namespace": "tw-team-a"},
                  "involvedObject": {"kind": "Pod", "name": f"{name}-head", "namespace": "tw-team-a"},
                  "type": "Warning", "reason": "FailedScheduling", "message": "0/1 nodes are available",
                  "lastTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    admin.patch_status("RayJob", "tw-team-a", name, {"message": "pods pending"})  # KubeRay writes: wakes it
    wait_for(lambda: alice.get(f"/v1/jobs/{job['id']}/events").json()["data"][0]["message"].startswith(
        "Queued (Unschedulable)"), what="Unschedulable in the API", operator=operator)
    server.pod_logs[("tw-team-a", f"{name}-head")] = "driver started\n"
    assert alice.get(f"/v1/jobs/{job['id']}/logs").json()["data"] == ["driver started"]

    started = datetime.now(UTC) - timedelta(minutes=10)
    admin.patch_status("RayJob", "tw-team-a", name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                                     "startTime": started.strftime("%Y-%m-%dT%H:%M:%SZ")})
    wait_for(lambda: alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "running", what="running",
             operator=operator)
    admin.patch_status("RayJob", "tw-team-a", name, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED",
                                                     "endTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    wait_for(lambda: alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded", what="succeeded",
             operator=operator)

    # a job made with kubectl in the namespace an administrator handed to team-b
    admin.create({"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
                  "metadata": {"name": "by-hand", "namespace": "tw-team-b"},
                  "spec": {**spec, "dataset": {"train": "pvc://datasets/train.jsonl"}}})
    wait_for(lambda: bob.get("/v1/jobs").json()["data"], what="the kubectl job in team-b's list", operator=operator)
    wait_for(lambda: admin.list("RayJob", "tw-team-b"), what="its RayJob", operator=operator)
    admin.patch("FineTuneJob", "tw-team-b", "by-hand", {"spec": {"suspend": True}})  # kubectl patch: held
    wait_for(lambda: admin.list("RayJob", "tw-team-b")[0]["spec"].get("suspend") is True, what="its RayJob suspended",
             operator=operator)

    # cancel: suspended, deleted, and the operator's finalizer cleans up
    second = alice.post("/v1/jobs", json=spec).json()
    wait_for(lambda: len(admin.list("RayJob", "tw-team-a")) == 2, what="the second RayJob", operator=operator)
    assert alice.post(f"/v1/jobs/{second['id']}/cancel").json()["status"] == "cancelled"
    wait_for(lambda: admin.get("FineTuneJob", "tw-team-a", second["id"]) is None, what="cancelled and cleaned up",
             operator=operator)
    assert len(admin.list("RayJob", "tw-team-a")) == 1 and len(admin.list("Secret", "tw-team-a")) == 1
    assert httpx.get(f"{api.url}/readyz").status_code == 200

    # a multi-GPU job's profiler window, sent with the job's own token, teaches its pool (h100 learns its links)
    learner = alice.post("/v1/jobs", json=spec | {"resources": {"pool": "h100", "strategy": "ddp"}}).json()
    wait_for(lambda: len(admin.list("RayJob", "tw-team-a")) == 2, what="the DDP job's RayJob", operator=operator)
    (name,) = {r["metadata"]["name"] for r in admin.list("RayJob", "tw-team-a")} - {rayjob["metadata"]["name"]}
    admin.patch_status("RayJob", "tw-team-a", name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                                     "startTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    wait_for(lambda: alice.get(f"/v1/jobs/{learner['id']}").json()["status"] == "running", what="the DDP job running",
             operator=operator)
    plan = alice.get(f"/v1/jobs/{learner['id']}").json()["plan"]
    assert plan["gpus"] >= 2 and plan["predicted"]["commSeconds"] > 0, plan
    secret = admin.get("Secret", "tw-team-a", f"{name}-telemetry")
    job_token = (secret.get("stringData") or {}).get("token") or base64.b64decode(secret["data"]["token"]).decode()
    comm = 2 * plan["predicted"]["commSeconds"]  # the link gave half what the pool declares
    window = {"event": "comm", "step": 10, "time": datetime.now(UTC).timestamp(), "profiled_steps": 3,
              "profiled_step_seconds": 1.0, "comm_share": 0.2, "comm_share_exposed": 0.1, "comm_seconds_per_step": comm,
              "exposed_comm_seconds_per_step": 0.1, "comm_share_max_rank": 0.2, "comm_share_exposed_max_rank": 0.1,
              "wait_seconds_per_step": 0.0, "transfer_seconds_per_step": comm}
    sent = httpx.post(f"{api.url}/v1/internal/jobs/{learner['id']}/telemetry", json={"records": [window]},
                      headers={"Authorization": f"Bearer {job_token}"})
    assert sent.status_code == 200 and sent.json()["accepted"] == 1, sent.text
    measured = (admin.get("GPUPool", None, "h100").get("status") or {}).get("measuredLinks") or {}
    assert [link["windows"] for link in measured.values()] == [1], measured
