"""kubectl's path for the lighter options: a FineTuneJob asking for a 4-bit base (auto), bf16 optimizer state
(auto) or FP8 products is planned by the operator on its pool, and the RayJob's job config carries what the plan
chose, parsed by the runtime's own loader."""

import json

import pytest

from tests.operator.test_reconcile import NOW, SETTINGS, cluster_with, finetunejob, job_status
from tunewright_jobs.config import JobConfig
from tunewright_operator.reconcile import reconcile

ONE_H200 = {"apiVersion": "tunewright.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "h200"},
            "spec": {"gpu": "H200", "gpusPerNode": 1, "maxNodes": 1, "intraNode": "nvlink4",
                     "pricePerGPUHour": 3.5, "workerImage": "example/worker:0.1.0", "default": True,
                     "hostMemoryGiB": 2048}}
BASE = {"dataset": {"train": "pvc://datasets/support/train.jsonl"},
        "hyperparameters": {"maxSteps": 100, "globalBatchSize": 16, "seqLen": 1024},
        "checkpoint": {"storage": "pvc://checkpoints/run"}}


@pytest.mark.parametrize(("spec", "plan_field", "chosen", "config_path", "configured"), [
    ({"model": {"source": "hf://meta-llama/Llama-3.1-70B"}, "method": {"lora": {"quantization": "auto"}}},
     "quantization", "nf4", ("method", "lora", "quantization"), "nf4"),
    ({"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "method": {"type": "full"},
      "hyperparameters": {**BASE["hyperparameters"], "optimizerState": "auto"}},
     "optimizerState", "bf16", ("hyperparameters", "optimizer_state"), "bf16"),
    ({"model": {"source": "hf://meta-llama/Llama-3.1-8B"}, "resources": {"precision": "fp8"}},
     "precision", "fp8", ("strategy", "precision"), "fp8"),
])
def test_the_operator_plans_the_option_and_the_rayjob_runs_it(spec, plan_field, chosen, config_path, configured):
    cluster = cluster_with(ONE_H200, finetunejob({**BASE, **spec}, name="lighter"))
    outcome = reconcile(cluster.get("FineTuneJob", "team-a", "lighter"), cluster, SETTINGS, NOW)
    assert outcome.phase == "Queued", job_status(cluster, "lighter")
    assert job_status(cluster, "lighter")["plan"][plan_field] == chosen
    (config_map,) = [o for (kind, _, _), o in cluster.objects.items() if kind == "ConfigMap"]  # as written
    config = json.loads(config_map["data"]["job.json"])
    value = config
    for key in config_path:
        value = value[key]
    assert value == configured
    JobConfig.model_validate(config)  # what the runtime reads
