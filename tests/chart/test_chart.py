"""The Helm chart rendered and linted by the real helm binary (4.1, `make tools`), for the default values and
realistic values files: every object valid for the oldest and newest Kubernetes the chart claims, our kinds
valid for our CRDs, every pod admitted under the `restricted` Pod Security Standard, the values schema
refusing unknown and mistyped keys by name, and the images' versions in step with the runtime's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.pss import pod_specs, restricted_violations
from tests.support.schemas import errors
from tunewright_core.crds import SCHEMA_DIGEST, crds, values_pool_schema, with_pool_schema
from tunewright_operator.manifests import RAY_VERSION

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tunewright"
HELM = ROOT / ".tools" / "bin" / "helm"
VALUES = sorted((Path(__file__).parent / "values").glob("*.yaml"))
CASES = [None, *VALUES]
OLDEST, NEWEST = "1.28.0", "1.37.0"  # Chart.yaml's kubeVersion floor; the newest kubernetes-validate knows
OTHERS_CRDS = {"ServiceMonitor"}  # the Prometheus Operator's kind: no schema here


def helm(*args: str) -> subprocess.CompletedProcess:
    assert HELM.exists(), f"{HELM} is missing: run `make tools` (CI's `make test` does)"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120,
                          env={"HOME": "/tmp", "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config", "HELM_DATA_HOME": "/tmp/helm-data"})


@cache
def render(values: Path | None, kube_version: str = NEWEST) -> list[dict]:
    args = ["template", "tw", str(CHART), "--namespace", "tunewright", "--kube-version", kube_version,
            "--include-crds"]
    done = helm(*args, *(["-f", str(values)] if values else []))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def case_id(values: Path | None) -> str:
    return values.stem if values else "defaults"


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_lints_strictly(values):
    done = helm("lint", "--strict", "--kube-version", NEWEST, str(CHART), *(["-f", str(values)] if values else []))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kube_version", [OLDEST, NEWEST])
@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_every_object_is_valid_kubernetes(values, kube_version):
    objects = render(values, kube_version)
    ours = {crd["spec"]["names"]["kind"]: crd for crd in crds().values()}
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ours:
            schema = ours[obj["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            assert errors(schema, obj) == [], where
        elif obj["kind"] not in OTHERS_CRDS:
            try:
                kubernetes_validate.validate(obj, kube_version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{where}: {err.message} at {list(err.path)}")


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_every_pod_is_admitted_as_restricted_with_a_read_only_root(values):
    pods = pod_specs(render(values))
    assert len(pods) >= 2
    for where, pod in pods:
        assert restricted_violations(pod) == [], where
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], where
            assert container.get("livenessProbe") or container.get("readinessProbe"), where


def test_the_restricted_check_sees_what_admission_would_refuse():
    pod = {"hostNetwork": True, "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                           "ports": [{"containerPort": 80, "hostPort": 80}]}]}
    found = "\n".join(restricted_violations(pod))
    for expected in ("hostNetwork", "hostPath", "privileged", "allowPrivilegeEscalation", "drop: must include ALL",
                     "only NET_BIND_SERVICE", "runAsNonRoot", "seccompProfile", "hostPort"):
        assert expected in found


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_helms_sdk_renders_the_same_objects_and_lints_clean(values):
    """Helm's own Go code through helm-python-sdk, beside the binary: the same objects (secrets' random
    values aside), and a strict lint with no error."""
    import helm_python

    given = yaml.safe_load(values.read_text()) if values else {}
    chart = helm_python.Chart.load(CHART)
    try:
        rendered = chart.render(given, name="tw", namespace="tunewright", is_install=True)
    finally:
        chart.close()
    objects = [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
               for doc in yaml.safe_load_all(text) if doc]
    by_binary = [o for o in render(values) if o["kind"] != "CustomResourceDefinition"]

    def comparable(obj):
        return obj["kind"], obj["metadata"]["name"], json.dumps(obj if obj["kind"] != "Secret" else obj["metadata"],
                                                                sort_keys=True)

    assert sorted(map(comparable, objects)) == sorted(map(comparable, by_binary))
    linted = helm_python.lint(CHART, given, strict=True, kube_version=NEWEST)
    assert linted["errors"] == [] and all(m["severity"] <= 1 for m in linted["messages"]), linted


@pytest.mark.parametrize(("values", "message"), [
    ({"api": {"replica": 2}}, "at '/api': additional properties 'replica' not allowed"),
    ({"operator": {"replicas": 2}}, "at '/operator/replicas'"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ({"api": {"service": {"port": "eighty"}}}, "at '/api/service/port'"),
    ({"pools": [{"name": "h100", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4",
                 "pricePerGPUHour": 2.5, "gpusPerNodes": 8}]}, "additional properties 'gpusPerNodes' not allowed"),
    ({"pools": [{"name": "h100", "gpu": "B300", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4",
                 "pricePerGPUHour": 2.5}]}, "at '/pools/0/gpu'"),
    ({"database": {"bundled": {"enabled": False}}}, "at '/database/external/existingSecret'"),
    ({"api": {"checkpointStorage": "s3://bucket/x"}}, "at '/api/checkpointStorage'"),
    ({"image": {"tag": "0.1 .0"}}, "at '/image/tag'"),
    ({"workerImage": {"tag": "-latest"}}, "at '/workerImage/tag'"),
    ({"image": {"digest": "sha256:abc"}}, "at '/image/digest'"),
    ({"workerImage": {"repository": "ghcr.io/TuneWright/worker"}}, "at '/workerImage/repository'"),
    ({"database": {"bundled": {"image": "postgres"}}}, "at '/database/bundled/image'"),
    ({"database": {"bundled": {"image": "postgres:16 alpine"}}}, "at '/database/bundled/image'"),
    ({"operator": {"jobNamespaces": ["Team_A"]}}, "at '/operator/jobNamespaces/0'"),
    ({"operator": {"jobNamespaces": ["tw-a", "tw-a"]}}, "at '/operator/jobNamespaces'"),
    ({"metrics": {"serviceMonitor": {"labels": {"release": "x" * 64}}}}, "at '/metrics/serviceMonitor/labels/release'"),
])
def test_the_values_schema_refuses_unknown_and_mistyped_keys_by_name(values, message, tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm("template", "tw", str(CHART), "-f", str(path))
    assert done.returncode != 0 and message in done.stderr, done.stderr
    import helm_python

    chart = helm_python.Chart.load(CHART)
    try:
        with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
            chart.validate_schema(chart.merge_values(values))  # with the defaults, as an install checks them
    finally:
        chart.close()


@pytest.mark.parametrize(("pools", "message"), [
    ([{"name": "a", "default": True}, {"name": "a"}], "pools: the name a is given twice"),
    ([{"name": "a", "default": True}, {"name": "b", "default": True}], "pools: several are marked default (a, b)"),
])
def test_pools_that_cannot_work_together_fail_the_install(pools, message, tmp_path):
    spec = {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4", "pricePerGPUHour": 1.0}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"pools": [{**spec, **pool} for pool in pools]}))
    done = helm("template", "tw", str(CHART), "-f", str(path))
    assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.parametrize(("digests", "message"), [
    ({}, None),  # a fresh cluster (on `helm install`, Helm has just made them from crds/)
    ({"finetunejobs.tunewright.dev": True, "gpupools.tunewright.dev": True}, None),
    ({"finetunejobs.tunewright.dev": True, "gpupools.tunewright.dev": None},
     "the cluster's CRD gpupools.tunewright.dev is another release's (schema digest none, this chart's "),
    ({"finetunejobs.tunewright.dev": "0123456789abcdef", "gpupools.tunewright.dev": True},
     "the cluster's CRD finetunejobs.tunewright.dev is another release's (schema digest 0123456789abcdef, "),
])
def test_an_install_or_upgrade_onto_another_releases_crds_stops_naming_the_fix(digests, message, tmp_path):
    """Helm never upgrades crds/: rendered against a cluster (as `helm install` and `helm upgrade` render, with
    lookup) whose CRDs carry this chart's digests (True), another (a string) or none (None: a chart from
    before digests), the chart renders, or stops naming the CRD and the command that fixes it."""
    from tests.support.apiserver import FakeApiServer

    installed = []
    for crd in crds().values():
        if crd["metadata"]["name"] in digests:
            digest = digests[crd["metadata"]["name"]]
            annotations = {SCHEMA_DIGEST: crd["metadata"]["annotations"][SCHEMA_DIGEST] if digest is True else digest}
            installed.append(crd | {"metadata": crd["metadata"] | {"annotations": annotations if digest else {}}})
    server = FakeApiServer([], installed=installed).start()
    try:
        done = subprocess.run(
            [str(HELM), "template", "tw", str(CHART), "--namespace", "tunewright", "--dry-run=server",
             "--disable-openapi-validation", "-f", str(next(v for v in VALUES if v.stem == "gitops"))],
            capture_output=True, text=True, timeout=120,
            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "KUBECONFIG": str(server.write_kubeconfig(
                tmp_path / "kubeconfig"))})
    finally:
        server.stop()
    if message is None:
        assert done.returncode == 0 and "kind: Deployment" in done.stdout, done.stderr
        return
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert ("never upgrades them. Apply this chart's first, `helm show crds CHART --version "
            f"{yaml.safe_load((CHART / 'Chart.yaml').read_text())['version']} | kubectl apply --server-side "
            "--force-conflicts -f -`") in done.stderr


def test_the_operator_may_read_only_our_crds_by_name():
    (role,) = [o for o in render(None) if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-operator")]
    gets = [rule for rule in role["rules"] if "customresourcedefinitions" in rule["resources"] and "get" in rule["verbs"]]
    assert [sorted(rule.get("resourceNames", [])) for rule in gets] == [
        sorted(crd["metadata"]["name"] for crd in crds().values())]


def test_a_gitops_render_makes_no_secret_it_would_have_to_look_up():
    objects = render(next(v for v in VALUES if v.stem == "gitops"))
    assert [o for o in objects if o["kind"] == "Secret"] == []
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for o in objects if o["kind"] == "Deployment"
            for e in o["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e}
    assert refs == {"TUNEWRIGHT_ADMIN_TOKEN": "tunewright-admin", "TUNEWRIGHT_DATABASE_URL": "tunewright-database",
                    "TUNEWRIGHT_JOB_TOKEN_KEY": "tunewright-job-token-key", "TUNEWRIGHT_METRICS_TOKEN": "tunewright-metrics"}


def test_every_values_key_is_documented_and_typed():
    schema = json.loads((CHART / "values.schema.json").read_text())
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"# -- .*\n\s*(\w+):", text))

    def keys(node, prefix=""):
        for name, sub in (node.get("properties") or {}).items():
            yield name, sub
            if name != "pools":
                yield from keys(sub, f"{prefix}{name}.")

    for name, sub in keys(schema):
        assert "description" in sub, f"{name}: no description in values.schema.json"
    leaves = {name for name, sub in keys(schema) if sub.get("type") != "object" or name in (
        "resources", "nodeSelector", "affinity", "annotations", "labels", "workerImage")}
    assert leaves - {"pools"} <= documented | {"requests", "limits"}, leaves - documented


def test_the_pools_value_is_checked_as_the_gpupool_crd_checks_a_spec():
    """Generated with the CRDs (python -m tunewright_core.crds): fails when either drifts."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema == with_pool_schema(schema)
    assert schema["properties"]["pools"]["items"] == values_pool_schema()


