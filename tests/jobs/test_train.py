"""Training in one process (the same loop Ray and torchrun run): learning, equivalences, export, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.jobs.conftest import base_config, make_config, merge, metrics, python_path, write_config
from tunewright_jobs.config import JobConfig
from tunewright_jobs.data import DatasetError
from tunewright_jobs.evaluate import validation_metrics
from tunewright_jobs.parallel import Dist, MasterWeights, shards_with_fsdp
from tunewright_jobs.run import main, train_with_ray, train_without_ray
from tunewright_jobs.train import preflight


def adapter_weights(cfg) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.output_dir) / "final" / "adapter" / "adapter_model.safetensors")


def test_lora_learns_the_task(tiny_models, tmp_path):
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 40},
                      eval={"exact_match": True, "exact_match_max_examples": 16, "max_new_tokens": 3})
    result = train_without_ray(cfg)
    before, after = result["eval_before"], result["eval_after"]
    assert after["val_loss"] < 0.5 * before["val_loss"]
    assert after["val_token_accuracy"] > before["val_token_accuracy"] + 0.5
    steps = metrics(cfg)
    assert [r.step for r in steps] == list(range(1, 41))
    assert steps[-1].loss < 0.5 * steps[0].loss
    for record in steps:
        assert record.tokens > 0 and record.tokens_per_second > 0 and record.grad_norm >= 0
        assert record.forward_backward_seconds > 0 and record.optimizer_seconds > 0
    start = metrics(cfg, "start")[0]
    assert start.trainable_parameters < start.parameters / 4
    (checkpoint,) = metrics(cfg, "checkpoint")  # the final one
    assert (checkpoint.step, checkpoint.train_loss) == (40, steps[-1].loss)
    assert (Path(checkpoint.uri) / "trainer_state.json").exists()
    (end,) = metrics(cfg, "end")
    assert end.model_dump(mode="json") == result == json.loads((Path(cfg.output_dir) / "result.json").read_text())


def test_full_fine_tuning_learns_with_checkpointing(tiny_models, tmp_path):
    cfg = make_config(tiny_models["llama"], tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 30, "learning_rate": 2e-3},
                      strategy={"activation_checkpointing": True})
    result = train_without_ray(cfg)
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]
    exported = AutoModelForCausalLM.from_pretrained(result["export"]["model"])
    assert exported.config.model_type == "llama"


def test_gradient_accumulation_matches_one_big_micro_batch(tiny_models, tmp_path):
    """Loss is a mean over all labelled tokens of the global batch, however it is split: the first step's
    loss and gradient norm agree to rounding (later steps drift apart only as Adam amplifies rounding)."""
    one = make_config(tiny_models["gpt2"], tmp_path / "a", hyperparameters={"max_steps": 5})
    split = make_config(tiny_models["gpt2"], tmp_path / "b", hyperparameters={"max_steps": 5},
                        strategy={"micro_batch_size": 1})
    assert split.batch_plan().grad_accum == 4
    train_without_ray(one)
    train_without_ray(split)
    first_a, first_b = metrics(one)[0], metrics(split)[0]
    assert first_b.loss == pytest.approx(first_a.loss, rel=1e-6)
    assert first_b.grad_norm == pytest.approx(first_a.grad_norm, rel=1e-5)
    assert [r.loss for r in metrics(split)] == pytest.approx([r.loss for r in metrics(one)], rel=1e-2)


def test_exported_adapter_reloads_and_reproduces_outputs(tiny_models, tmp_path):
    cfg = make_config(tiny_models["gpt2"], tmp_path, checkpoint={"export_merged": True})
    result = train_without_ray(cfg)
    tokenizer = AutoTokenizer.from_pretrained(result["export"]["adapter"])
    assert tokenizer.chat_template  # the fallback template travels with the export
    base = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])
    reloaded = PeftModel.from_pretrained(base, result["export"]["adapter"]).eval()
    data = preflight(cfg)
    dist = Dist(0, 1, 0, torch.device("cpu"))
    again = validation_metrics(reloaded, data.val_rows, dist, 4, tokenizer.pad_token_id, max_batches=4)
    assert again["val_loss"] == pytest.approx(result["eval_after"]["val_loss"], rel=1e-5)
    assert again["val_token_accuracy"] == pytest.approx(result["eval_after"]["val_token_accuracy"])

    merged = AutoModelForCausalLM.from_pretrained(result["export"]["merged"]).eval()
    ids = torch.tensor([tokenizer("The soup was cold.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reloaded(ids).logits, atol=1e-5, rtol=1e-4)


def test_bad_dataset_fails_before_anything_is_written(tiny_models, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": "nope"}\n')
    cfg = make_config(tiny_models["gpt2"], tmp_path / "out", dataset={"train": str(bad)})
    assert main(["--config", str(write_config(tmp_path / "job.json", cfg)), "--no-ray"]) == 2
    assert 'bad.jsonl:2: "messages" must be a non-empty list' in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    import ray

    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        train_with_ray(cfg, max_failures=0)
    assert not ray.is_initialized()  # rejected before any worker (or GPU) was asked for


def test_bad_config_file_is_reported_with_fields(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"output_dir": "x", "model": {}, "dataset": {"train": "t"}}))
    assert main(["--config", str(path), "--no-ray"]) == 2
    assert "model.source: Field required" in capsys.readouterr().err


def run_cli(config_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": python_path()}
    return subprocess.Popen([sys.executable, "-m", "tunewright_jobs.run", "--config", str(config_path), "--no-ray"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_killed_run_resumes_with_no_step_repeated_or_skipped(tiny_models, tmp_path):
    overrides = dict(method={"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.1}},  # RNG matters
                     hyperparameters={"max_steps": 150, "seq_len": 64, "global_batch_size": 2},
                     strategy={"micro_batch_size": 1}, checkpoint={"every_steps": 5, "keep_last": 2},
                     eval={"max_batches": 1})
    killed = make_config(tiny_models["gpt2"], tmp_path / "killed", **overrides)
    path = write_config(tmp_path / "killed.json", killed)
    proc = run_cli(path)
    checkpoints = Path(killed.checkpoint_storage) / killed.name
    deadline = time.monotonic() + 120
    while not (checkpoints / "step_00000015").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_before = [r.step for r in metrics(killed)]
    assert 15 <= steps_before[-1] < 150  # killed mid-way, possibly after a few more steps

    resumed = run_cli(path)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    result = json.loads((Path(killed.output_dir) / "result.json").read_text())
    assert result["resumed_from_step"] >= 15 and result["resumed_from_step"] % 5 == 0
    assert [r.step for r in metrics(killed)] == list(range(1, 151))

    straight = make_config(tiny_models["gpt2"], tmp_path / "straight", **overrides)
    train_without_ray(straight)
    a, b = adapter_weights(killed), adapter_weights(straight)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    losses = {r.step: r.loss for r in metrics(killed)}
    assert losses == pytest.approx({r.step: r.loss for r in metrics(straight)}, rel=1e-5)


def test_fsdp_in_one_process_matches_single(tiny_models, tmp_path):
    """FSDP with one worker (a device mesh of one, no launcher) computes what a plain process does."""
    single = make_config(tiny_models["llama"], tmp_path / "single", method={"type": "full"},
                         hyperparameters={"max_steps": 3})
    sharded = make_config(tiny_models["llama"], tmp_path / "fsdp", method={"type": "full"},
                          hyperparameters={"max_steps": 3}, strategy={"type": "fsdp"})
    train_without_ray(single)
    result = train_without_ray(sharded)
    assert result["strategy"] == "fsdp"
    assert metrics(sharded)[0].loss == pytest.approx(metrics(single)[0].loss, rel=1e-6)
    assert metrics(sharded)[0].grad_norm == pytest.approx(metrics(single)[0].grad_norm, rel=1e-5)
    assert metrics(single)[0].grad_norm > single.hyperparameters.max_grad_norm  # the clipping is active
    # past updates of sharded parameters (DTensors) clipped inside the fused optimizer
    assert metrics(sharded)[-1].loss == pytest.approx(metrics(single)[-1].loss, rel=1e-5)
    assert metrics(sharded)[-1].grad_norm == pytest.approx(metrics(single)[-1].grad_norm, rel=1e-4)


@pytest.mark.parametrize(("model", "method", "recompute"), [("gpt2", "full", False), ("llama", "lora", False),
                                                           ("gpt2", "full", True)])
def test_single_masters_compute_what_fsdp2s_mixed_precision_does(tiny_models, tmp_path, model, method, recompute):
    """bf16 compute on fp32 masters: `single` (the plain module, parallel.MasterWeights) against FSDP2 on a mesh
    of one, over steps with two accumulated micro-batches, (GPT-2) tied embeddings and head, and with
    activation checkpointing (the copies read again in backward): the same casts and sums, so the same
    losses, norms and exported weights."""
    overrides = dict(method={"type": method}, hyperparameters={"max_steps": 4, "global_batch_size": 4},
                     strategy={"micro_batch_size": 2, "precision": "bf16", "activation_checkpointing": recompute},
                     eval={"max_batches": 1})
    single = make_config(tiny_models[model], tmp_path / "single", **overrides)
    sharded = make_config(tiny_models[model], tmp_path / "fsdp", **merge(overrides, {"strategy": {"type": "fsdp"}}))
    train_without_ray(single)
    train_without_ray(sharded)
    assert [(r.loss, r.grad_norm) for r in metrics(single)] == [(r.loss, r.grad_norm) for r in metrics(sharded)]
    assert metrics(single)[-1].loss < metrics(single)[0].loss
    exported = "adapter/adapter_model.safetensors" if method == "lora" else "model/model.safetensors"
    a, b = (load_file(Path(c.output_dir) / "final" / exported) for c in (single, sharded))
    assert a.keys() == b.keys() and all(a[k].dtype == torch.float32 for k in a)  # the masters, not the copies
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_master_weights_free_their_copies_after_the_steps_last_backward_only():
    """Copies stand in the module; each gradient lands on its fp32 master, summed over micro-batches; the
    last micro-batch's backward frees every copy (FSDP2's resharding), and `refresh` makes them again."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(1, 1))
    unused = model[2]  # trainable, yet no gradient reaches it: its copy is never freed, nor needs to be
    originals = list(model.parameters())
    masters = MasterWeights(model, torch.bfloat16)
    copies = list(model.parameters())
    assert all(t is o for t, o in zip(masters.trainable, originals, strict=True))
    assert all(c.dtype == torch.bfloat16 and c is not o for c, o in zip(copies, originals, strict=True))
    used = copies[:4]
    x = torch.randn(3, 4).bfloat16()
    first = None
    for last in (False, True):  # the same micro-batch twice: the masters' gradients double
        masters.last_micro_batch(last)
        assert all(c.untyped_storage().size() == c.nbytes for c in copies)  # the forward computes on them
        model[1](model[0](x)).sum().backward()
        assert all(c.grad is None for c in copies)  # folded, not held
        first = first or [o.grad.clone() for o in originals[:4]]
    assert all(c.untyped_storage().size() == 0 for c in used)
    assert all(p.untyped_storage().size() == p.nbytes and p.grad is None for p in unused.parameters())
    for o, g in zip(originals, first, strict=False):
        assert o.grad.dtype == torch.float32 and torch.equal(o.grad, 2 * g)
    with torch.no_grad():
        for o in originals:
            o.add_(1.0)
    masters.refresh()
    assert all(torch.equal(c, o.detach().bfloat16()) for c, o in zip(copies, originals, strict=True))
    with masters.masters_installed():
        assert all(p is o for p, o in zip(model.parameters(), originals, strict=True))
    assert all(p is c for p, c in zip(model.parameters(), copies, strict=True))


