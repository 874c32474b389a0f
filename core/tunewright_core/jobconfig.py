"""FineTuneJob spec + its JobPlan → the training runtime's job config (a plain dict).

The operator does not import the runtime (its config is the runtime's own contract); a contract test
parses what this emits with the runtime's loader.
"""

from __future__ import annotations

from tunewright_core.spec import FineTuneJobSpec, JobPlan


def runtime_config(spec: FineTuneJobSpec, plan: JobPlan, *, name: str, output_dir: str, train: str,
                   validation: str | None, checkpoint_storage: str | None = None,
                   metrics_path: str | None = None, telemetry_endpoint: str | None = None,
                   reference: str | None = None) -> dict:
    """`train`/`validation` are what the workers read (uploaded file ids resolved to paths by the caller);
    `reference`: what they read for method.dpo.reference (a volume's pod path), when not the spec's own.

    The objective and its settings are written for dpo only: sft is the runtime's default, so the config of an
    sft job is what it always was."""
    hp, method = spec.hyperparameters, spec.method
    hyperparameters: dict[str, float | str] = {
        "learning_rate": hp.learning_rate, "seq_len": hp.seq_len, "warmup_ratio": hp.warmup_ratio,
        "weight_decay": hp.weight_decay, "seed": hp.seed,
        # the plan fixes the global batch; a batch given in the spec was an input to choosing it
        "global_batch_size": plan.global_batch_size,
        "epochs": hp.epochs,
    }
    if hp.max_steps is not None:
        hyperparameters["max_steps"] = hp.max_steps
    if plan.optimizer_state != "fp32":  # auto resolved by the plan; an fp32 job's config is what it always was
        hyperparameters["optimizer_state"] = plan.optimizer_state
    strategy: dict[str, object] = {"type": plan.strategy, "num_workers": plan.workers, "use_gpu": plan.device == "gpu",
                "micro_batch_size": plan.micro_batch, "grad_accum": plan.grad_accum,
                "activation_checkpointing": plan.activation_checkpointing,
                "activation_checkpointing_every": plan.activation_checkpointing_every,
                "reshard_after_forward": plan.reshard_after_forward}
    if plan.strategy == "hsdp":
        strategy["hsdp_shard_size"] = plan.shard_group
    if plan.cpu_offload:
        strategy["cpu_offload"] = True
    if plan.precision == "fp8":
        strategy["precision"] = "fp8"
    method_config: dict = {"type": method.type, "lora": {"r": method.lora.r, "alpha": method.lora.alpha,
                                                         "dropout": method.lora.dropout,
                                                         "target_modules": list(method.lora.target_modules)}}
    if plan.quantization != "none":  # auto resolved by the plan; a bf16 base's config is what it always was
        method_config["lora"]["quantization"] = plan.quantization
    if method.objective == "dpo":
        dpo = method.dpo
        method_config["objective"] = "dpo"
        method_config["dpo"] = {"beta": dpo.beta, "label_smoothing": dpo.label_smoothing,
                                "reference": reference or dpo.reference}
    config = {
        "name": name,
        "output_dir": output_dir,
        "model": {"source": spec.model.source, "revision": spec.model.revision},
        "method": method_config,
        "dataset": {"train": train, "validation": validation, "format": spec.dataset.format},
        "hyperparameters": hyperparameters,
        "strategy": strategy,
        "checkpoint": {"storage": checkpoint_storage or spec.checkpoint.storage,
                       "every_steps": spec.checkpoint.every_steps,
                       **({"export_merged": True} if spec.checkpoint.export_merged else {})},
        "metrics": {"path": metrics_path, "endpoint": telemetry_endpoint},
        "eval": {"every_steps": spec.evaluation.every_steps,
                 "exact_match": spec.evaluation.exact_match and validation is not None,
                 "max_new_tokens": spec.evaluation.max_new_tokens},
    }
    return config
