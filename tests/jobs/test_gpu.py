"""The runtime on CUDA: bf16 LoRA, QLoRA and full fine-tuning on one GPU (with and without CPU offload), DDP,
FSDP and HSDP over NCCL on two, with the measured communication share.

CI has no GPU (these are skipped there); they run on the device machine: `pytest -m gpu`.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from tests.jobs.conftest import make_config, metrics, python_path, write_config
from tunewright_jobs.run import train_without_ray

pytestmark = pytest.mark.gpu


def cuda_config(tiny_models, out, **overrides):
    strategy = {"use_gpu": True, **overrides.pop("strategy", {})}
    return make_config(tiny_models["llama"], out, strategy=strategy, **overrides)


@pytest.fixture(scope="module")
def single_gpu_full(tiny_models, tmp_path_factory):
    cfg = cuda_config(tiny_models, tmp_path_factory.mktemp("single-gpu"), method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3})
    return cfg, train_without_ray(cfg)


def test_lora_bf16_on_one_gpu(tiny_models, tmp_path):
    cfg = cuda_config(tiny_models, tmp_path, hyperparameters={"max_steps": 30})
    result = train_without_ray(cfg)
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]
    steps = metrics(cfg)
    assert all(r.peak_memory_gib > 0 for r in steps)
    assert (Path(result["export"]["adapter"]) / "adapter_model.safetensors").exists()


def test_qlora_on_one_gpu_learns_and_its_merged_bf16_export_computes_what_the_adapter_does(tiny_models, tmp_path):
    """bitsandbytes' CUDA kernels (the CPU tests run its CPU backend): the 4-bit base quantized as it loads on
    the GPU, compiled blocks and all; the merged export is bf16 here, so the logits agree to bf16's rounding of
    the merged weights (on the tiny Llama, whose weights are drawn 10x wider than a real model's: 10.3% of their
    spread at the worst of the 8 x vocabulary logits on an H100, 2026-12-05, where 10% had been guessed; the
    CPU test holds the fp32 export to 1e-4)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tunewright_jobs.model import nf4_config

    cfg = cuda_config(tiny_models, tmp_path, method={"lora": {"quantization": "nf4"}},
                      hyperparameters={"max_steps": 30}, checkpoint={"export_merged": True})
    result = train_without_ray(cfg)
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]
    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], quantization_config=nf4_config(torch.bfloat16),
                                                device_map={"": "cuda"}, dtype=torch.bfloat16)
    adapter = PeftModel.from_pretrained(base, result["export"]["adapter"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(result["export"]["merged"], device_map={"": "cuda"}).eval()
    assert merged.dtype == torch.bfloat16
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]], device="cuda")
    with torch.no_grad():
        want, got = adapter(ids).logits.float(), merged(ids).logits.float()
    assert (got - want).abs().max() < 0.15 * want.std()


