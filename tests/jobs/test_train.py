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

from tests.jobs.conftest import make_config, metrics, python_path, write_config
from tunewright_jobs.data import DatasetError
from tunewright_jobs.evaluate import validation_metrics
from tunewright_jobs.parallel import Dist
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
