"""DDP, FSDP2 and HSDP on CPU (gloo), under Ray Train and under torchrun, checked against one process.

Every strategy must compute the same first step as a single process with the same global batch: the
same loss and the same gradient norm (the gradient averaged over ranks, scaled by the global token count).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.jobs.conftest import make_config, metrics, python_path, write_config
from tunewright_jobs.run import train_with_ray, train_without_ray
from tunewright_jobs.train import SLOW_RANK_ENV

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    import ray

    yield
    ray.shutdown()


def assert_same_first_step(cfg, reference):
    got, want = metrics(cfg)[0], metrics(reference)[0]
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    assert got.tokens == want.tokens  # tokens counted over the global batch, not one rank


def assert_measured_comm_share(cfg):
    """The profiled window (steps 3-4 by default) saw collectives on every rank, some of them exposed."""
    (record,) = metrics(cfg, "comm")
    assert record.step == 4 and record.profiled_steps == 2
    assert 0 < record.comm_share <= record.comm_share_max_rank <= 1
    assert 0 < record.comm_share_exposed <= record.comm_share
    assert record.comm_seconds_per_step < record.profiled_step_seconds
    assert record.wait_seconds_per_step + record.transfer_seconds_per_step == pytest.approx(
        record.comm_seconds_per_step)
    # (each rank times its own window: another rank's own time may exceed rank 0's step)
    assert 0 < record.rank_own_seconds_min <= record.rank_own_seconds_median <= record.rank_own_seconds_max
    return record


@pytest.fixture(scope="module")
def single_lora(tiny_models, tmp_path_factory):
    cfg = make_config(tiny_models["gpt2"], tmp_path_factory.mktemp("single-lora"), hyperparameters={"max_steps": 4})
    train_without_ray(cfg)
    (alone,) = metrics(cfg, "comm")  # one process: nothing to communicate
    assert alone.comm_share == alone.comm_share_exposed == 0
    return cfg


@pytest.fixture(scope="module")
def single_full(tiny_models, tmp_path_factory):
    cfg = make_config(tiny_models["llama"], tmp_path_factory.mktemp("single-full"), method={"type": "full"},
                      hyperparameters={"max_steps": 4, "learning_rate": 1e-3})
    train_without_ray(cfg)
    return cfg


def test_ray_ddp_lora(tiny_models, tmp_path, single_lora):
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 4},
                      strategy={"type": "ddp", "num_workers": 2, "micro_batch_size": 2})
    result = train_with_ray(cfg, max_failures=0)
    assert (result["strategy"], result["workers"]) == ("ddp", 2)
    assert_same_first_step(cfg, single_lora)
    assert_measured_comm_share(cfg)
    checkpoints = sorted(p.name for p in (Path(cfg.checkpoint_storage) / cfg.name).glob("step_*"))
    assert checkpoints == ["step_00000004"]
    base = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])
    PeftModel.from_pretrained(base, result["export"]["adapter"])


def test_ray_fsdp_full(tiny_models, tmp_path, single_full):
    cfg = make_config(tiny_models["llama"], tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 4, "learning_rate": 1e-3},
                      strategy={"type": "fsdp", "num_workers": 2, "micro_batch_size": 1},
                      checkpoint={"every_steps": 2})
    result = train_with_ray(cfg, max_failures=0)
    assert_same_first_step(cfg, single_full)
    assert AutoModelForCausalLM.from_pretrained(result["export"]["model"]).config.model_type == "llama"
    # The records say where Ray Train put each checkpoint, and its training loss (Ray keeps no metrics.json).
    checkpoints = metrics(cfg, "checkpoint")
    assert [c.step for c in checkpoints] == [2, 4]
    for record in checkpoints:
        assert math.isfinite(record.train_loss)
        assert (Path(record.uri) / "trainer_state.json").exists()


def test_ray_run_resumes_from_its_storage(tiny_models, tmp_path):
    """A new Ray cluster (as a RayJob retry gets) with the same name and storage continues the run."""
    first = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 4},
                        strategy={"type": "ddp", "num_workers": 2, "micro_batch_size": 2},
                        checkpoint={"every_steps": 2})
    train_with_ray(first, max_failures=0)
    longer = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 7},
                         strategy={"type": "ddp", "num_workers": 2, "micro_batch_size": 2},
                         checkpoint={"every_steps": 2})
    result = train_with_ray(longer, max_failures=0)
    assert result["resumed_from_step"] == 4
    assert [r.step for r in metrics(longer)] == list(range(1, 8))


def run_torchrun(cfg, tmp_path, nproc: int, **env_vars: str):
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           "-m", "tunewright_jobs.run", "--no-ray", "--config",
                           str(write_config(tmp_path / "job.json", cfg))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((Path(cfg.output_dir) / "result.json").read_text())


def test_torchrun_hsdp_two_groups_of_two(tiny_models, tmp_path, single_full):
    cfg = make_config(tiny_models["llama"], tmp_path, method={"type": "full"},
                      hyperparameters={"max_steps": 4, "learning_rate": 1e-3},
                      strategy={"type": "hsdp", "num_workers": 4, "hsdp_shard_size": 2, "micro_batch_size": 1},
                      checkpoint={"every_steps": 2})
    result = run_torchrun(cfg, tmp_path, 4)
    assert (result["strategy"], result["workers"]) == ("hsdp", 4)
    assert_same_first_step(cfg, single_full)
    assert_measured_comm_share(cfg)


def test_torchrun_fsdp_lora_with_a_slow_rank(tiny_models, tmp_path, single_lora):
    """Rank 1 sleeps 0.4 s in every step (a synthetic straggler): the same numbers, and rank 0 is seen
    waiting for it in its collectives."""
    cfg = make_config(tiny_models["gpt2"], tmp_path, hyperparameters={"max_steps": 4},
                      strategy={"type": "fsdp", "num_workers": 2, "micro_batch_size": 2})
    result = run_torchrun(cfg, tmp_path, 2, **{SLOW_RANK_ENV: "1:0.4"})
    assert_same_first_step(cfg, single_lora)
    record = assert_measured_comm_share(cfg)
    assert record.slowest_rank == 1
    assert record.rank_own_seconds_max - record.rank_own_seconds_min > 0.3
    # rank 0 waits ~0.4 s and rank 1 hardly at all: the mean over the two ranks is ~0.2 s
    assert 0.15 < record.wait_seconds_per_step < 0.3
    base = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])
    PeftModel.from_pretrained(base, result["export"]["adapter"])
