"""The job config the operator (and the API) emit must parse with the training runtime's own loader."""

import pytest

from tunewright_jobs.config import JobConfig
from tunewright_operator.jobconfig import runtime_config
from tunewright_operator.planner.estimate import Layout
from tunewright_operator.spec import FineTuneJobSpec


@pytest.mark.parametrize("layout", [
    Layout("single", 1, 1, 4, 2, False),
    Layout("ddp", 8, 1, 2, 4, False),
    Layout("fsdp", 8, 1, 1, 8, True, shard_group=8),
    Layout("hsdp", 16, 2, 1, 4, True, shard_group=8),
    Layout("hsdp", 32, 4, 4, 2, True, shard_group=8, cpu_offload=True),
])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_emitted_config_parses_and_keeps_the_layout(layout, method):
    spec = FineTuneJobSpec.model_validate({
        "model": {"source": "hf://Qwen/Qwen2.5-7B", "revision": "main"},
        "method": {"type": method, "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]}},
        "dataset": {"train": "file-1", "validation": "file-2", "format": "prompt_completion"},
        "hyperparameters": {"epochs": 3, "learningRate": 1e-5, "seqLen": 4096, "warmupRatio": 0.1, "seed": 7},
        "checkpoint": {"storage": "s3://bucket/ckpt", "everySteps": 100},
    })
    emitted = runtime_config(spec, layout, True, name="ftjob-abc", output_dir="/out", train="/data/train.jsonl",
                             validation="/data/valid.jsonl")
    cfg = JobConfig.from_dict(emitted)
    plan = cfg.batch_plan()
    assert (cfg.strategy.type, cfg.strategy.num_workers, plan.micro_batch_size, plan.grad_accum) == (
        layout.strategy, layout.gpus, layout.micro_batch, layout.grad_accum)
    assert cfg.strategy.hsdp_shard_size == (layout.shard_group if layout.strategy == "hsdp" else None)
    assert cfg.strategy.cpu_offload == layout.cpu_offload
    assert cfg.method.type == method and cfg.method.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.hyperparameters.epochs == 3 and cfg.hyperparameters.seq_len == 4096
    assert cfg.checkpoint.storage == "s3://bucket/ckpt" and cfg.checkpoint.every_steps == 100
    assert cfg.model.revision == "main" and cfg.dataset.format == "prompt_completion"
