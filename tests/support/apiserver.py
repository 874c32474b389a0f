"""A small Kubernetes API server for tests: enough of the real one's behaviour for kopf and kubectl.

No kube-apiserver can be had on these machines (no container engine, no kind or envtest binaries, no network beyond package registries), and plain kmock 0.8
lacks what an operator depends on, so this is our own, written against the API conventions:
- server-set metadata: uid, an integer resourceVersion bumped on every write (a no-op write bumps
  nothing and wakes no watcher), creationTimestamp, generation (bumped when anything but metadata and
  status changes), generateName;
- custom resources: their CRD's schema applied like the API server does, prune → default → validate
  (422 naming each field; `fieldValidation=Strict` refuses unknown fields instead of pruning), and a
  status subresource (writes to the object leave status alone, writes to /status change only status);
- optimistic concurrency: a PUT or a patch carrying a stale resourceVersion, or a JSON patch whose
  `test` fails, is 409 Conflict;
- deletion: finalizers hold an object with a deletionTimestamp until they are removed; ownerReference
  garbage collection of dependents (at once, where a real cluster does it soon after), Foreground
  propagation (`foregroundDeletion` until the dependents are gone), namespaces taking their objects along
  (and refusing new ones while terminating);
- Secrets' write-only `stringData` folded into base64 `data`; pods' `log` (text the test sets, 400 while
  the container has not started);
- lists with kind, label selectors (=, !=, in, notin, exists) and field selectors on any dotted field;
- watches as JSON lines from a resourceVersion, with timeoutSeconds, and watch-lists (sendInitialEvents,
  ended by the initial-events-end bookmark, as kubectl 1.35's `delete --wait` uses);
- discovery (/api, /apis, /version) and Tables from `additionalPrinterColumns` (kubectl get);
- RBAC for service accounts (tokens the test registers): their requests are held to the ClusterRoles,
  Roles and bindings stored here (a chart's, applied with kubectl), refused with 403 as the API server
  says it, and kept in an audit; the built-in kinds a chart installs are stored and served.
Not emulated, and so only a real cluster verifies: CEL rules, server-side apply, strategic merge of
built-in kinds' lists (taken as a merge patch; refused with 415 on custom resources, as a real server
does), RBAC, admission, OpenAPI documents (kubectl needs `--validate=false`), Pod Security, periodic
watch bookmarks, 410 Gone for an expired resourceVersion (all history is kept), KubeRay's own finalizers,
and protobuf requests (kubectl 1.35 sends built-in kinds it creates, e.g. `kubectl create namespace`, as
protobuf: answered 415, so tests create those through JSON).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import gzip
import json
import logging
import re
import secrets
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from aiohttp import web

from tests.support.schemas import to_draft7

KUBERNETES_VERSION = "1.30.0"
CORE_VALIDATED = {"ConfigMap", "Secret", "Event"}  # core kinds the operator writes: checked like the server


@dataclass
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    schema: dict | None = None  # openAPIV3Schema of a custom resource
    status_subresource: bool = False
    printer_columns: list[dict] = field(default_factory=list)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


CORE = [Resource("", "v1", "namespaces", "Namespace", False, ["ns"]),
        Resource("", "v1", "nodes", "Node", False, ["no"]),
        Resource("", "v1", "configmaps", "ConfigMap", True, ["cm"]),
        Resource("", "v1", "secrets", "Secret", True),
        Resource("", "v1", "pods", "Pod", True, ["po"], ["all"], status_subresource=True),
        Resource("", "v1", "events", "Event", True, ["ev"])]
# what a chart installs besides: stored and served (checked offline with kubernetes-validate, not here)
INSTALLABLE = [Resource("", "v1", "serviceaccounts", "ServiceAccount", True, ["sa"]),
               Resource("", "v1", "services", "Service", True, ["svc"]),
               Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ["pvc"]),
               Resource("apps", "v1", "deployments", "Deployment", True, ["deploy"]),
               Resource("apps", "v1", "statefulsets", "StatefulSet", True, ["sts"]),
               Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
               Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
               Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
               Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
               Resource("networking.k8s.io", "v1", "ingresses", "Ingress", True, ["ing"]),
               Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ["netpol"]),
               Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
                        ["crd"])]


def resources_of_crd(crd: dict, versions: set[str] | None = None) -> list[Resource]:
    spec, found = crd["spec"], []
    for version in spec["versions"]:
        if not version.get("served") or (versions and version["name"] not in versions):
            continue
        found.append(Resource(
            spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
            spec["scope"] == "Namespaced", spec["names"].get("shortNames", []), spec["names"].get("categories", []),
            version["schema"]["openAPIV3Schema"], "status" in version.get("subresources", {}),
            version.get("additionalPrinterColumns", [])))
    return found


# KubeRay's RayJob CRD, vendored (tests/support/kuberay: its SOURCE and LICENSE), compressed: 1.4 MB of YAML
KUBERAY_RAYJOB_CRD = Path(__file__).resolve().parent / "kuberay" / "ray.io_rayjobs.yaml.gz"


def crd_document(path: Path) -> dict:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return yaml.load(text, Loader=yaml.CSafeLoader)


def load_crd(path: Path, versions: set[str] | None = None) -> list[Resource]:
    return resources_of_crd(crd_document(path), versions)


@dataclass(frozen=True)
class Access:
    """One request of a service account, as RBAC sees it."""

    user: str
    verb: str
    group: str
    resource: str  # "pods", or "pods/log" for a subresource
    namespace: str | None
    name: str | None
    allowed: bool


def rule_allows(rule: dict, access: Access) -> bool:
    def has(values, wanted):
        return "*" in (values or []) or wanted in (values or [])

    named = not rule.get("resourceNames") or (access.name in rule["resourceNames"] and access.verb not in (
        "create", "list", "watch", "deletecollection"))
    return (has(rule.get("apiGroups"), access.group) and has(rule.get("resources"), access.resource)
            and has(rule.get("verbs"), access.verb) and named)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, causes: list[dict] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.causes = code, reason, message, causes or []

    def body(self, resource: Resource | None, name: str | None) -> dict:
        details = {"name": name, "group": resource.group, "kind": resource.plural} if resource else {}
        if self.causes:
            details["causes"] = self.causes
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": details, "code": self.code}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- schema: prune, default, validate -------------------------------------------------------------

def prune(value, schema: dict, path: str, pruned: list[str]):
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return value
    if isinstance(value, dict) and schema.get("type") == "object":
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in list(value):
            if properties is not None and key in properties:
                value[key] = prune(value[key], properties[key], f"{path}.{key}", pruned)
            elif isinstance(extra, dict):
                value[key] = prune(value[key], extra, f"{path}.{key}", pruned)
            elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields") and not extra:
                pruned.append(f"{path}.{key}".lstrip("."))
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"], f"{path}[{i}]", pruned) for i, item in enumerate(value)]
    return value


def apply_defaults(value, schema: dict):
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])


class SchemaCheck:
    """One CRD version's schema, applied the way the API server applies it to every write."""

    ROOT_KEYS = {"apiVersion", "kind", "metadata"}

    def __init__(self, schema: dict):
        self.schema = schema
        self.pruned: list[str] = []  # what the last write lost
        self.validator = jsonschema.Draft7Validator(to_draft7(self._without_root_metadata(schema)))

    @staticmethod
    def _without_root_metadata(schema: dict) -> dict:
        out = dict(schema, properties={k: v for k, v in schema.get("properties", {}).items() if k != "metadata"})
        out["properties"]["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return out

    def apply(self, obj: dict, strict: bool, label: str) -> dict:
        body = {k: v for k, v in obj.items() if k not in self.ROOT_KEYS}
        pruned: list[str] = []
        body = prune(body, dict(self.schema, properties={k: v for k, v in self.schema.get("properties", {}).items()
                                                          if k not in self.ROOT_KEYS}), "", pruned)
        self.pruned = pruned
        if pruned and strict:
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(
                f'unknown field "{p}"' for p in pruned))
        apply_defaults(body, self.schema)
        out = {k: obj[k] for k in self.ROOT_KEYS if k in obj} | body
        causes = [{"reason": "FieldValueInvalid", "field": ".".join(map(str, e.absolute_path)) or "<root>",
                   "message": f"Invalid value: {json.dumps(e.instance)[:200]}: {e.message}"}
                  for e in self.validator.iter_errors(out)]
        if causes:
            raise ApiError(422, "Invalid", f"{label} is invalid: " + ", ".join(
                f"{c['field']}: {c['message']}" for c in causes), causes)
        return out


