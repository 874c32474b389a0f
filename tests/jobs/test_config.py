import json

import pytest

from tests.jobs.conftest import base_config
from tunewright_jobs.config import ConfigError, JobConfig

VALID = {
    "output_dir": "/tmp/out",
    "model": {"source": "hf://Qwen/Qwen2.5-0.5B"},
    "dataset": {"train": "train.jsonl"},
}


def with_(path: str, value):
    config = json.loads(json.dumps(VALID))
    node = config
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return config


def test_defaults_and_round_trip():
    cfg = JobConfig.from_dict(VALID)
    assert cfg.model.resolved_source == "Qwen/Qwen2.5-0.5B"
    assert cfg.method.type == "lora" and cfg.method.lora.target_modules == ["all-linear"]
    assert cfg.checkpoint_storage == "/tmp/out/checkpoints"
    assert JobConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({k: v for k, v in VALID.items() if k != "model"}, "model: Field required"),
        (with_("method.type", "qlora"), "method.type: Input should be 'lora' or 'full'"),
        (with_("method.lora.r", 0), "method.lora.r: Input should be greater than 0"),
        (with_("method.lora.dropout", 1.5), "method.lora.dropout: Input should be less than 1"),
        (with_("method.lora.target_modules", []), "method.lora.target_modules: List should have at least 1 item"),
        (with_("dataset.format", "csv"), "dataset.format: Input should be 'chat', 'prompt_completion' or 'text'"),
        (with_("hyperparameters.learning_rate", -1), "hyperparameters.learning_rate: Input should be greater than 0"),
        (with_("hyperparameters.global_batch_tokens", 1000),
         "hyperparameters: global_batch_tokens (1000) must be a multiple of seq_len (2048)"),
        (with_("hyperparameters", {"global_batch_size": 8, "global_batch_tokens": 4096}),
         "hyperparameters: set global_batch_size or global_batch_tokens, not both"),
        (with_("hyperparameters", {"epochs": None}), "hyperparameters: set epochs or max_steps"),
        (with_("strategy", {"type": "single", "num_workers": 2}),
         "strategy: strategy single runs on 1 worker, got num_workers=2"),
        (with_("strategy", {"type": "hsdp", "num_workers": 4}),
         "strategy: hsdp needs hsdp_shard_size (GPUs per sharding group)"),
        (with_("strategy", {"type": "hsdp", "num_workers": 6, "hsdp_shard_size": 4}),
         "strategy: num_workers (6) must be a multiple of hsdp_shard_size (4)"),
        (with_("strategy", {"type": "ddp", "num_workers": 2, "hsdp_shard_size": 2}),
         "strategy: hsdp_shard_size only applies to strategy hsdp"),
        (with_("strategy", {"cpu_offload": True}), "strategy: cpu_offload moves GPU state to the host: it needs use_gpu"),
        (with_("metrics", {"profile": {"steps": 0}}), "metrics.profile.steps: Input should be greater than 0"),
        (with_("strategy", {"type": "ddp", "num_workers": 3, "micro_batch_size": 2}) | {
            "hyperparameters": {"global_batch_size": 8}},
         "hyperparameters.global_batch_*: 8 sequences is not a multiple of micro_batch_size (2) x workers (3)"),
        (with_("strategy", {"micro_batch_size": 2, "grad_accum": 3}) | {"hyperparameters": {"global_batch_size": 8}},
         "strategy.grad_accum: 3 contradicts the global batch (8 = 2 x 1 x 4)"),
        (with_("eval.exact_match", True), "eval.exact_match: needs dataset.validation"),
        (with_("name", "Bad Name!"), "name: String should match pattern"),
        (with_("surprise", 1), "surprise: unknown key; the keys here are: name, output_dir, model,"),
        (with_("hyperparameters.learning_rte", 1e-4), "hyperparameters.learning_rte: unknown key; did you mean "
                                                       "learning_rate?"),
        (with_("method.lora.target_module", ["q_proj"]), "method.lora.target_module: unknown key; did you mean "
                                                           "target_modules?"),
    ],
)
def test_rejects_with_field_and_reason(config, expected):
    with pytest.raises(ConfigError) as err:
        JobConfig.from_dict(config)
    assert expected in str(err.value)


def test_all_problems_reported_at_once():
    config = with_("method.lora.r", -1) | {"hyperparameters": {"learning_rate": 0}}
    message = str(pytest.raises(ConfigError, JobConfig.from_dict, config).value)
    assert "method.lora.r" in message and "hyperparameters.learning_rate" in message


@pytest.mark.parametrize(
    ("hyper", "strategy", "accum", "global_batch"),
    [
        ({}, {}, 1, 1),
        ({"global_batch_size": 16}, {"micro_batch_size": 4}, 4, 16),
        ({"global_batch_size": 16}, {"type": "ddp", "num_workers": 2, "micro_batch_size": 2}, 4, 16),
        ({"global_batch_tokens": 32768, "seq_len": 2048}, {"type": "fsdp", "num_workers": 8, "micro_batch_size": 1}, 2, 16),
        ({}, {"micro_batch_size": 2, "grad_accum": 3}, 3, 6),
    ],
)
def test_batch_plan(hyper, strategy, accum, global_batch):
    plan = JobConfig.from_dict(VALID | {"hyperparameters": hyper, "strategy": strategy}).batch_plan()
    assert (plan.grad_accum, plan.global_batch_size) == (accum, global_batch)


def test_not_json():
    with pytest.raises(ConfigError, match="line 1 column 2"):
        JobConfig.from_json("{oops")


def test_lora_targets_that_match_nothing_fail_naming_the_field(tiny_models, tmp_path):
    """What the planner's table cannot check (a path, an unknown architecture) the runtime refuses at build."""
    from transformers import AutoModelForCausalLM

    from tunewright_jobs.model import apply_lora

    cfg = JobConfig.from_dict(base_config(tiny_models["gpt2"], tmp_path, method={
        "type": "lora", "lora": {"r": 4, "alpha": 8, "target_modules": ["transformer.h.0.attn.no_such"]}}))
    with pytest.raises(ValueError, match=r"^method\.lora\.target_modules: .*no_such"):
        apply_lora(cfg, AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]))
