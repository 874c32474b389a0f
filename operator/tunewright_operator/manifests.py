"""What the operator creates for a FineTuneJob, as pure functions: the RayJob (KubeRay `ray.io/v1`), the
ConfigMap holding the runtime's job config and the Secret holding the per-job telemetry token.

Everything is owned by the FineTuneJob (deleting it deletes them) and named from it deterministically, so
a reconcile that runs twice, or after an operator restart, finds what it created instead of making more.
Users never write pod templates: the plan sizes the worker group (one pod per node), the pool gives the
image, node selector and tolerations, and the spec's storage URIs become volumes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from tunewright_core.jobconfig import runtime_config
from tunewright_core.names import API_VERSION, JOB_LABEL, QUEUE_LABEL, SPEC_HASH_ANNOTATION, short_hash
from tunewright_core.plan_of_record import spec_hash
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan
from tunewright_core.storage import FILE_ID, ClusterStorage, check_runnable

RAY_VERSION = "2.60.0"  # the Ray the runtime is tested with; the worker image must carry it
CONFIG_DIR = "/etc/tunewright"
SUBMITTER_CPU, SUBMITTER_MEMORY = "500m", "1Gi"  # KubeRay's own submitter's figures: `ray job submit`, tailing logs
HEAD_CPU, HEAD_MEMORY_GIB = 2, 8  # the head runs the Ray driver and the job submitter only
WORKER_CPU_PER_GPU, WORKER_MEMORY_GIB_PER_GPU = 4, 32  # data loading and host-side work per training process
SHM_SHARE = 0.25  # of a worker's memory, for /dev/shm (NCCL's buffers, Ray's object store)
# KubeRay's rules for a RayJob's name (ValidateRayJobMetadata): a DNS-1035 label, at most 47 characters, as
# KubeRay appends "-" and 5 characters to name its RayCluster and caps RayCluster names at 53
MAX_RAY_JOB_NAME = 47
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Target:
    """The FineTuneJob being realized, and the tunewright API's id for it (the `tunewright.dev/job-id`
    annotation: the API's job its workers report telemetry to)."""

    namespace: str
    name: str
    uid: str
    job_id: str


def internal_url(settings: ClusterSettings, target: Target, what: str) -> str:
    """An API route the job's workers (and the operator) call with the job's own token."""
    return f"{settings.api_url.rstrip('/')}/v1/internal/jobs/{target.job_id}/{what}"


@dataclass(frozen=True)
class ClusterSettings:
    """The operator's own settings (from its command line / the chart's values)."""

    api_url: str  # how workers reach the tunewright API (telemetry)
    ttl_seconds_after_finished: int = 600
    default_checkpoint_storage: str | None = None  # e.g. pvc://tunewright-checkpoints
    # each job's telemetry token is derived from this key, so the operator never reads a Secret back; only
    # the operator holds one (the API builds manifests to check them, never to create a job's token)
    job_token_key: bytes | None = None


def ray_job_name(target: Target) -> str:
    """Stable for one FineTuneJob (its uid), unique across re-creations under the same name, and valid for
    KubeRay: a FineTuneJob may be named `llama-3.1-8b` or `8b-lora` (DNS-1123: dots, a leading digit),
    its RayJob `llama-3-1-8b-<hash>` or `ftj-8b-lora-<hash>` (DNS-1035, at most 47 characters). Names that
    were valid before map as they always did, so an upgraded operator finds the RayJobs it made."""
    base = re.sub(r"[^a-z0-9-]", "-", target.name[:36]).rstrip("-")
    if not base[:1].isalpha():
        base = f"ftj-{base}".rstrip("-")
    return f"{base}-{short_hash(target.uid)}"


def job_token(settings: ClusterSettings, target: Target) -> str:
    """The bearer token a job's workers (and the operator, for its summary) show the API: derived from the
    operator's key and the job's uid, so the operator can make it again without reading the job's Secret."""
    if not settings.job_token_key:
        raise ValueError("the operator has no job token key (TUNEWRIGHT_JOB_TOKEN_KEY): it cannot make a job's token")
    digest = hmac.new(settings.job_token_key, f"telemetry/{target.uid}".encode(), hashlib.sha256).digest()
    return "tw-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def owner_reference(target: Target) -> dict:
    return {"apiVersion": API_VERSION, "kind": "FineTuneJob", "name": target.name, "uid": target.uid,
            # no blockOwnerDeletion: the operator's finalizer deletes what it made, and setting it would need
            # `update` on finetunejobs/finalizers where OwnerReferencesPermissionEnforcement admission runs
            "controller": True}


def labels(target: Target) -> dict[str, str]:
    # label values are at most 63 characters, names up to 253: the (short, unique) RayJob name marks them
    return {"app.kubernetes.io/name": "tunewright", "app.kubernetes.io/component": "training",
            "app.kubernetes.io/managed-by": "tunewright-operator", JOB_LABEL: ray_job_name(target)}


def metadata(target: Target, name: str, extra_labels: dict[str, str] | None = None) -> dict:
    return {"name": name, "namespace": target.namespace, "labels": {**labels(target), **(extra_labels or {})},
            "ownerReferences": [owner_reference(target)]}


def cluster_runtime_config(target: Target, spec: FineTuneJobSpec, plan: JobPlan, settings: ClusterSettings,
                           storage: ClusterStorage) -> dict:
    """The runtime's job config with the pods' paths; an uploaded dataset is fetched from the API with the
    job's token."""
    name = ray_job_name(target)
    datasets = {field_name: internal_url(settings, target, f"files/{value}") if FILE_ID.match(value) else value
                for field_name, value in storage.datasets.items()}
    config = runtime_config(spec, plan, name=name, output_dir=f"{storage.checkpoints}/{name}/output",
                            train=datasets["dataset.train"], validation=datasets.get("dataset.validation"),
                            checkpoint_storage=storage.checkpoints, reference=storage.reference,
                            telemetry_endpoint=internal_url(settings, target, "telemetry"))
    config["model"]["source"] = storage.model
    return config


