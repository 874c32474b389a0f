"""The job config the operator (and the API) emit must parse with the training runtime's own loader."""

import pytest
from pydantic import ValidationError

from tunewright_core import spec as operator_spec
from tunewright_core.jobconfig import runtime_config
from tunewright_core.spec import FineTuneJobSpec, GPUPoolSpec, JobPlan
from tunewright_jobs import config
from tunewright_jobs.config import JobConfig


def layout(strategy, gpus, nodes, micro, accum, checkpointing, shard_group=1, cpu_offload=False) -> JobPlan:
    return JobPlan(pool="p", strategy=strategy, workers=gpus, gpus=gpus, nodes=nodes, micro_batch=micro,
                   grad_accum=accum, activation_checkpointing=checkpointing, shard_group=shard_group,
                   cpu_offload=cpu_offload, explanation="test")


@pytest.mark.parametrize("plan", [
    layout("single", 1, 1, 4, 2, False),
    layout("ddp", 8, 1, 2, 4, False),
    layout("fsdp", 8, 1, 1, 8, True, shard_group=8),
    layout("hsdp", 16, 2, 1, 4, True, shard_group=8),
    layout("hsdp", 32, 4, 4, 2, True, shard_group=8, cpu_offload=True),
    JobPlan(pool="local", device="cpu", strategy="ddp", workers=2, gpus=0, micro_batch=4, grad_accum=1,
            explanation="cpu"),
])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_emitted_config_parses_and_keeps_the_plan(plan, method):
    spec = FineTuneJobSpec.model_validate({
        "model": {"source": "hf://Qwen/Qwen2.5-7B", "revision": "main"},
        "method": {"type": method, "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]}},
        "dataset": {"train": "file-1", "validation": "file-2", "format": "prompt_completion"},
        "hyperparameters": {"epochs": 3, "learningRate": 1e-5, "seqLen": 4096, "warmupRatio": 0.1, "seed": 7},
        "checkpoint": {"storage": "s3://bucket/ckpt", "everySteps": 100},
    })
    emitted = runtime_config(spec, plan, name="ftjob-abc", output_dir="/out", train="/data/train.jsonl",
                             validation="/data/valid.jsonl")
    cfg = JobConfig.from_dict(emitted)
    batches = cfg.batch_plan()
    assert (cfg.strategy.type, cfg.strategy.num_workers, batches.micro_batch_size, batches.grad_accum) == (
        plan.strategy, plan.workers, plan.micro_batch, plan.grad_accum)
    assert cfg.strategy.use_gpu == (plan.device == "gpu")
    assert cfg.strategy.hsdp_shard_size == (plan.shard_group if plan.strategy == "hsdp" else None)
    assert cfg.strategy.cpu_offload == plan.cpu_offload
    assert cfg.method.type == method and cfg.method.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.hyperparameters.epochs == 3 and cfg.hyperparameters.seq_len == 4096
    assert cfg.checkpoint.storage == "s3://bucket/ckpt" and cfg.checkpoint.every_steps == 100
    assert cfg.model.revision == "main" and cfg.dataset.format == "prompt_completion"


def test_the_planner_counts_the_fused_loss_chunk_the_runtime_holds():
    from tunewright_core.planner.estimate import FUSED_LOSS_CHUNK_ELEMENTS as planned_chunk
    from tunewright_jobs.kernels import FUSED_LOSS_CHUNK_ELEMENTS as runtime_chunk

    assert planned_chunk == runtime_chunk


def test_the_planner_counts_kernels_recompute_where_the_runtime_turns_it_on():
    from tunewright_core.planner.estimate import RECOMPUTED_BY_DEFAULT as planned
    from tunewright_jobs.kernels import RECOMPUTED_BY_DEFAULT as runtime

    assert planned == runtime


RUNTIME_CONFIG = {"output_dir": "/out", "model": {"source": "m"}, "dataset": {"train": "t.jsonl"}}
SPEC = {"model": {"source": "m"}, "dataset": {"train": "file-1"}}


@pytest.mark.parametrize(("model", "data"), [
    (JobConfig, {**RUNTIME_CONFIG, "hyperparameters": {"learning_rte": 1e-4}}),
    (JobConfig, {**RUNTIME_CONFIG, "surprise": 1}),
    (FineTuneJobSpec, {**SPEC, "hyperparameters": {"learning_rte": 1e-4, "globalBatch": 8}}),
    (FineTuneJobSpec, {**SPEC, "method": {"lora": {"rank": 8}}}),
    (GPUPoolSpec, {"gpu": "H100", "gpusPerNode": 8, "maxNodes": 1, "intraNode": "nvlink4", "pricePerGPUHour": 1,
                   "workerImage": "w", "tolerations": [{"keey": "gpu"}], "zzz": 1}),
])
def test_the_runtime_says_an_unknown_key_as_the_spec_does(model, data):
    """The runtime keeps its own copy of the spec's error_message (it imports nothing of ours)."""
    errors = pytest.raises(ValidationError, model.model_validate, data).value.errors()
    assert [config.error_message(e, model) for e in errors] == [operator_spec.error_message(e, model) for e in errors]
    assert all("unknown key; " in config.error_message(e, model) for e in errors)