def test_images_follow_the_chart_and_carry_the_tested_ray_and_python():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert chart["appVersion"] == version
    worker = (ROOT / "images" / "worker" / "Dockerfile").read_text()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert f"FROM rayproject/ray:{RAY_VERSION}-{python}-gpu" in worker
    import ray

    assert ray.__version__ == RAY_VERSION  # the Ray the tests ran with is the one the image carries
    api = (ROOT / "images" / "tunewright" / "Dockerfile").read_text()
    assert re.search(rf"^FROM python:{sys.version_info.major}\.{sys.version_info.minor}\.\d+-slim", api, re.M)
    assert "USER 1000:1000" in api and "USER 1000:100" in worker  # what the pod security contexts run as
    defaults = render(None)
    images = {c["image"] for _, pod in pod_specs(defaults) for c in pod["containers"]}
    assert f"ghcr.io/tunewright/tunewright:{chart['appVersion']}" in images


# base images not pinned by digest yet, and why: each one is a finding, not a default
DIGEST_NOT_PINNED = {"rayproject/ray:2.60.0-py311-gpu": "its digest could not be looked up offline: pin it where it is "
                                                         "first built"}


def test_base_images_are_pinned_to_a_version_and_a_digest():
    """A tag alone can be pushed again: the same Dockerfile would build on other bytes."""
    for dockerfile in sorted((ROOT / "images").glob("*/Dockerfile")):
        for ref in re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), re.M):
            image, _, digest = ref.partition("@")
            assert re.fullmatch(r"[a-z0-9./-]+:\d+\.\d+\.\d+[-\w.]*", image), f"{dockerfile}: {ref} names no exact version"
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or image in DIGEST_NOT_PINNED, f"{dockerfile}: {ref}"


