"""What the operator creates for a FineTuneJob: every RayJob validates against KubeRay's own CRD with no
field pruned, core objects against Kubernetes' schemas, and the runtime config parses with the runtime's
loader; the plan and the pool decide the pods."""

import hashlib
import re

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.apiserver import KUBERAY_RAYJOB_CRD, crd_document
from tests.support.pss import kuberay_pods, restricted_violations
from tests.support.schemas import errors
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan
from tunewright_core.storage import NotRunnable, Volumes, volume_uri
from tunewright_jobs.config import JobConfig
from tunewright_operator.manifests import (
    DNS_1035_LABEL,
    ClusterSettings,
    Target,
    config_map,
    ray_job,
    ray_job_name,
    telemetry_secret,
)

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
    crd = crd_document(KUBERAY_RAYJOB_CRD)
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
    with pytest.raises(NotRunnable, match=f"^{field}:"):
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
def test_every_pod_of_a_job_is_admitted_under_the_restricted_pod_security_standard(chosen):
    """KubeRay's submitter included: its default pod sets no securityContext and is refused."""
    rayjob, _ = ray_job(TARGET, FineTuneJobSpec.model_validate(SPEC), chosen, POOL, SETTINGS)
    pods = dict(kuberay_pods(rayjob))
    assert set(pods) == {"head", "worker/gpu-workers", "submitter"}
    for role, pod in pods.items():
        assert restricted_violations(pod) == [], role
        assert pod["automountServiceAccountToken"] is False, role  # none of them calls the API server
    submitter = pods["submitter"]["containers"][0]
    assert submitter["name"] == "ray-job-submitter" and "command" not in submitter  # KubeRay writes the command
    assert submitter["image"] == POOL.worker_image and rayjob["spec"]["submissionMode"] == "K8sJobMode"


# A FineTuneJob's name is any DNS-1123 subdomain (dots, a leading digit, up to 253 characters)
SUBDOMAIN_LABEL = r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?"
FINETUNEJOB_NAMES = st.from_regex(rf"{SUBDOMAIN_LABEL}(\.{SUBDOMAIN_LABEL}){{0,12}}", fullmatch=True).filter(
    lambda name: len(name) <= 253)
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def kuberay_refusals(rayjob: dict, config: dict, target: Target) -> list[str]:
    """Every name the job's objects carry or KubeRay derives, against the rules KubeRay and Kubernetes apply
    (ray-operator/controllers/ray/utils/validation.go: a RayJob name is a DNS-1035 label of at most 47
    characters; its RayCluster is that name, "-" and 5 characters, at most 53; the head Service adds
    "-head-svc"; the submitter Job takes the RayJob's name)."""
    name = rayjob["metadata"]["name"]
    cluster = f"{name}-x7k2q"
    checks = [("RayJob", name, DNS_1035_LABEL, 47), ("RayCluster", cluster, DNS_1035_LABEL, 53),
              ("head Service", f"{cluster}-head-svc", DNS_1035_LABEL, 63), ("submitter Job", name, DNS_1035_LABEL, 63)]
    checks += [(obj["kind"], obj["metadata"]["name"], DNS_1123_SUBDOMAIN, 253)
               for obj in (config_map(target, config), telemetry_secret(target, "t"))]
    found = [f"{kind} {value!r}" for kind, value, rule, limit in checks if len(value) > limit or not rule.match(value)]
    for role, pod in [("RayJob", {"metadata": rayjob["metadata"]}), *kuberay_pods(rayjob)]:
        for key, value in {**rayjob["metadata"]["labels"], **pod.get("metadata", {}).get("labels", {})}.items():
            if len(value) > 63 or not LABEL_VALUE.match(value):
                found.append(f"{role} label {key}={value!r}")
    return found


@pytest.mark.parametrize("name", ["llama-3.1-8b-lora", "qwen2.5-7b", "8b-support-lora", "0", "a", "1.2.3",
                                  "x" * 253, "7" + ".b" * 126, "a-" * 18 + "b"])
def test_names_people_give_fine_tunes_make_rayjobs_kuberay_accepts(name):
    target = Target(namespace="team-a", name=name, uid=TARGET.uid, job_id=TARGET.job_id)
    rayjob, config = ray_job(target, FineTuneJobSpec.model_validate(SPEC), PLANS[1], POOL, SETTINGS)
    assert kuberay_refusals(rayjob, config, target) == []


@settings(max_examples=300, deadline=None)
@given(name=FINETUNEJOB_NAMES, uid=st.uuids())
def test_any_valid_finetunejob_name_makes_names_kuberay_and_kubernetes_accept(name, uid):
    target = Target(namespace="team-a", name=name, uid=str(uid), job_id=TARGET.job_id)
    rayjob, config = ray_job(target, FineTuneJobSpec.model_validate(SPEC), PLANS[1], POOL, SETTINGS)
    assert kuberay_refusals(rayjob, config, target) == []
    assert ray_job_name(target) == rayjob["metadata"]["name"] != ray_job_name(
        Target(namespace="team-a", name=name, uid=f"{uid}-again", job_id=TARGET.job_id))


def test_names_that_were_valid_keep_the_rayjob_name_an_earlier_operator_gave():
    assert ray_job_name(TARGET) == "llama-8b-support-lora-" + hashlib.sha256(TARGET.uid.encode()).hexdigest()[:6]


def test_a_dpo_reference_on_a_volume_is_mounted_and_named_as_the_pods_see_it():
    spec = FineTuneJobSpec.model_validate({
        **SPEC, "method": {"type": "lora", "objective": "dpo", "dpo": {"beta": 0.2, "reference": "pvc://sft/merged"}},
        "dataset": {"train": "pvc://datasets/pairs.jsonl", "format": "preference"}})
    rayjob, config = ray_job(TARGET, spec, PLANS[0], POOL, SETTINGS)
    assert config["method"]["dpo"]["reference"] == "/mnt/pvc/sft/merged" and config["method"]["objective"] == "dpo"
    claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]["readOnly"]
              for v in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims["sft"] is True  # read only, like the model
    JobConfig.model_validate(config)  # what the runtime reads