def config_map(target: Target, config: dict) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(target, f"{ray_job_name(target)}-config"),
            "data": {"job.json": json.dumps(config, indent=2, sort_keys=True)}}


def telemetry_secret(target: Target, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(target, f"{ray_job_name(target)}-telemetry"), "stringData": {"token": token}}


def nccl_environment(pool: GPUPoolSpec) -> list[dict]:
    env = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if pool.inter_node is not None:
        env["NCCL_IB_DISABLE"] = "0" if pool.inter_node.startswith("ib-") else "1"
    return [{"name": k, "value": v} for k, v in env.items()]


def _container(name: str, image: str, resources: dict, env: list[dict], mounts: list[dict],
               env_from: list[dict]) -> dict:
    container = {"name": name, "image": image, "resources": resources, "env": env, "volumeMounts": mounts,
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    if env_from:
        container["envFrom"] = env_from
    return container


def ray_job(target: Target, spec: FineTuneJobSpec, plan: JobPlan, pool: GPUPoolSpec,
            settings: ClusterSettings) -> tuple[dict, dict]:
    """The RayJob and the runtime config it runs (the caller stores that in `config_map`)."""
    storage = check_runnable(spec, plan, settings.default_checkpoint_storage)
    volumes = storage.volumes
    config = cluster_runtime_config(target, spec, plan, settings, storage)
    name = ray_job_name(target)
    gpus_per_pod = plan.gpus // plan.nodes
    token = {"name": "TUNEWRIGHT_TELEMETRY_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": f"{name}-telemetry", "key": "token"}}}
    env_from = ([{"secretRef": {"name": spec.checkpoint.credentials_secret}}]
                if spec.checkpoint.credentials_secret else [])
    host_gib = WORKER_MEMORY_GIB_PER_GPU * gpus_per_pod + (
        plan.predicted.host_memory_gib_per_node if plan.predicted and plan.cpu_offload else 0)
    memory = f"{int(host_gib)}Gi"
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{int(host_gib * SHM_SHARE)}Gi"}}
    worker_mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, *volumes.mounts()]
    config_volume = {"name": "job-config", "configMap": {"name": f"{name}-config"}}
    head_mounts = [{"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True}, *volumes.mounts()]
    scheduling = {"nodeSelector": dict(pool.node_selector),
                  "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations]}
    # Ray's images run as uid 1000, gid 100; fsGroup makes the checkpoint volume writable for it
    # no pod of a job calls the API server: none mounts a service account token
    pod_security = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                    "seccompProfile": {"type": "RuntimeDefault"}}
    head = {
        "rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": labels(target)}, "spec": {
            "securityContext": pod_security, "automountServiceAccountToken": False,
            "containers": [_container(
                "ray-head", pool.worker_image,
                {"requests": {"cpu": str(HEAD_CPU), "memory": f"{HEAD_MEMORY_GIB}Gi"},
                 "limits": {"memory": f"{HEAD_MEMORY_GIB}Gi"}},
                [token], head_mounts, env_from)],
            "volumes": [config_volume, *volumes.pod_volumes()],
        }},
    }
    workers = {
        "groupName": "gpu-workers", "replicas": plan.nodes, "minReplicas": plan.nodes, "maxReplicas": plan.nodes,
        "rayStartParams": {},
        "template": {"metadata": {"labels": labels(target)}, "spec": {
            **scheduling, "securityContext": pod_security, "automountServiceAccountToken": False,
            "containers": [_container(
                "ray-worker", pool.worker_image,
                {"requests": {"cpu": str(WORKER_CPU_PER_GPU * gpus_per_pod), "memory": memory,
                              "nvidia.com/gpu": str(gpus_per_pod)},
                 "limits": {"memory": memory, "nvidia.com/gpu": str(gpus_per_pod)}},
                [token, *nccl_environment(pool)], worker_mounts, env_from)],
            "volumes": [shm, *volumes.pod_volumes()],
        }},
    }
    # KubeRay's default submitter pod sets no securityContext, and a namespace enforcing the `restricted`
    # Pod Security Standard refuses it while the head and workers sit holding GPUs: ours passes. KubeRay
    # fills in the `ray job submit` command of a submitter container that names none.
    submitter = {"metadata": {"labels": labels(target)}, "spec": {
        "restartPolicy": "Never", "securityContext": pod_security, "automountServiceAccountToken": False,
        "containers": [_container(
            "ray-job-submitter", pool.worker_image,
            {"requests": {"cpu": SUBMITTER_CPU, "memory": SUBMITTER_MEMORY},
             "limits": {"cpu": "1", "memory": SUBMITTER_MEMORY}}, [], [], [])],
    }}
    queue = {QUEUE_LABEL: spec.resources.queue} if spec.resources.queue else {}
    body = {
        "entrypoint": f"python -m tunewright_jobs.run --config {CONFIG_DIR}/job.json",
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": submitter,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
        "backoffLimit": spec.resources.max_retries,
        # Kueue admits a queued job by unsuspending it; a suspended FineTuneJob holds its RayJob
        "suspend": spec.suspend or bool(queue),
        "rayClusterSpec": {"rayVersion": RAY_VERSION, "headGroupSpec": head, "workerGroupSpecs": [workers]},
    }
    if spec.resources.deadline_seconds:
        body["activeDeadlineSeconds"] = spec.resources.deadline_seconds
    meta = metadata(target, name, queue)
    meta["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(spec)}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta, "spec": body}, config

