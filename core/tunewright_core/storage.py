"""Where a job's files are on a cluster, and whether a spec can run there at all (pure).

The spec names storage as URIs (`pvc://claim/path`, an uploaded `file-...`); the pods see each claim
mounted under `/mnt/pvc/<claim>`. `check_runnable` refuses what the operator could not run, naming the
field, so the API refuses it at submit and the operator refuses a kubectl job the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from tunewright_core.names import short_hash
from tunewright_core.spec import FineTuneJobSpec, JobPlan

PVC_ROOT = "/mnt/pvc"
PVC_URI = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/(?P<path>.*))?$")
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")


class NotRunnable(ValueError):
    """The spec cannot be run on a cluster as written; the message names the field and says why."""


@dataclass
class Volumes:
    """PersistentVolumeClaims named by the spec's URIs: each mounted once, read-only unless written."""

    writable: set[str] = field(default_factory=set)
    claims: list[str] = field(default_factory=list)

    def path(self, uri: str, field_name: str, writable: bool = False) -> str:
        """Where the pods see `uri` (pvc:// becomes a mount; other forms are read in place)."""
        match = PVC_URI.match(uri)
        if uri.startswith("pvc://") and match is None:
            raise NotRunnable(f"{field_name}: {uri!r} is not pvc://<claim>[/path] with a valid claim name")
        if match is None:
            return uri
        claim = match["claim"]
        if claim not in self.claims:
            self.claims.append(claim)
        if writable:
            self.writable.add(claim)
        return str(PurePosixPath(PVC_ROOT, claim, match["path"] or ""))

    def pod_volumes(self) -> list[dict]:
        return [{"name": volume_name(c), "persistentVolumeClaim": {"claimName": c, "readOnly": c not in self.writable}}
                for c in self.claims]

    def mounts(self) -> list[dict]:
        return [{"name": volume_name(c), "mountPath": f"{PVC_ROOT}/{c}", "readOnly": c not in self.writable}
                for c in self.claims]


def volume_uri(pod_path: str) -> str:
    """Where a pod's path under a mounted claim is, as a user names it (pvc://claim/path): the inverse of
    `Volumes.path`. Other paths are returned as they are."""
    parts = PurePosixPath(pod_path).parts
    root = PurePosixPath(PVC_ROOT).parts
    if parts[:len(root)] != root or len(parts) == len(root):
        return pod_path
    return "pvc://" + "/".join(parts[len(root):])


def volume_name(claim: str) -> str:
    return f"pvc-{short_hash(claim)}"


@dataclass(frozen=True)
class ClusterStorage:
    """What the pods read and write, as they see it: the claims to mount, the checkpoint folder, each
    dataset (a pod path, or the id of a file uploaded to the API, which the workers fetch) and the model."""

    volumes: Volumes
    checkpoints: str
    datasets: dict[str, str]
    model: str
    reference: str | None = None  # method.dpo.reference as the pods see it (objective dpo; None: model.source)


def cluster_storage(spec: FineTuneJobSpec, default_storage: str | None = None) -> ClusterStorage:
    """Checkpoints and outputs on the checkpoint storage (a volume every pod mounts, so the driver and every
    rank see the same files); data uploaded or on a volume. Raises `NotRunnable` naming the field."""
    storage = spec.checkpoint.storage or default_storage
    if storage is None:
        raise NotRunnable("checkpoint.storage: needed on a cluster (pvc://claim/path or an object-store URI): "
                          "each retry is a new Ray cluster and resumes from there")
    if not storage.startswith("pvc://"):
        raise NotRunnable(f"checkpoint.storage: {storage!r}: on a cluster, checkpoints, the exported model and "
                          "the result go to a volume every pod mounts: use pvc://claim/path (ReadWriteMany when "
                          "the head and workers may land on different nodes)")
    volumes = Volumes()
    checkpoints = volumes.path(storage, "checkpoint.storage", writable=True)
    datasets = {}
    for field_name, value in (("dataset.train", spec.dataset.train), ("dataset.validation", spec.dataset.validation)):
        if value and FILE_ID.match(value):
            datasets[field_name] = value
        elif value and value.startswith("pvc://"):
            datasets[field_name] = volumes.path(value, field_name)
        elif value:
            raise NotRunnable(f"{field_name}: {value!r}: on a cluster, data is an uploaded file (file-...) or "
                              "on a volume (pvc://claim/path)")
    model = volumes.path(spec.model.source, "model.source")
    dpo = spec.method.dpo if spec.method.objective == "dpo" else None
    reference = volumes.path(dpo.reference, "method.dpo.reference") if dpo and dpo.reference else None
    return ClusterStorage(volumes, checkpoints, datasets, model, reference)


def check_runnable(spec: FineTuneJobSpec, plan: JobPlan, default_storage: str | None = None) -> ClusterStorage:
    """What the operator would refuse, refused before anything is made: a plan that does not spread its GPUs
    evenly over whole nodes, storage and data the pods cannot mount."""
    if plan.device != "gpu" or plan.gpus % plan.nodes:
        raise NotRunnable(f"resources: a cluster plan spreads GPUs evenly over nodes, got {plan.gpus} GPU(s) "
                          f"({plan.device}) over {plan.nodes} node(s): plan it on a GPUPool")
    return cluster_storage(spec, default_storage)