@pytest.mark.parametrize(("strategy", "dtype", "fsdp"), [
    ({}, None, False),  # the CPU: fp32 throughout
    ({"use_gpu": True}, None, False),  # a bf16 LoRA base, bf16 compute
    ({"use_gpu": True, "precision": "fp32"}, None, True),  # fp32 compute would widen the whole bf16 base
    ({"use_gpu": True, "precision": "fp32"}, "float32", False),
    ({"use_gpu": True, "cpu_offload": True}, None, True),  # FSDP2 is what offloads
    ({"type": "fsdp"}, None, True),  # FSDP2's path on one worker
])
def test_single_trains_the_plain_module_unless_fsdp2_is_what_the_job_needs(strategy, dtype, fsdp):
    model = {"source": "/models/any"} | ({"dtype": dtype} if dtype else {})
    cfg = JobConfig.from_dict(base_config(Path("/models/any"), Path("/out"), model=model, strategy=strategy))
    assert shards_with_fsdp(cfg) is fsdp


def test_single_with_masters_resumes_exactly(tiny_models, tmp_path):
    """A run resumed from a bf16 `single` checkpoint continues from the masters it saved, with its compute
    copies refreshed from them: the same steps as a run never stopped."""
    def config(out: Path, steps: int, storage: Path):
        return make_config(tiny_models["gpt2"], out, method={"type": "full"},
                           hyperparameters={"max_steps": steps, "lr_schedule": "constant"},
                           strategy={"precision": "bf16"}, checkpoint={"storage": str(storage)},
                           eval={"max_batches": 1})
    train_without_ray(config(tmp_path / "first", 3, tmp_path / "ckpt"))
    resumed = config(tmp_path / "resumed", 6, tmp_path / "ckpt")
    assert train_without_ray(resumed)["resumed_from_step"] == 3
    straight = config(tmp_path / "straight", 6, tmp_path / "straight-ckpt")
    train_without_ray(straight)
    assert [r.loss for r in metrics(resumed)] == [r.loss for r in metrics(straight)][3:]