def test_a_pinned_image_renders_with_its_digest():
    values = next(v for v in VALUES if v.stem == "external-database")
    digest = yaml.safe_load(values.read_text())["image"]["digest"]
    images = {c["image"] for _, pod in pod_specs(render(values)) for c in pod["containers"]}
    assert images == {f"registry.example.com/ml/tunewright:0.1.0@{digest}"}


def deployment_pod(objects: list[dict], component: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(f"-{component}")]
    return found["spec"]["template"]["spec"]


def rbac_rules(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}", rule)
            for o in objects if o["kind"] in ("ClusterRole", "Role") for rule in o["rules"]]


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_no_role_of_the_chart_reads_a_secret(values):
    """The admin token, the database's password and every job's token live in Secrets: whoever holds the
    operator's or the API's token must not read them (the operator creates and deletes a job's Secret only)."""
    for where, rule in rbac_rules(render(values)):
        if {"", "*"} & set(rule["apiGroups"]) and {"secrets", "*"} & set(rule["resources"]):
            assert not {"get", "list", "watch", "*"} & set(rule["verbs"]), where


def test_job_namespaces_hold_the_operators_grant_on_a_jobs_objects_to_them():
    job_objects = {("configmaps", "create"), ("configmaps", "delete"),
                   ("secrets", "create"), ("secrets", "delete")}

    def grants(objects, kind, namespace=None):
        return {(resource, verb) for where, rule in rbac_rules(objects) if where.startswith(f"{kind}/{namespace or ''}/")
                and where.endswith("-operator") and "" in rule["apiGroups"]
                for resource in rule["resources"] for verb in rule["verbs"]} & {
            (r, v) for r in ("configmaps", "secrets") for v in ("get", "list", "watch", "create", "delete", "*")}

    assert grants(render(None), "ClusterRole") == job_objects  # no list given: every namespace
    listed = next(v for v in VALUES if v.stem == "job-namespaces")
    objects = render(listed)
    namespaces = yaml.safe_load(listed.read_text())["operator"]["jobNamespaces"]
    assert grants(objects, "ClusterRole") == set()
    operator = deployment_pod(objects, "operator")["serviceAccountName"]
    for namespace in namespaces:
        assert grants(objects, "Role", namespace) == job_objects, namespace
        (binding,) = [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == namespace]
        assert binding["roleRef"]["kind"] == "Role" and binding["subjects"] == [
            {"kind": "ServiceAccount", "name": operator, "namespace": "tunewright"}], binding
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] in ("Role", "RoleBinding")} == set(namespaces)


