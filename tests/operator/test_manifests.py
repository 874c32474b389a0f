"""What the operator creates for a FineTuneJob: every RayJob validates against KubeRay's own CRD with no
field pruned, core objects against Kubernetes' schemas, and the runtime config parses with the runtime's
loader; the plan and the pool decide the pods."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.schemas import errors
from tunewright_jobs.config import JobConfig
from tunewright_operator.manifests import (
    ClusterSettings,
    ManifestError,
    Target,
    Volumes,
    config_map,
    ray_job,
    ray_job_name,
    telemetry_secret,
    volume_uri,
)
from tunewright_operator.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan

KUBERAY = Path(__file__).resolve().parents[3] / "shared" / "kuberay" / "ray.io_rayjobs.yaml"
TARGET = Target(namespace="team-a", name="llama-8b-support-lora", uid="0b7e4c1a-5d2f-4e8a-9c3b-2f1d6e7a8b9c",
                job_id="ftjob-0123456789abcdef01234567")
SETTINGS = ClusterSettings(api_url="http://tunewright-api.tunewright.svc:8000")
POOL = GPUPoolSpec.model_validate({
    "gpu": "H100", "gpusPerNode": 8, "maxNodes": 4, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "intraNode": "nvlink4", "interNode": "ib-8x400g", "pricePerGPUHour": 2.5, "workerImage": "example/worker:0.1.0"})
SPEC = {"model": {"source": "pvc://models/llama-3.1-8b"}, "method": {"type": "lora"},
        "dataset": {"train": "pvc://datasets/support/train.jsonl", "validation": "pvc://datasets/support/val.jsonl"},
        "hyperparameters": {"maxSteps": 100, "globalBatchSize": 64},
        "checkpoint": {"storage": "pvc://checkpoints/llama", "everySteps": 50}}


def plan(strategy, gpus, nodes, shard_group=1, cpu_offload=False) -> JobPlan:
    per_rank = 64 // gpus
    return JobPlan(pool="h100", strategy=strategy, workers=gpus, gpus=gpus, nodes=nodes, micro_batch=1,
                   grad_accum=per_rank, shard_group=shard_group, cpu_offload=cpu_offload, explanation="test")


@pytest.fixture(scope="module")
def rayjob_schema() -> dict:
    crd = yaml.load(KUBERAY.read_text(), Loader=yaml.CSafeLoader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


PLANS = [plan("single", 1, 1), plan("ddp", 8, 1), plan("fsdp", 16, 2, shard_group=16),
         plan("hsdp", 32, 4, shard_group=8, cpu_offload=True)]


@pytest.mark.parametrize("chosen", PLANS, ids=lambda p: f"{p.strategy}-{p.gpus}")
def test_every_rayjob_validates_against_kuberay_with_nothing_pruned(chosen, rayjob_schema):
    rayjob, config = ray_job(TARGET, FineTuneJobSpec.model_validate(SPEC), chosen, POOL, SETTINGS)
    assert errors(rayjob_schema, rayjob) == []
    (workers,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == chosen.nodes  # a pod per node
    (container,) = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(chosen.gpus // chosen.nodes)
    assert container["image"] == POOL.worker_image
    assert workers["template"]["spec"]["nodeSelector"] == POOL.node_selector
    assert workers["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                           "effect": "NoSchedule"}]
    shm = next(v for v in workers["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e for e in container["env"]}
    assert env["TUNEWRIGHT_TELEMETRY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"].endswith("-telemetry")
    assert env["NCCL_IB_DISABLE"]["value"] == "0"  # the pool's nodes are joined by InfiniBand
    parsed = JobConfig.from_dict(config)  # the runtime's own loader takes what the ConfigMap holds
    assert (parsed.strategy.type, parsed.strategy.num_workers, parsed.strategy.use_gpu) == (
        chosen.strategy, chosen.gpus, True)
    assert parsed.strategy.cpu_offload == chosen.cpu_offload


def test_storage_uris_become_volumes_mounted_once_and_read_only_unless_written(rayjob_schema):
    rayjob, config = ray_job(TARGET, FineTuneJobSpec.model_validate(SPEC), PLANS[1], POOL, SETTINGS)
    worker = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]["readOnly"]
              for v in worker["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"checkpoints": False, "datasets": True, "models": True}
    assert config["checkpoint"]["storage"] == "/mnt/pvc/checkpoints/llama"
    assert config["output_dir"] == f"/mnt/pvc/checkpoints/llama/{ray_job_name(TARGET)}/output"
    assert config["dataset"] == {"train": "/mnt/pvc/datasets/support/train.jsonl",
                                 "validation": "/mnt/pvc/datasets/support/val.jsonl", "format": "chat"}
    assert config["model"]["source"] == "/mnt/pvc/models/llama-3.1-8b"
    assert config["metrics"]["endpoint"] == f"{SETTINGS.api_url}/v1/internal/jobs/{TARGET.job_id}/telemetry"
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "job-config", "mountPath": "/etc/tunewright", "readOnly": True} in head["containers"][0][
        "volumeMounts"]
    assert rayjob["spec"]["entrypoint"].endswith("--config /etc/tunewright/job.json")


def test_name_owner_and_lifecycle_follow_the_finetunejob(rayjob_schema):
    spec = FineTuneJobSpec.model_validate({**SPEC, "resources": {"queue": "research", "deadlineSeconds": 7200,
                                                                  "maxRetries": 3}})
    rayjob, _ = ray_job(TARGET, spec, PLANS[0], POOL, SETTINGS)
    again, _ = ray_job(TARGET, spec, PLANS[0], POOL, SETTINGS)
    assert rayjob == again  # deterministic: a repeated reconcile finds the same object
    meta, body = rayjob["metadata"], rayjob["spec"]
    assert meta["name"] == ray_job_name(TARGET) and len(meta["name"]) <= 47 and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [{"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
                                        "name": TARGET.name, "uid": TARGET.uid, "controller": True,
                                        }]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "research" and body["suspend"] is True  # Kueue admits
    assert body["activeDeadlineSeconds"] == 7200 and body["backoffLimit"] == 3
    assert body["shutdownAfterJobFinishes"] is True and body["ttlSecondsAfterFinished"] == 600
    other = Target(namespace="team-a", name=TARGET.name, uid="another-uid", job_id=TARGET.job_id)
    assert ray_job_name(other) != ray_job_name(TARGET)  # a re-created job never adopts the old RayJob
    assert errors(rayjob_schema, rayjob) == []


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_config_map_and_secret_are_valid_kubernetes_objects(version):
    _, config = ray_job(TARGET, FineTuneJobSpec.model_validate(SPEC), PLANS[0], POOL, SETTINGS)
    for obj in (config_map(TARGET, config), telemetry_secret(TARGET, "tw-secret")):
        kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == TARGET.uid
    assert config_map(TARGET, config)["metadata"]["name"] == f"{ray_job_name(TARGET)}-config"


@pytest.mark.parametrize(("patch", "field"), [
    ({"dataset": {"train": "file-not-an-id"}}, "dataset.train"),
    ({"checkpoint": {}}, "checkpoint.storage"),
    ({"checkpoint": {"storage": "s3://bucket/ckpt"}}, "checkpoint.storage"),
    ({"checkpoint": {"storage": "pvc://Not_A_Claim/x"}}, "checkpoint.storage"),
    ({"checkpoint": {"storage": "/data/ckpt"}}, "checkpoint.storage"),  # not shared by the pods
    ({"dataset": {"train": "/data/train.jsonl"}}, "dataset.train"),
])
def test_what_cannot_run_on_a_cluster_is_refused_naming_the_field(patch, field):
    with pytest.raises(ManifestError, match=f"^{field}:"):
        ray_job(TARGET, FineTuneJobSpec.model_validate({**SPEC, **patch}), PLANS[0], POOL, SETTINGS)


def test_uploaded_files_are_fetched_from_the_api_with_the_jobs_token():
    spec = FineTuneJobSpec.model_validate({**SPEC, "dataset": {"train": "file-0123456789abcdef01234567",
                                                               "validation": "pvc://data/val.jsonl"}})
    rayjob, config = ray_job(TARGET, spec, PLANS[0], POOL, SETTINGS)
    assert config["dataset"]["train"] == (f"{SETTINGS.api_url}/v1/internal/jobs/{TARGET.job_id}/files/"
                                          "file-0123456789abcdef01234567")
    assert config["dataset"]["validation"] == "/mnt/pvc/data/val.jsonl"
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert any(e["name"] == "TUNEWRIGHT_TELEMETRY_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in workers["env"])


def test_an_operator_default_storage_serves_jobs_that_name_none():
    settings = ClusterSettings(api_url=SETTINGS.api_url, default_checkpoint_storage="pvc://tunewright-checkpoints")
    _, config = ray_job(TARGET, FineTuneJobSpec.model_validate({**SPEC, "checkpoint": {}}), PLANS[0], POOL, settings)
    assert config["checkpoint"]["storage"] == "/mnt/pvc/tunewright-checkpoints"


def test_a_long_job_name_still_makes_valid_labels_and_names(rayjob_schema):
    long = Target(namespace="team-a", name="a" * 200, uid=TARGET.uid, job_id=TARGET.job_id)
    rayjob, config = ray_job(long, FineTuneJobSpec.model_validate(SPEC), PLANS[1], POOL, SETTINGS)
    for obj in (rayjob, config_map(long, config), telemetry_secret(long, "t")):
        assert all(len(value) <= 63 for value in obj["metadata"]["labels"].values())
        assert len(obj["metadata"]["name"]) <= 63
    kubernetes_validate.validate(config_map(long, config), "1.37.0", strict=True)
    assert errors(rayjob_schema, rayjob) == []


@pytest.mark.parametrize(("pod_path", "uri"), [
    ("/mnt/pvc/checkpoints/llama/run/output/adapter", "pvc://checkpoints/llama/run/output/adapter"),
    ("/mnt/pvc/checkpoints", "pvc://checkpoints"),
    ("/mnt/pvc", "/mnt/pvc"),
    ("/mnt/pvcx/a", "/mnt/pvcx/a"),
    ("/tmp/out", "/tmp/out"),
])
def test_pod_paths_on_a_claim_read_back_as_the_users_uri(pod_path, uri):
    assert volume_uri(pod_path) == uri
    if uri.startswith("pvc://"):
        assert Volumes().path(uri, "checkpoint.storage") == pod_path


@pytest.mark.parametrize("chosen", PLANS, ids=lambda p: f"{p.strategy}-{p.gpus}")
def test_the_jobs_pods_are_admitted_under_the_restricted_pod_security_standard(chosen):
    from tests.support.pss import restricted_violations

    rayjob, _ = ray_job(TARGET, FineTuneJobSpec.model_validate(SPEC), chosen, POOL, SETTINGS)
    cluster = rayjob["spec"]["rayClusterSpec"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        assert restricted_violations(group["template"]["spec"]) == []