# ---- selectors ------------------------------------------------------------------------------------

LABEL_TERM = re.compile(r"\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


def label_matcher(selector: str | None):
    if not selector:
        return lambda labels: True
    checks = []
    for term in split_selector(selector):
        match = LABEL_TERM.match(term)
        if not match:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
        negate, key, op, value, set_op, values = match.groups()
        options = {v.strip() for v in (values or "").split(",") if v.strip()}
        if op in ("=", "=="):
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif op == "!=":
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif set_op == "in":
            checks.append(lambda labels, k=key, o=options: labels.get(k) in o)
        elif set_op == "notin":
            checks.append(lambda labels, k=key, o=options: labels.get(k) not in o)
        else:
            checks.append(lambda labels, k=key, n=bool(negate): (k in labels) != n)
    return lambda labels: all(check(labels) for check in checks)


def dotted(obj: dict, path: str):
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def field_matcher(selector: str | None):
    if not selector:
        return lambda obj: True
    checks = []
    for term in split_selector(selector):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        key, value = key.strip(), value.lstrip("=").strip()
        checks.append(lambda obj, k=key, v=value, n=negate: (str(dotted(obj, k) or "") == v) != n)
    return lambda obj: all(check(obj) for check in checks)


# ---- patches --------------------------------------------------------------------------------------

def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: dict, operations: list[dict]) -> dict:
    doc = copy.deepcopy(target)

    def parent_of(parts):
        node = doc
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node, parts[-1]

    def read(parts):
        node = doc
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    for op in operations:
        parts = json_pointer(op["path"])
        try:
            if op["op"] == "test":
                if read(parts) != op["value"]:
                    raise ApiError(409, "Conflict", f"the server rejected our request due to an error in our request: "
                                                    f"test failed at {op['path']}")
                continue
            if op["op"] in ("move", "copy"):
                value = copy.deepcopy(read(json_pointer(op["from"])))
                if op["op"] == "move":
                    node, key = parent_of(json_pointer(op["from"]))
                    node.pop(int(key)) if isinstance(node, list) else node.pop(key)
                op = {"op": "add", "path": op["path"], "value": value}
            node, key = parent_of(parts)
            if op["op"] == "add":
                if isinstance(node, list):
                    node.insert(len(node) if key == "-" else int(key), op["value"])
                else:
                    node[key] = op["value"]
            elif op["op"] == "remove":
                node.pop(int(key)) if isinstance(node, list) else node.pop(key)
            elif op["op"] == "replace":
                read(parts)  # must exist
                if isinstance(node, list):
                    node[int(key)] = op["value"]
                else:
                    node[key] = op["value"]
            else:
                raise ApiError(422, "Invalid", f"unknown JSON patch op {op['op']!r}")
        except (KeyError, IndexError, ValueError, TypeError) as err:
            raise ApiError(422, "Invalid", f"the JSON patch cannot be applied at {op['path']}: {err!r}") from None
    return doc