def test_the_operator_is_ready_when_kopf_serves_its_health_endpoint():
    """kopf serves --liveness only once its startup handlers have run: the readiness probe asks that
    endpoint, on the port and path the operator's command gives it (the cluster test asks it for real)."""
    container = deployment_pod(render(None), "operator")["containers"][0]
    probe = container["readinessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    port = ports.get(probe["port"], probe["port"])
    assert f"--liveness=http://0.0.0.0:{port}{probe['path']}" in container["command"], (probe, container["command"])


@pytest.mark.parametrize("values", CASES, ids=case_id)
def test_a_pod_holds_a_service_account_token_only_if_it_calls_the_api_server(values):
    """Only the API and the operator call the API server (their accounts are bound to roles); any other pod
    (PostgreSQL) mounts no token a compromise of it could use."""
    objects = render(values)
    bound = {s["name"] for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding") for s in o["subjects"]
             if s["kind"] == "ServiceAccount"}
    for where, pod in pod_specs(objects):
        mounts_a_token = pod.get("automountServiceAccountToken") is not False
        assert mounts_a_token == (pod.get("serviceAccountName") in bound), (
            f"{where}: a token {'it has no use for' if mounts_a_token else 'missing, and its account is bound to a role'}")


def test_prometheus_reads_the_per_job_series_with_the_token_the_api_is_given():
    """/metrics shows each job's series (tenant and job ids) only to the metrics (or admin) token: the
    ServiceMonitor must show the API the token the API was given, or Prometheus scrapes totals only."""
    objects = render(next(v for v in VALUES if v.stem == "metrics"))
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    credentials = monitor["spec"]["endpoints"][0]["authorization"]
    env = {e["name"]: e for e in deployment_pod(objects, "api")["containers"][0]["env"]}
    assert credentials == {"type": "Bearer", "credentials": env["TUNEWRIGHT_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]}
    assert any(o["kind"] == "Secret" and o["metadata"]["name"] == credentials["credentials"]["name"] for o in objects)
