"""The calls the operator and the API's kubernetes backend make to the Kubernetes API: `Cluster`, the few
they need (the reconciler is written against it; tests use an in-memory one), and `KubernetesCluster`.

Credentials: in-cluster (the operator's ServiceAccount), else the kubeconfig named by KUBECONFIG (or
~/.kube/config), read when the operator starts, never at import. A 409 on create is `AlreadyExists`;
404 and 410 on reads are "gone" (None), so a vanished object never crash-loops a handler.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from typing import Protocol

# kind → (group, version, plural, namespaced); core kinds have group ""
KINDS = {
    "FineTuneJob": ("tunewright.dev", "v1alpha1", "finetunejobs", True),
    "GPUPool": ("tunewright.dev", "v1alpha1", "gpupools", False),
    "RayJob": ("ray.io", "v1", "rayjobs", True),
    "ConfigMap": ("", "v1", "configmaps", True),
    "Secret": ("", "v1", "secrets", True),
    "Pod": ("", "v1", "pods", True),
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims", True),
    "Event": ("", "v1", "events", True),
    "Node": ("", "v1", "nodes", False),
    "Namespace": ("", "v1", "namespaces", False),
    "CustomResourceDefinition": ("apiextensions.k8s.io", "v1", "customresourcedefinitions", False),
}
GONE = (404, 410)


class Cluster(Protocol):
    def get(self, kind: str, namespace: str | None, name: str) -> dict | None: ...

    def list(self, kind: str, namespace: str | None = None, label_selector: str | None = None) -> list[dict]: ...

    def create(self, obj: dict) -> dict:
        """Raises `AlreadyExists` when an object of that name exists."""

    def patch(self, kind: str, namespace: str | None, name: str, patch: dict) -> None: ...

    def patch_status(self, kind: str, namespace: str | None, name: str, status: dict) -> None: ...

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Whether it was there: gone already is fine."""

    def event(self, regarding: dict, type_: str, reason: str, message: str) -> None: ...


class AlreadyExists(Exception):
    pass


def load_credentials() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


class KubernetesError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status


class KubernetesCluster:
    """Requests by path through the client's ApiClient (its credentials, TLS and token refresh)."""

    def __init__(self, api_client=None, component: str = "tunewright-operator"):
        from kubernetes import client

        self.api, self.component = api_client or client.ApiClient(), component

    def _path(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        group, version, plural, namespaced = KINDS[kind]
        parts = ["/api/v1" if not group else f"/apis/{group}/{version}"]
        if namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(plural)
        parts += [p for p in (name, sub) if p]
        return "/".join(parts)

    def _call(self, method: str, path: str, body=None, query=None, content_type="application/json", raw=False):
        request = self.api.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()), body=body,
            header_params={"Content-Type": content_type, "Accept": "*/*" if raw else "application/json"},
            auth_settings=["BearerToken"])
        response = self.api.call_api(*request)
        data = response.read() or b""
        if response.status == 409 and method == "POST":
            raise AlreadyExists(path)
        if response.status in GONE and method in ("GET", "DELETE", "PATCH"):
            return None
        if response.status >= 400:
            raise KubernetesError(response.status, method, path, data.decode(errors="replace"))
        if raw:
            return data.decode(errors="replace")
        return json.loads(data) if data else None

    def get(self, kind, namespace, name):
        return self._call("GET", self._path(kind, namespace, name))

    def list(self, kind, namespace=None, label_selector=None):
        query = {"labelSelector": label_selector} if label_selector else None
        found = self._call("GET", self._path(kind, namespace), query=query)
        return (found or {}).get("items", [])

    def create(self, obj):
        return self._call("POST", self._path(obj["kind"], obj["metadata"].get("namespace")), body=obj)

    def patch(self, kind, namespace, name, patch):
        self._call("PATCH", self._path(kind, namespace, name), body=patch, content_type="application/merge-patch+json")

    def patch_status(self, kind, namespace, name, status):
        self._call("PATCH", self._path(kind, namespace, name, "status"), body={"status": status},
                   content_type="application/merge-patch+json")

    def delete(self, kind, namespace, name):
        # a RayJob goes after its Ray cluster (when it is gone, so are the GPUs); a FineTuneJob's own objects
        # are deleted by the operator's finalizer, not left to garbage collection
        policy = "Foreground" if kind == "RayJob" else "Background"
        return self._call("DELETE", self._path(kind, namespace, name), body={"propagationPolicy": policy}) is not None

    def log(self, namespace: str, pod: str, container: str, tail_lines: int) -> str | None:
        """The last lines a pod's container printed (None when the pod is gone or its container has not
        started: the API server answers 400 then)."""
        try:
            return self._call("GET", self._path("Pod", namespace, pod, "log"), raw=True,
                              query={"container": container, "tailLines": str(tail_lines)})
        except KubernetesError as err:
            if err.status == 400:
                return None
            raise

    def event(self, regarding, type_, reason, message):
        meta = regarding["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._call("POST", self._path("Event", meta.get("namespace") or "default"), body={
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace") or "default"},
            "involvedObject": {"apiVersion": regarding.get("apiVersion", "tunewright.dev/v1alpha1"),
                               "kind": regarding.get("kind", "FineTuneJob"), "name": meta["name"],
                               "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024], "firstTimestamp": now, "lastTimestamp": now,
            "count": 1, "source": {"component": self.component}, "reportingComponent": self.component})
