"""The operator's scenario on a real cluster (`make e2e-cluster`; never in CI: no cluster exists there).

Needs: a cluster named by KUBECONFIG with KubeRay's operator installed and at least one NVIDIA GPU node
(device plugin, and GPU feature discovery for the pool's status), a worker image with this checkout's
`jobs` extra (TUNEWRIGHT_E2E_WORKER_IMAGE), and a storage class for a ReadWriteOnce volume (the default one
unless TUNEWRIGHT_E2E_STORAGE_CLASS). The pool: TUNEWRIGHT_E2E_GPU (a catalog GPU, default H100) and
TUNEWRIGHT_E2E_NODE_SELECTOR (`key=value`, default none).

It applies the CRDs, runs the operator from this checkout (kopf run) unless TUNEWRIGHT_E2E_OPERATOR=installed,
seeds a volume with the tiny Llama and the tiny dataset, submits a LoRA FineTuneJob on it, and checks what
only a real cluster can show: KubeRay accepts the RayJob, pods schedule on the GPU node, training runs to
Succeeded with a cost, `kubectl describe` tells the story, and deletion frees everything. Everything it makes
lives in one namespace, deleted at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest
import yaml

from tests.support.emulated import ROOT, Operator
from tunewright_core.k8s import KubernetesCluster, load_credentials
from tunewright_core.names import MODEL_SHAPE_ANNOTATION
from tunewright_jobs.tiny import build_model

pytestmark = pytest.mark.e2e
KUBECTL = str(ROOT / ".tools" / "bin" / "kubectl")
TIMEOUT_SECONDS = float(os.environ.get("TUNEWRIGHT_E2E_TIMEOUT", "1800"))


def kubectl(*args: str, check: bool = True) -> str:
    done = subprocess.run([KUBECTL, *args], capture_output=True, text=True, timeout=300)
    if check and done.returncode:
        raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
    return done.stdout


def wait(check, what: str, timeout: float = TIMEOUT_SECONDS, every: float = 5.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.environ.get("KUBECONFIG") or not os.environ.get("TUNEWRIGHT_E2E_WORKER_IMAGE"):
        pytest.fail("make e2e-cluster needs KUBECONFIG (a cluster with KubeRay and a GPU node) and "
                    "TUNEWRIGHT_E2E_WORKER_IMAGE (an image with tunewright's jobs extra)")
    load_credentials()
    kubectl("apply", "--server-side", "-f", str(ROOT / "charts" / "tunewright" / "crds"))
    operator = None
    if os.environ.get("TUNEWRIGHT_E2E_OPERATOR") != "installed":
        folder = tmp_path_factory.mktemp("operator")
        operator = Operator(os.environ["KUBECONFIG"], folder / "operator.log").start()
    yield KubernetesCluster(component="tunewright-e2e")
    if operator:
        operator.stop()


@pytest.fixture(scope="module")
def namespace(cluster):
    name = f"tw-e2e-{uuid.uuid4().hex[:6]}"
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def seed_volume(cluster, namespace: str) -> None:
    """A volume holding the tiny Llama and the tiny dataset, written by a pod of the worker image."""
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "e2e", "namespace": namespace},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "2Gi"}}}}
    if os.environ.get("TUNEWRIGHT_E2E_STORAGE_CLASS"):
        claim["spec"]["storageClassName"] = os.environ["TUNEWRIGHT_E2E_STORAGE_CLASS"]
    cluster.create(claim)
    script = ("set -e; python -m tunewright_jobs.tiny build --out /mnt/pvc/e2e >/dev/null; "
              "python -c 'import shutil, tunewright_jobs.tiny as t; "
              "[shutil.copy(t.DATA_DIR / f, \"/mnt/pvc/e2e/\" + f) for f in (\"train.jsonl\", \"validation.jsonl\")]'")
    cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "seed", "namespace": namespace}, "spec": {
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100},
        "containers": [{"name": "seed", "image": os.environ["TUNEWRIGHT_E2E_WORKER_IMAGE"],
                        "command": ["bash", "-c", script],
                        "volumeMounts": [{"name": "e2e", "mountPath": "/mnt/pvc/e2e"}]}],
        "volumes": [{"name": "e2e", "persistentVolumeClaim": {"claimName": "e2e"}}]}})
    wait(lambda: (cluster.get("Pod", namespace, "seed") or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
         "the seeding pod", timeout=900)
    assert cluster.get("Pod", namespace, "seed")["status"]["phase"] == "Succeeded", kubectl(
        "logs", "-n", namespace, "seed", check=False)


def test_a_finetunejob_runs_on_a_real_cluster(cluster, namespace, tmp_path):
    pool_name = namespace  # a pool of its own, removed at the end
    selector = dict([os.environ["TUNEWRIGHT_E2E_NODE_SELECTOR"].split("=", 1)]) if os.environ.get(
        "TUNEWRIGHT_E2E_NODE_SELECTOR") else {}
    cluster.create({"apiVersion": "tunewright.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": pool_name},
                    "spec": {"gpu": os.environ.get("TUNEWRIGHT_E2E_GPU", "H100"), "gpusPerNode": 1, "maxNodes": 1,
                             "nodeSelector": selector, "intraNode": "nvlink4", "pricePerGPUHour": 1.0,
                             "workerImage": os.environ["TUNEWRIGHT_E2E_WORKER_IMAGE"]}})
    try:
        seed_volume(cluster, namespace)
        shape = json.loads((build_model("llama", tmp_path / "tiny-llama") / "config.json").read_text())
        job = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "FineTuneJob",
               "metadata": {"name": "tiny-lora", "namespace": namespace,
                            "annotations": {MODEL_SHAPE_ANNOTATION: json.dumps(shape)}},
               "spec": {"model": {"source": "pvc://e2e/tiny-llama"}, "method": {"type": "lora"},
                        "dataset": {"train": "pvc://e2e/train.jsonl", "validation": "pvc://e2e/validation.jsonl"},
                        "hyperparameters": {"maxSteps": 30, "globalBatchSize": 8, "seqLen": 256,
                                            "learningRate": 0.005},
                        "resources": {"pool": pool_name, "maxGPUs": 1},
                        "checkpoint": {"storage": "pvc://e2e/checkpoints", "everySteps": 10}}}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(job))
        kubectl("apply", "-f", str(path))

        def finished():
            status = (cluster.get("FineTuneJob", namespace, "tiny-lora") or {}).get("status") or {}
            return status if status.get("phase") in ("Succeeded", "Failed", "Cancelled") else None

        status = wait(finished, "the job to finish")
        described = kubectl("describe", "ftj", "-n", namespace, "tiny-lora")
        assert status["phase"] == "Succeeded", described
        assert status["telemetry"]["costUSD"] > 0 and status["completionTime"] and status["rayJobName"]
        assert "RayJobCreated" in described and "Succeeded" in described
        print(kubectl("get", "ftj", "-n", namespace, "-o", "wide"))

        kubectl("delete", "ftj", "-n", namespace, "tiny-lora", "--timeout=300s")
        assert cluster.list("RayJob", namespace) == []
        wait(lambda: not cluster.list("Pod", namespace, label_selector="ray.io/is-ray-node=yes"), "the Ray pods gone",
             timeout=600)
    finally:
        kubectl("delete", "gpupool", pool_name, "--ignore-not-found")