def test_a_records_time_is_its_steps_time(tiny_models, tmp_path, monkeypatch):
    """Records of several steps with evaluations and a checkpoint inside them: each record's step time holds
    its steps' measured phases and data wait (none of its time is lost) and none of the evaluations' time."""
    from tunewright_jobs import train as train_module

    pause = 2.0  # far above a tiny CPU step, so that a loaded machine cannot blur the two
    evaluate = train_module.validation_metrics

    def slow_evaluation(*args, **kwargs):
        time.sleep(pause)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "validation_metrics", slow_evaluation)
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 8},
                      metrics={"log_every_steps": 4}, eval={"every_steps": 3}, checkpoint={"every_steps": 5})
    train_without_ray(cfg)
    records = metrics(cfg)
    assert [r.step for r in records] == [4, 8]
    for r in records:
        assert r.step_seconds >= r.forward_backward_seconds + r.optimizer_seconds + r.data_seconds, r
        assert r.step_seconds < pause / 4, r  # an evaluation counted in would add pause / 4 a step


@pytest.mark.parametrize("max_norm", [0.01, 1e6, None])
def test_clipping_inside_the_fused_optimizer_equals_clip_grad_norm(max_norm):
    """The fused optimizer divides each gradient by grad_scale as it reads it: the same steps as
    clip_grad_norm_ followed by the unclipped update, and the same norm reported."""
    from tunewright_jobs.train import clip_gradients

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused, foreach=not fused)
        norms, first_moments = [], []
        for _ in range(4):
            model(x).pow(2).sum().mul(50).backward()
            norms.append(clip_gradients(optimizer, list(model.parameters()), max_norm).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # Adam's update barely depends on the gradients' scale; its first moment is the clipped gradients
            first_moments.append([optimizer.state[p]["exp_avg"].clone() for p in model.parameters()])
        runs.append((norms, first_moments, [p.detach().clone() for p in model.parameters()]))
    (fused_norms, fused_moments, fused_params), (plain_norms, plain_moments, plain_params) = runs
    assert fused_norms == pytest.approx(plain_norms, rel=1e-5)
    if max_norm == 0.01:
        assert min(plain_norms) > 0.01  # the clipping was active
    for a, b in zip([*sum(fused_moments, []), *fused_params], [*sum(plain_moments, []), *plain_params], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_an_optimizer_resumed_with_unfused_groups_clips_on_its_own():
    """A checkpoint from before the fused CPU optimizer restores groups with fused=False: their step takes the
    foreach path, which refuses grad_scale, so the gradients are clipped before it."""
    from tunewright_jobs.train import clip_gradients

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for group in optimizer.param_groups:  # what load_state_dict takes from such a checkpoint
        group.update(fused=False, foreach=True)
    model(torch.ones(2, 4)).sum().mul(100).backward()
    norm = clip_gradients(optimizer, list(model.parameters()), max_norm=0.5)
    assert norm > 0.5 and getattr(optimizer, "grad_scale", None) is None
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert clipped == pytest.approx(0.5, rel=1e-4)
    optimizer.step()
