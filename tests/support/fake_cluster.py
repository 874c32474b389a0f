"""An in-memory API server for the reconciler's unit tests: objects by kind, namespace and name, server-set
metadata, merge patches, a separate status, events; and a kill switch that fails the n-th write."""

from __future__ import annotations

import copy
import itertools
import uuid

from tunewright_core.k8s import AlreadyExists


class Crash(Exception):
    """The operator died here."""


class Forbidden(Exception):
    """The operator's grant does not cover this read (the chart grants a job's Secret and ConfigMap create
    and delete only)."""


UNREADABLE = frozenset({"Secret", "ConfigMap"})


def merge(into: dict, patch: dict) -> dict:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


class FakeCluster:
    def __init__(self, crash_after_writes: int | None = None):
        self.objects: dict[tuple[str, str | None, str], dict] = {}
        self.events: list[dict] = []
        self.writes = 0
        self.crash_after = crash_after_writes
        self._versions = itertools.count(1)

    def _write(self) -> None:
        if self.crash_after is not None and self.writes >= self.crash_after:
            raise Crash(f"killed before write {self.writes + 1}")
        self.writes += 1

    def add(self, obj: dict) -> dict:
        """An object made by someone else (a user's kubectl apply, KubeRay): a copy, so a later patch never
        reaches the caller's dict (a test's module-level spec, say)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[(obj["kind"], meta.get("namespace"), meta["name"])] = obj
        return obj

    def _read(self, kind) -> None:
        if kind in UNREADABLE:
            raise Forbidden(f"the operator may not read {kind}s")

    def get(self, kind, namespace, name):
        self._read(kind)
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found else None

    def list(self, kind, namespace=None, label_selector=None):
        self._read(kind)
        wanted = dict(pair.split("=", 1) for pair in label_selector.split(",")) if label_selector else {}
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and (namespace is None or ns == namespace)
                and wanted.items() <= o["metadata"].get("labels", {}).items()]

    def create(self, obj):
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in self.objects:
            raise AlreadyExists(key)
        self._write()
        return copy.deepcopy(self.add(obj))

    def patch(self, kind, namespace, name, patch):
        self._write()
        obj = self.objects[(kind, namespace, name)]
        spec_before = copy.deepcopy(obj.get("spec"))
        merge(obj, {k: v for k, v in patch.items() if k != "status"})
        if obj.get("spec") != spec_before:
            obj["metadata"]["generation"] += 1

    def patch_status(self, kind, namespace, name, status):
        self._write()
        self.objects[(kind, namespace, name)]["status"] = copy.deepcopy(status)

    def delete(self, kind, namespace, name):
        self._write()
        return self.objects.pop((kind, namespace, name), None) is not None

    def event(self, regarding, type_, reason, message):
        self._write()
        self.events.append({"regarding": regarding["metadata"]["name"], "type": type_, "reason": reason,
                            "message": message})

    def count(self, kind: str) -> int:
        return sum(1 for k, _, _ in self.objects if k == kind)

    def stored(self, kind: str) -> list[dict]:
        """What the tests look at, unreadable kinds included."""
        return [o for (k, _, _), o in self.objects.items() if k == kind]