# ---- the server ---------------------------------------------------------------------------------

SERVER_FIELDS = ("uid", "resourceVersion", "creationTimestamp", "generation", "deletionTimestamp",
                 "deletionGracePeriodSeconds")


class FakeApiServer:
    """Served over real HTTP on loopback from its own thread; `url` and `write_kubeconfig()` for clients.

    `on_write`, when set, is called (in the server's thread) after each write a client other than the test
    makes, with the count so far: a test uses it to kill an operator at an exact point."""

    TEST_AGENT = "tunewright-tests"

    def __init__(self, resources: list[Resource], installed: list[dict] = ()):
        """`resources`: the kinds served besides the core ones; `installed`: cluster-scoped objects already
        there when the test begins (the CRDs an administrator installed, say)."""
        self.resources = {(r.group, r.version, r.plural): r for r in [*CORE, *INSTALLABLE, *resources]}
        # bearer token → "system:serviceaccount:<namespace>:<name>", held to the RBAC objects stored here;
        # any other token is the cluster's admin (the tests' own)
        self.service_account_tokens: dict[str, str] = {}
        self.audit: list[Access] = []  # every request a service account made, and whether RBAC allowed it
        self.checks = {key: SchemaCheck(r.schema) for key, r in self.resources.items() if r.schema}
        self.objects: dict[tuple, dict] = {}  # (group, plural, namespace, name) → object
        self.history: list[tuple[int, tuple, str, dict]] = []  # (rv, (group, plural), type, object)
        self.revision = 1
        self.writes = 0
        self.on_write = None
        self.closing = False
        self.pruned: list[tuple[str, str]] = []  # (kind/name, field) the schema dropped from a write
        self.pod_logs: dict[tuple[str, str], str] = {}  # (namespace, pod) → what its container printed
        self.loop: asyncio.AbstractEventLoop | None = None
        self.changed: asyncio.Condition | None = None
        self.url = ""
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        for name in ("default", "kube-system"):
            self._store(self.resources[("", "v1", "namespaces")], {"apiVersion": "v1", "kind": "Namespace",
                                                                    "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now_rfc3339()}}, "ADDED")
        for obj in installed:
            group, _, version = obj["apiVersion"].rpartition("/")
            resource = next(r for r in self.resources.values()
                            if (r.group, r.version, r.kind) == (group, version, obj["kind"]))
            stored = copy.deepcopy(obj)
            stored["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
            self._store(resource, stored, "ADDED")

    # -- lifecycle
    def start(self) -> FakeApiServer:
        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.changed = asyncio.Condition()
            app = web.Application(client_max_size=4 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._runner.cleanup())
            self.loop.close()

        self._thread = threading.Thread(target=serve, name="fake-apiserver", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self.loop and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._close_watches(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    async def _close_watches(self):
        self.closing = True
        await self._notify()
        await asyncio.sleep(0.1)

    def write_kubeconfig(self, path: Path, namespace: str = "default", token: str = "emulator-token") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": namespace}}]}))
        return path

    # -- reading state from tests (thread-safe: runs in the server's loop)
    def call(self, fn, *args):
        future = asyncio.run_coroutine_threadsafe(self._in_loop(fn, *args), self.loop)
        return future.result(10)

    async def _in_loop(self, fn, *args):
        return fn(*args)

    def objects_of(self, plural: str, namespace: str | None = None) -> list[dict]:
        def collect():
            return [copy.deepcopy(o) for (g, p, ns, _), o in self.objects.items()
                    if p == plural and (namespace is None or ns == namespace)]
        return self.call(collect)

    # -- storage
    def _key(self, resource: Resource, namespace: str | None, name: str) -> tuple:
        return (resource.group, resource.plural, namespace if resource.namespaced else None, name)

    def _store(self, resource: Resource, obj: dict, event: str) -> dict:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        key = self._key(resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if event == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((self.revision, (resource.group, resource.plural), event, copy.deepcopy(obj)))
        return obj

    async def _notify(self):
        async with self.changed:
            self.changed.notify_all()

    def _resource_by_kind(self, api_version: str, kind: str) -> Resource | None:
        return next((r for r in self.resources.values() if r.api_version == api_version and r.kind == kind), None)

    def _admit(self, resource: Resource, obj: dict, strict: bool) -> dict:
        meta = obj["metadata"]
        label = f'{resource.kind}.{resource.group or "core"} "{meta.get("name")}"'
        if resource.kind == "Secret" and "stringData" in obj:  # write-only: the server folds it into data
            encoded = {k: base64.b64encode(str(v).encode()).decode() for k, v in obj.pop("stringData").items()}
            obj["data"] = {**(obj.get("data") or {}), **encoded}
        check = self.checks.get((resource.group, resource.version, resource.plural))
        if check:
            obj = check.apply(obj, strict, label)
            self.pruned += [(f"{resource.kind}/{meta.get('name')}", path) for path in check.pruned]
        elif resource.kind in CORE_VALIDATED:
            try:
                kubernetes_validate.validate({k: v for k, v in obj.items() if k != "status"}, KUBERNETES_VERSION,
                                             strict=True)
            except kubernetes_validate.ValidationError as err:
                raise ApiError(422, "Invalid", f"{label} is invalid: {err.message}") from None
        return obj

    def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone (again until nothing changes)."""
        while True:
            uids = {o["metadata"]["uid"] for o in self.objects.values()}
            orphaned = [(k, o) for k, o in self.objects.items() if o["metadata"].get("ownerReferences")
                        and not any(ref.get("uid") in uids for ref in o["metadata"]["ownerReferences"])
                        and not o["metadata"].get("deletionTimestamp")]
            if not orphaned:
                return
            for (group, plural, _, _), obj in orphaned:
                resource = next(r for r in self.resources.values() if (r.group, r.plural) == (group, plural))
                self._delete(resource, copy.deepcopy(obj))

    def _resource_of(self, key: tuple) -> Resource:
        return next(r for r in self.resources.values() if (r.group, r.plural) == key[:2])

    def _dependents(self, uid: str) -> list[tuple[tuple, dict]]:
        return [(k, o) for k, o in self.objects.items()
                if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])]

    def _delete(self, resource: Resource, obj: dict, propagation: str = "Background") -> dict:
        """Finalizers hold the object (deletionTimestamp set) until removed; Foreground adds the
        `foregroundDeletion` finalizer until its dependents are gone; a namespace takes its objects along."""
        meta = obj["metadata"]
        contents = [(k, o) for k, o in self.objects.items() if k[2] == meta["name"]] if resource.plural == (
            "namespaces") else []
        if propagation == "Foreground" and self._dependents(meta["uid"]) and "foregroundDeletion" not in (
                meta.get("finalizers") or []):
            meta["finalizers"] = [*(meta.get("finalizers") or []), "foregroundDeletion"]
        if meta.get("finalizers") or contents:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                meta["generation"] = meta.get("generation", 1) + 1
                self._store(resource, obj, "MODIFIED")
            for key, dependent in [*self._dependents(meta["uid"]), *contents] if (
                    "foregroundDeletion" in (meta.get("finalizers") or []) or contents) else []:
                if not dependent["metadata"].get("deletionTimestamp"):
                    self._delete(self._resource_of(key), copy.deepcopy(dependent))
            self._settle_deletions()
            return obj
        self._store(resource, obj, "DELETED")
        self._collect_garbage()
        self._settle_deletions()
        return obj

    def _settle_deletions(self) -> None:
        """Finish what waited on others: a foreground deletion whose dependents are gone, a namespace
        whose objects are gone."""
        for key, obj in list(self.objects.items()):
            meta = obj["metadata"]
            if not meta.get("deletionTimestamp") or key not in self.objects:
                continue
            finalizers = meta.get("finalizers") or []
            if "foregroundDeletion" in finalizers and not self._dependents(meta["uid"]):
                obj = copy.deepcopy(obj)
                obj["metadata"]["finalizers"] = [f for f in finalizers if f != "foregroundDeletion"]
                if obj["metadata"]["finalizers"]:
                    self._store(self._resource_of(key), obj, "MODIFIED")
                else:
                    self._delete(self._resource_of(key), obj)
            elif key[:2] == ("", "namespaces") and not finalizers and not any(
                    k[2] == meta["name"] for k in self.objects):
                self._delete(self._resource_of(key), copy.deepcopy(obj))

    # -- HTTP
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        resource, name = None, None
        try:
            path = request.path.rstrip("/")
            if path == "/version":
                major, minor, _ = KUBERNETES_VERSION.split(".")
                return web.json_response({"major": major, "minor": minor, "gitVersion": f"v{KUBERNETES_VERSION}",
                                          "platform": "linux/amd64"})
            if path == "/api":
                return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": request.host}]})
            if path == "/apis":
                return web.json_response(self._group_list())
            if path.startswith("/openapi"):
                raise ApiError(404, "NotFound", "the server has no OpenAPI documents (an emulator): "
                                                "use kubectl's --validate=false")
            parts = path.strip("/").split("/")
            if parts[0] == "api" and len(parts) >= 2:
                group, version, rest = "", parts[1], parts[2:]
            elif parts[0] == "apis" and len(parts) >= 3:
                group, version, rest = parts[1], parts[2], parts[3:]
            elif parts[0] == "apis" and len(parts) == 2:
                return web.json_response(self._group(parts[1]))
            else:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            if not rest:
                return web.json_response(self._resource_list(group, version))
            namespace = None
            if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in self.resources:
                namespace, rest = rest[1], rest[2:]
            resource = self.resources.get((group, version, rest[0]))
            if resource is None:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            name = rest[1] if len(rest) > 1 else None
            sub = rest[2] if len(rest) > 2 else None
            self._authorize(request, resource, namespace, name, sub)
            if sub == "log" and resource.plural == "pods" and request.method == "GET":
                return self._pod_log(namespace, name, request.query)
            if sub not in (None, "status") or (sub == "status" and not resource.status_subresource):
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            return await self._serve(request, resource, namespace, name, sub)
        except ApiError as err:
            return web.json_response(err.body(resource, name), status=err.code)
        except Exception as err:  # a bug here, said as the API server would say it
            logging.getLogger(__name__).exception("emulator error on %s %s", request.method, request.path)
            return web.json_response(ApiError(500, "InternalError", repr(err)).body(resource, name), status=500)

    async def _serve(self, request, resource: Resource, namespace, name, sub) -> web.StreamResponse:
        method, query = request.method, request.query
        if method == "GET" and name is None:
            if query.get("watch") in ("true", "1"):
                return await self._watch(request, resource, namespace)
            return self._respond(request, resource, self._list(resource, namespace, query), listing=True)
        if method == "GET":
            return self._respond(request, resource, copy.deepcopy(self._get(resource, namespace, name)))
        body = await request.read()
        if method in ("POST", "PUT", "PATCH"):
            if request.headers.get("Content-Type", "").startswith("application/vnd.kubernetes.protobuf"):
                raise ApiError(415, "UnsupportedMediaType", "protobuf is not emulated")
            try:
                payload = json.loads(body or b"null")
            except json.JSONDecodeError as err:
                raise ApiError(400, "BadRequest", f"the body is not JSON: {err}") from None
        strict = query.get("fieldValidation") == "Strict"
        dry_run = "dryRun" in query
        if method == "POST" and name is None:
            result = self._create(resource, namespace, payload, strict, dry_run)
            code = 201
        elif method == "PUT" and name:
            result, code = self._replace(resource, namespace, name, payload, sub, strict, dry_run), 200
        elif method == "PATCH" and name:
            result, code = self._patch(resource, namespace, name, payload, sub, strict, dry_run,
                                       request.headers.get("Content-Type", "")), 200
        elif method == "DELETE" and name:
            options = json.loads(body) if body.strip().startswith(b"{") else {}
            propagation = query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            result, code = self._delete(resource, copy.deepcopy(self._get(resource, namespace, name)), propagation), 200
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        if not dry_run:
            await self._notify()
            if request.headers.get("User-Agent") != self.TEST_AGENT:
                self.writes += 1
                if self.on_write:
                    self.on_write(self.writes)
        return web.json_response(copy.deepcopy(result), status=code)

    # -- RBAC
    def _authorize(self, request, resource: Resource, namespace, name, sub) -> None:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        user = self.service_account_tokens.get(token)
        if user is None:
            return
        verb = {"GET": "watch" if request.query.get("watch") in ("true", "1") else "get" if name else "list",
                "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(request.method, request.method.lower())
        access = Access(user, verb, resource.group, resource.plural + (f"/{sub}" if sub else ""), namespace, name,
                        False)
        access = dataclasses.replace(access, allowed=any(rule_allows(rule, access) for rule in self._rules_of(
            user, namespace)))
        self.audit.append(access)
        if not access.allowed:
            where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
            raise ApiError(403, "Forbidden", f'{access.resource}.{resource.group or "core"} "{name or ""}" is '
                                             f'forbidden: User "{user}" cannot {verb} resource "{access.resource}" '
                                             f'in API group "{resource.group}"{where}')

    def _rules_of(self, user: str, namespace: str | None) -> list[dict]:
        """The rules bound to `user`: ClusterRoles anywhere, Roles (or ClusterRoles) bound in `namespace`."""
        _, _, sa_namespace, sa_name = user.split(":")
        rules = []
        for (group, plural, ns, _), binding in list(self.objects.items()):
            if group != "rbac.authorization.k8s.io" or plural not in ("clusterrolebindings", "rolebindings"):
                continue
            if plural == "rolebindings" and ns != namespace:
                continue
            if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa_name and s.get("namespace", ns)
                       == sa_namespace for s in binding.get("subjects") or []):
                continue
            ref = binding["roleRef"]
            role = self.objects.get(("rbac.authorization.k8s.io", "clusterroles" if ref["kind"] == "ClusterRole"
                                     else "roles", None if ref["kind"] == "ClusterRole" else ns, ref["name"]))
            rules += (role or {}).get("rules") or []
        return rules

    def _pod_log(self, namespace, name, query) -> web.Response:
        """What the kubelet would serve: the container's output (set by the test in `pod_logs`), 400 while
        the container has not started."""
        self._get(self.resources[("", "v1", "pods")], namespace, name)
        text = self.pod_logs.get((namespace, name))
        if text is None:
            raise ApiError(400, "BadRequest", f'container "{query.get("container", "")}" in pod "{name}" is '
                                              "waiting to start: ContainerCreating")
        lines = text.splitlines(keepends=True)
        tail = int(query.get("tailLines") or len(lines))
        return web.Response(text="".join(lines[-tail:] if tail else []), content_type="text/plain")

    def _get(self, resource: Resource, namespace, name) -> dict:
        found = self.objects.get(self._key(resource, namespace, name))
        if found is None:
            raise ApiError(404, "NotFound", f'{resource.qualified} "{name}" not found')
        return found

    def _matching(self, resource: Resource, namespace, query) -> list[dict]:
        labels, fields = label_matcher(query.get("labelSelector")), field_matcher(query.get("fieldSelector"))
        return [o for (g, p, ns, _), o in sorted(self.objects.items(), key=lambda kv: (kv[0][2] or "", kv[0][3]))
                if (g, p) == (resource.group, resource.plural) and (namespace is None or ns == namespace)
                and labels(o["metadata"].get("labels") or {}) and fields(o)]

    def _list(self, resource: Resource, namespace, query) -> dict:
        return {"apiVersion": resource.api_version, "kind": f"{resource.kind}List",
                "metadata": {"resourceVersion": str(self.revision)},
                "items": copy.deepcopy(self._matching(resource, namespace, query))}

    def _check_namespace(self, resource: Resource, namespace):
        if not resource.namespaced:
            return
        found = self.objects.get(("", "namespaces", None, namespace))
        if found is None:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
        if found["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f"unable to create new content in namespace {namespace} because it is "
                                             "being terminated")

    def _create(self, resource: Resource, namespace, obj, strict, dry_run) -> dict:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", "the body is not an object")
        if obj.get("kind") != resource.kind or obj.get("apiVersion") != resource.api_version:
            raise ApiError(400, "BadRequest", f"the body is a {obj.get('apiVersion')} {obj.get('kind')}, "
                                              f"not a {resource.api_version} {resource.kind}")
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        namespace = namespace if resource.namespaced else None
        if resource.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the request's")
            meta["namespace"] = namespace
            self._check_namespace(resource, namespace)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required",
                               [{"reason": "FieldValueRequired", "field": "metadata.name", "message": "Required"}])
            meta["name"] = meta["generateName"] + "".join(secrets.choice("bcdfghjklmnpqrstvwxz2456789")
                                                          for _ in range(5))
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", meta["name"]):
            raise ApiError(422, "Invalid", f'metadata.name: Invalid value: "{meta["name"]}": a lowercase RFC 1123 '
                                           "subdomain", [{"reason": "FieldValueInvalid", "field": "metadata.name"}])
        if self._key(resource, namespace, meta["name"]) in self.objects:
            raise ApiError(409, "AlreadyExists", f'{resource.qualified} "{meta["name"]}" already exists')
        for key in SERVER_FIELDS:
            meta.pop(key, None)
        if resource.status_subresource:
            obj.pop("status", None)
        obj = self._admit(resource, obj, strict)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
        if dry_run:
            return obj
        return self._store(resource, obj, "ADDED")

    def _write(self, resource: Resource, current: dict, updated: dict, sub, strict, dry_run) -> dict:
        """An update of `current` to `updated`, keeping what the request may not change."""
        if sub == "status":
            updated = dict(current, status=updated.get("status"))
            if updated["status"] is None:
                updated.pop("status")
        elif resource.status_subresource:
            updated = {k: v for k, v in updated.items() if k != "status"}
            if "status" in current:
                updated["status"] = current["status"]
        meta = updated.setdefault("metadata", {})
        for key in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp",
                    "deletionGracePeriodSeconds", "resourceVersion"):
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
            else:
                meta.pop(key, None)
        if current["metadata"].get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(current["metadata"].get("finalizers") or [])
            if added:
                raise ApiError(422, "Invalid", "metadata.finalizers: Forbidden: no new finalizers can be added "
                                               "if the object is being deleted")
        updated = self._admit(resource, updated, strict)
        spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if spec_of(updated) != spec_of(current):
            updated["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if updated == current or dry_run:
            return updated
        if updated["metadata"].get("deletionTimestamp") and not updated["metadata"].get("finalizers"):
            return self._delete(resource, updated)
        return self._store(resource, updated, "MODIFIED")

    def _replace(self, resource: Resource, namespace, name, obj, sub, strict, dry_run) -> dict:
        current = self._get(resource, namespace, name)
        wanted = (obj.get("metadata") or {}).get("resourceVersion")
        if not wanted:
            raise ApiError(422, "Invalid", "metadata.resourceVersion: Invalid value: 0x0: must be specified for "
                                           "an update")
        if wanted != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource.qualified} "{name}": the '
                                            "object has been modified; please apply your changes to the latest "
                                            "version and try again")
        return self._write(resource, current, copy.deepcopy(obj), sub, strict, dry_run)

    def _patch(self, resource: Resource, namespace, name, patch, sub, strict, dry_run, content_type) -> dict:
        current = self._get(resource, namespace, name)
        if content_type.startswith("application/json-patch+json"):
            if not isinstance(patch, list):
                raise ApiError(400, "BadRequest", "a JSON patch is a list of operations")
            updated = json_patch(current, patch)
        elif content_type.startswith("application/strategic-merge-patch+json") and resource.schema:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted "
                                                        "media types include: application/json-patch+json, "
                                                        "application/merge-patch+json, application/apply-patch+yaml")
        elif content_type.startswith(("application/merge-patch+json", "application/strategic-merge-patch+json")):
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "a merge patch is an object")
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource.qualified} "{name}": '
                                                "the object has been modified")
            updated = merge_patch(current, patch)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"the patch type {content_type!r} is not emulated "
                                                        "(server-side apply is not)")
        return self._write(resource, current, updated, sub, strict, dry_run)

    async def _watch(self, request, resource: Resource, namespace) -> web.StreamResponse:
        query = request.query
        since = int(query.get("resourceVersion") or 0)
        labels, fields = label_matcher(query.get("labelSelector")), field_matcher(query.get("fieldSelector"))
        timeout = float(query.get("timeoutSeconds") or 3600)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        def wanted(obj):
            return (namespace is None or obj["metadata"].get("namespace") == namespace) and labels(
                obj["metadata"].get("labels") or {}) and fields(obj)

        async def send(kind, obj):
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        initial = query.get("sendInitialEvents") == "true"  # a watch-list (client-go's WatchListClient)
        if since == 0 or initial:  # the current state first, as ADDED
            for obj in self._matching(resource, namespace, query):
                await send("ADDED", copy.deepcopy(obj))
            since = self.revision
        if initial:  # "the initial state is complete", as a real server says it
            await send("BOOKMARK", {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": {
                "resourceVersion": str(since), "annotations": {"k8s.io/initial-events-end": "true"}}})
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                for rv, which, kind, obj in [h for h in self.history if h[0] > since]:
                    since = rv
                    if which == (resource.group, resource.plural) and wanted(obj):
                        await send(kind, obj)
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait_for(
                            lambda seen=since: self.revision > seen or self.closing), left)
                    except TimeoutError:
                        break
                if self.closing:
                    break
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client went away
        return response

    def _respond(self, request, resource: Resource, data: dict, listing: bool = False) -> web.Response:
        if "as=Table" in request.headers.get("Accept", ""):
            return web.json_response(self._table(resource, data["items"] if listing else [data], data))
        return web.json_response(data)

    def _table(self, resource: Resource, items: list[dict], data: dict) -> dict:
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        declared = resource.printer_columns or [{"name": "Age", "type": "date",
                                                 "jsonPath": ".metadata.creationTimestamp"}]
        columns += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                     "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in declared]

        def cell(obj, column):
            value = dotted(obj, column["jsonPath"].lstrip("."))
            if column["type"] == "date" and value:
                seconds = (datetime.now(UTC) - datetime.fromisoformat(value.replace("Z", "+00:00"))).total_seconds()
                return f"{int(seconds)}s" if seconds < 120 else f"{int(seconds // 60)}m"
            return value

        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
                "metadata": {"resourceVersion": data.get("metadata", {}).get("resourceVersion", "")},
                "columnDefinitions": columns,
                "rows": [{"cells": [o["metadata"]["name"], *(cell(o, c) for c in declared)],
                          "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                     "metadata": o["metadata"]}} for o in items]}

    # -- discovery
    def _versions(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for group, version, _ in self.resources:
            if group and version not in found.setdefault(group, []):
                found[group].append(version)
        return found

    def _group(self, group: str) -> dict:
        versions = self._versions().get(group)
        if not versions:
            raise ApiError(404, "NotFound", f"no API group {group}")
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": listed,
                "preferredVersion": listed[0]}

    def _group_list(self) -> dict:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self._group(group) for group in self._versions()]}

    def _resource_list(self, group: str, version: str) -> dict:
        listed = []
        for resource in self.resources.values():
            if (resource.group, resource.version) != (group, version):
                continue
            listed.append({"name": resource.plural, "singularName": resource.kind.lower(),
                           "namespaced": resource.namespaced, "kind": resource.kind,
                           "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                           "shortNames": resource.short_names, "categories": resource.categories})
            if resource.status_subresource:
                listed.append({"name": f"{resource.plural}/status", "singularName": "", "namespaced":
                               resource.namespaced, "kind": resource.kind, "verbs": ["get", "patch", "update"]})
        if not listed:
            raise ApiError(404, "NotFound", f"no API {group}/{version}")
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": listed}


def service_account_kubeconfig(server: FakeApiServer, path: Path, namespace: str, name: str) -> Path:
    """A kubeconfig authenticating as a service account (what its pod's mounted token would do)."""
    token = f"sa-{secrets.token_hex(16)}"
    server.service_account_tokens[token] = f"system:serviceaccount:{namespace}:{name}"
    return server.write_kubeconfig(path, namespace, token)
