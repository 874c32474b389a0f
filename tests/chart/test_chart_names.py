"""Every name the chart renders fits its kind, for any release name Helm accepts (DNS-1123 labels joined by
dots, at most 53 characters), and every reference between its objects still names one of them.

Rendered with every optional object on (Ingress, ServiceMonitor, NetworkPolicies, pools, per-namespace Roles),
for release names at Helm's limit in the shapes that change how the chart builds names: plain, containing the
chart's name, dotted, starting with a digit.
"""

from __future__ import annotations

import base64
import re
from functools import cache
from urllib.parse import urlsplit

import pytest
import yaml

from tests.chart.test_chart import CHART, VALUES, helm

NAMESPACE = "tunewright"
RELEASES = {
    "short": "tw",
    "longest": "a" * 53,
    "longest-containing-the-chart-name": "tunewright-" + "b" * 42,
    "longest-ending-in-the-chart-name": "c" * 43 + "tunewright",
    "longest-dotted": "d" * 26 + "." + "e" * 26,
    "longest-starting-with-a-digit": "1" + "f" * 52,
    "digits-and-dots": "2024.12",
}
EVERYTHING_ON = ("ingress", "metrics", "several-pools", "job-namespaces")

DNS_1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
DNS_1123_SUBDOMAIN = rf"{DNS_1123_LABEL}(\.{DNS_1123_LABEL})*"
PATH_SEGMENT = r"(?!\.{1,2}$)[^/%]+"  # RBAC objects: anything a URL path segment can carry
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# kind: (pattern, longest name) as the API server and the controllers that derive names from it need them
RULES = {
    # a DNS-1035 label: the Service's DNS name
    "Service": (DNS_1035_LABEL, 63),
    # pods are named <name>-<ordinal> and labelled controller-revision-hash=<name>-<hash of up to 10>: ≤ 63
    "StatefulSet": (DNS_1123_LABEL, 52),
    # a DNS subdomain for the API server, but its pods' host names come from it: a DNS label (Kubernetes' advice)
    "Deployment": (DNS_1123_LABEL, 63),
    **{kind: (DNS_1123_SUBDOMAIN, 253) for kind in (
        "ServiceAccount", "Secret", "ConfigMap", "PersistentVolumeClaim", "Ingress", "NetworkPolicy",
        "ServiceMonitor", "GPUPool", "CustomResourceDefinition")},
    **{kind: (PATH_SEGMENT, 253) for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")},
}


@cache
def render(release: str) -> tuple[dict, ...]:
    files = [arg for stem in EVERYTHING_ON for arg in ("-f", str(next(v for v in VALUES if v.stem == stem)))]
    done = helm("template", release, str(CHART), "--namespace", NAMESPACE, "--include-crds", *files)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def label_sets(node, where: str = ""):
    """(where, labels) for every label map and label selector in an object."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}.{key}"
            if key in ("labels", "matchLabels", "nodeSelector") and isinstance(value, dict):
                yield here, value
            elif key == "selector" and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                yield here, value  # a Service's selector is a plain label map
            else:
                yield from label_sets(value, here)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from label_sets(item, f"{where}[{i}]")


def label_problems(key: str, value: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    problems = []
    if prefix and not (len(prefix) <= 253 and re.fullmatch(DNS_1123_SUBDOMAIN, prefix)):
        problems.append(f"key prefix {prefix!r} is not a DNS subdomain of at most 253")
    if not (len(name) <= 63 and LABEL_NAME.fullmatch(name)):
        problems.append(f"key name {name!r} is not a label name of at most 63")
    if not (len(value) <= 63 and LABEL_VALUE.fullmatch(value)):
        problems.append(f"value {value!r} ({len(value)} characters) is not a label value of at most 63")
    return problems


@pytest.mark.parametrize("release", RELEASES.values(), ids=RELEASES.keys())
def test_every_name_and_label_fits_its_kind(release):
    problems = []
    for obj in render(release):
        kind, name = obj["kind"], obj["metadata"]["name"]
        assert kind in RULES, f"{kind}: add the rule its names follow to RULES"
        pattern, longest = RULES[kind]
        if not (len(name) <= longest and re.fullmatch(pattern, name)):
            problems.append(f"{kind}/{name}: {len(name)} characters, at most {longest} matching {pattern}")
        # a CRD's schema has properties named like label maps: only its own labels are labels
        for where, labels in label_sets(obj["metadata"] if kind == "CustomResourceDefinition" else obj):
            problems += [f"{kind}/{name}{where}[{key}]: {p}" for key, value in labels.items()
                         for p in label_problems(key, str(value))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("release", RELEASES.values(), ids=RELEASES.keys())
def test_every_reference_names_an_object_the_chart_renders(release):
    """Names cut or hashed the same way wherever they are used: the pods' service accounts, Secrets and claims,
    the StatefulSet's Service, the bindings' roles and accounts, the Ingress's Service and the URLs the API,
    the operator and the database URL carry."""
    objects = render(release)
    made = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects}
    secrets = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "Secret"}
    missing = []

    def need(kind: str, name: str, namespace: str | None = NAMESPACE, why: str = "") -> None:
        if (kind, namespace, name) not in made:
            missing.append(f"{why}: no {kind} {namespace}/{name}")

    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet"):
            pod = obj["spec"]["template"]["spec"]
            if "serviceAccountName" in pod:
                need("ServiceAccount", pod["serviceAccountName"], why=where)
            for volume in pod.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    need("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], why=where)
            for container in pod["containers"]:
                for env in container.get("env", []):
                    if "secretKeyRef" in env.get("valueFrom", {}):
                        ref = env["valueFrom"]["secretKeyRef"]
                        need("Secret", ref["name"], why=f"{where} {env['name']}")
                        assert ref["key"] in secrets.get(ref["name"], {ref["key"]: ""}), f"{where} {env['name']}"
                    if env["name"] in ("TUNEWRIGHT_API_URL", "TUNEWRIGHT_PUBLIC_URL"):
                        host = urlsplit(env["value"]).hostname
                        assert host.endswith(f".{NAMESPACE}.svc"), f"{where} {env['name']}: {host}"
                        need("Service", host.removesuffix(f".{NAMESPACE}.svc"), why=f"{where} {env['name']}")
        if obj["kind"] == "StatefulSet":
            need("Service", obj["spec"]["serviceName"], why=where)
        if obj["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            ref = obj["roleRef"]
            need(ref["kind"], ref["name"], obj["metadata"].get("namespace") if ref["kind"] == "Role" else None, where)
            for subject in obj["subjects"]:
                need("ServiceAccount", subject["name"], subject["namespace"], where)
        if obj["kind"] == "Ingress":
            for rule in obj["spec"]["rules"]:
                for path in rule["http"]["paths"]:
                    need("Service", path["backend"]["service"]["name"], why=where)
    for name, data in secrets.items():
        if "url" in data:  # the bundled database's URL: its host is the PostgreSQL Service
            need("Service", urlsplit(base64.b64decode(data["url"]).decode()).hostname, why=f"Secret/{name} url")
    assert missing == [], "\n".join(missing)