def test_full_with_bf16_state_learns_as_fp32_masters_do(tiny_models, tmp_path, single_gpu_full):
    """`optimizer_state: bf16` on CUDA: bf16 weights and moments, stochastic rounding on the GPU's generator."""
    reference, _ = single_gpu_full
    cfg = cuda_config(tiny_models, tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3, "optimizer_state": "bf16"})
    result = train_without_ray(cfg)
    assert metrics(cfg)[0].loss == pytest.approx(metrics(reference)[0].loss, rel=1e-2)  # bf16 compute either way
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_fp8_products_train_as_bf16_does(tiny_models, tmp_path, method, caplog):
    """`strategy.precision: fp8` on the GPU's FP8 tensor cores (skipped below compute capability 8.9), its blocks
    compiled (the default); LoRA's frozen base kept as its casts, every block linear of it."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")
    runs = {}
    for precision in ("bf16", "fp8"):
        cfg = cuda_config(tiny_models, tmp_path / precision, method={"type": method},
                          hyperparameters={"max_steps": 30, "learning_rate": 2e-3 if method == "full" else 5e-3},
                          strategy={"precision": precision})
        with caplog.at_level(logging.INFO, logger="tunewright_jobs.train"):
            result = train_without_ray(cfg)
        runs[precision] = (metrics(cfg), result)
    (kept,) = [int(m.split()[1]) for m in caplog.messages if "frozen weights kept as their FP8 casts" in m]
    assert kept == (7 * AutoConfig.from_pretrained(tiny_models["llama"]).num_hidden_layers if method == "lora" else 0)
    (bf16_steps, bf16), (fp8_steps, fp8) = runs["bf16"], runs["fp8"]
    for result in (bf16, fp8):
        assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]
    assert fp8_steps[0].loss == pytest.approx(bf16_steps[0].loss, rel=0.05)  # the kit's wide weights: see test_fp8


def test_full_on_one_gpu(single_gpu_full):
    _, result = single_gpu_full
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"]


def test_cpu_offload_trains_like_the_gpu_resident_run(tiny_models, tmp_path, single_gpu_full):
    reference, _ = single_gpu_full
    cfg = cuda_config(tiny_models, tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3}, strategy={"cpu_offload": True})
    result = train_without_ray(cfg)
    got, want = metrics(cfg), metrics(reference)
    assert got[0].loss == pytest.approx(want[0].loss, rel=1e-2), (got[0], want[0])
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"], result


def test_dpo_full_offloaded_starts_at_its_bf16_reference_and_trains(tiny_models, tmp_path):
    """Full fine-tuning's DPO reference offloaded beside the policy (FSDP2 on one GPU, CPUOffloadPolicy), stored in
    bf16 as the planner counts it: the policy starts as its reference (loss log 2, within the rounding of bf16
    kernels: 0.7035 on an H100, 2026-12-07, the same to 7 digits with the reference stored in fp32) and the steps
    stay finite."""
    import math

    from tests.jobs.test_dpo import dpo_config, sentiment_pairs

    cfg = dpo_config(tiny_models["llama"], tmp_path, sentiment_pairs(32, seed=3, shape="openai"),
                     sentiment_pairs(8, seed=4, shape="text"), method={"type": "full"},
                     hyperparameters={"max_steps": 6, "learning_rate": 1e-4},
                     strategy={"use_gpu": True, "cpu_offload": True, "micro_batch_size": 2})
    train_without_ray(cfg)
    steps = metrics(cfg)
    assert len(steps) == 6 and steps[0].loss == pytest.approx(math.log(2), rel=0.03), steps[0]
    assert all(math.isfinite(s.loss) for s in steps)


def test_single_trains_as_fsdp2_on_a_mesh_of_one(tiny_models, tmp_path, single_gpu_full):
    """`single` (the plain module on fp32 masters, every fast path on) against FSDP2 on one GPU: the same
    curve within the run-to-run noise of CUDA's kernels."""
    reference, _ = single_gpu_full
    cfg = cuda_config(tiny_models, tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3}, strategy={"type": "fsdp"})
    train_without_ray(cfg)
    assert [r.loss for r in metrics(cfg)] == pytest.approx([r.loss for r in metrics(reference)], rel=2e-3)


def test_selective_checkpointing_on_one_gpu_holds_between_none_and_every_block(tiny_models, tmp_path):
    """bf16 full fine-tuning of the two-block Llama on micro-batches of 16k tokens, without validation (so
    that the training step's activations make the peak): checkpointing its 1st block only learns as the
    others do, and its peak memory lies between no checkpointing's and every block's."""
    runs = {}
    for name, strategy in (("none", {}), ("every", {"activation_checkpointing": True}),
                           ("every-other", {"activation_checkpointing": True, "activation_checkpointing_every": 2})):
        runs[name] = cuda_config(tiny_models, tmp_path / name, method={"type": "full"},
                                 dataset={"validation": None},
                                 hyperparameters={"max_steps": 20, "learning_rate": 2e-3, "seq_len": 512,
                                                  "global_batch_size": 32},
                                 strategy={"micro_batch_size": 32, **strategy})
        torch.cuda.reset_peak_memory_stats()  # the runs share this process: each its own peak
        train_without_ray(runs[name])
        losses = [r.loss for r in metrics(runs[name])]
        assert losses[-1] < 0.5 * losses[0], (name, losses)
        assert losses[0] == pytest.approx(metrics(runs["none"])[0].loss, rel=1e-2)
    peak = {name: metrics(cfg)[-1].peak_memory_gib for name, cfg in runs.items()}
    assert peak["every"] < peak["every-other"] < peak["none"], peak


def test_weights_kept_unsharded_until_backward_on_one_gpu(tiny_models, tmp_path, single_gpu_full):
    """FSDP2 on one GPU with reshard_after_forward false (its one shard is kept gathered either way: this
    runs the option, the two-GPU test below is where it changes what is gathered)."""
    reference, _ = single_gpu_full
    cfg = cuda_config(tiny_models, tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3},
                      strategy={"type": "fsdp", "reshard_after_forward": False})
    result = train_without_ray(cfg)
    assert result["eval_after"]["val_loss"] < 0.5 * result["eval_before"]["val_loss"], result
    assert metrics(cfg)[0].loss == pytest.approx(metrics(reference)[0].loss, rel=1e-2)


@pytest.mark.parametrize(("strategy", "reshard"), [("ddp", True), ("fsdp", True), ("hsdp", True), ("fsdp", False)])
def test_two_gpus_match_one(tiny_models, tmp_path, single_gpu_full, strategy, reshard):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    reference, _ = single_gpu_full
    shape = {"hsdp_shard_size": 1} if strategy == "hsdp" else {}
    cfg = cuda_config(tiny_models, tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 20, "learning_rate": 2e-3},
                      # two micro-batches per rank: the all-reduce across replicas waits for the second
                      strategy={"type": strategy, "num_workers": 2, "micro_batch_size": 1,
                                "reshard_after_forward": reshard, **shape})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m",
                           "tunewright_jobs.run", "--no-ray", "--config", str(write_config(tmp_path / "j.json", cfg))],
                          env={**os.environ, "PYTHONPATH": python_path()},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = metrics(cfg), metrics(reference)
    assert got[0].loss == pytest.approx(want[0].loss, rel=1e-2)  # bf16 compute
    assert got[-1].loss < 0.5 * got[0].loss
    (comm,) = metrics(cfg, "comm")  # NCCL kernels seen by the profiler on both ranks
    assert 0 < comm.comm_share_exposed <= comm.comm_share < 1


@pytest.mark.parametrize("kv_heads", [8, 2])  # plain and grouped-query attention
def test_varlen_attention_equals_attention_per_document(kv_heads):
    from tests.jobs.test_kernels import reference_varlen
    from tunewright_jobs import kernels

    kernels.register_varlen_attention()
    torch.manual_seed(0)
    offsets = torch.tensor([0, 300, 301, 1024, 1500, 2048], dtype=torch.int32, device="cuda")
    q = torch.randn(2048, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2048, kv_heads, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = kernels._VARLEN_CALL[0](q, k, v, offsets, 2048, 0.125)
    want = reference_varlen(q.double(), k.double(), v.double(), offsets, 2048, 0.125)
    assert torch.linalg.norm(got.double() - want) / torch.linalg.norm(want) < 1e-2  # bf16 operands


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_rows_of_one_document_take_causal_sdpa_and_equal_attention_per_document(kv_heads):
    """One document a row (row 1 then padding): causal SDPA over the rows (cuDNN's kernel on Hopper) gives
    every real token what attention bounded per document gives, and the varlen kernel is not called."""
    from tests.jobs.test_kernels import reference_varlen
    from tunewright_jobs import kernels

    kernels.register_varlen_attention()
    torch.manual_seed(0)
    b, s, heads = 4, 1024, 8
    positions = np.tile(np.arange(s), (b, 1))
    positions[1, 900:] = np.arange(s - 900)
    real = np.array([s, 900, s, s])
    inputs = kernels.varlen_inputs(positions, real, torch.device("cuda"))
    assert inputs[kernels.ONE_DOCUMENT_ROWS]
    q = torch.randn(b, heads, s, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv_heads, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, _ = kernels.varlen_attention(None, q, k, v, None, scaling=0.125, **inputs)
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], 64).double() for x in (q, k, v)]
    want = reference_varlen(*flat, inputs["cu_seq_lens_q"], s, 0.125).view(b, s, heads, 64)
    real_tokens = torch.as_tensor(np.arange(s)[None, :] < real[:, None], device="cuda")
    assert torch.linalg.norm(got.double()[real_tokens] - want[real_tokens]) / torch.linalg.norm(want[real_tokens]) < 1e-2


def test_the_fast_paths_follow_the_plain_runs_curve(tiny_models, tmp_path):
    """varlen attention, the fused loss and compiled blocks (auto on CUDA) against all three off: the same
    packed data and seed, the same losses within bf16 noise."""
    curves = {}
    for name, overrides in {"fast": {}, "plain": {"kernels": {"fused_loss": "off", "compile": "off"},
                                                  "model": {"attn_implementation": "sdpa"}}}.items():
        cfg = cuda_config(tiny_models, tmp_path / name, method={"type": "full"},
                          hyperparameters={"max_steps": 12, "learning_rate": 2e-3}, **overrides)
        train_without_ray(cfg)
        curves[name] = [r.loss for r in metrics(cfg)]
    assert curves["fast"][-1] < 0.7 * curves["fast"][0]
    assert curves["fast"] == pytest.approx(curves["plain"], rel=3e-2)
