"""Two memory layouts on the CPU: selective (layer-level) activation checkpointing, and FSDP2 keeping each
block's gathered weights from its forward to its backward (`reshard_after_forward: false`). Neither may
change a number: only what is held, recomputed and gathered."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.jobs.conftest import base_config, make_config, metrics
from tests.jobs.test_distributed import run_torchrun
from tunewright_jobs.config import ConfigError, JobConfig
from tunewright_jobs.model import load_model, transformer_blocks
from tunewright_jobs.parallel import Dist, shard_model
from tunewright_jobs.run import train_without_ray

BLOCKS = 4


@pytest.fixture(scope="module")
def llama_of_four_blocks(tiny_models, tmp_path_factory) -> Path:
    """The tiny Llama with four blocks, so that every other one is two of them."""
    out = tmp_path_factory.mktemp("llama-4-blocks")
    config = AutoConfig.from_pretrained(tiny_models["llama"])
    config.num_hidden_layers = BLOCKS
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_models["llama"]).save_pretrained(out)
    return out


# --- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "named"), [
    ({"activation_checkpointing": True, "activation_checkpointing_every": 0},
     ["strategy.activation_checkpointing_every: Input should be greater than 0"]),
    ({"activation_checkpointing_every": 2},
     ["strategy: activation_checkpointing_every: 2", "activation_checkpointing: true"]),
    ({"reshard_after_forward": False}, ["strategy: reshard_after_forward: false", "strategy fsdp or hsdp"]),
    ({"type": "ddp", "num_workers": 2, "micro_batch_size": 2, "reshard_after_forward": False},
     ["strategy: reshard_after_forward: false", "strategy ddp"]),
])
def test_refusals_name_the_field_and_the_fix(tmp_path, strategy, named):
    with pytest.raises(ConfigError) as err:
        make_config(tmp_path, tmp_path, strategy=strategy)
    for words in named:
        assert words in str(err.value)


@pytest.mark.parametrize("strategy", [
    {"activation_checkpointing": True, "activation_checkpointing_every": 2},
    {"type": "fsdp", "num_workers": 2, "micro_batch_size": 2, "reshard_after_forward": False},
    {"type": "hsdp", "num_workers": 4, "hsdp_shard_size": 2, "micro_batch_size": 1, "reshard_after_forward": False},
])
def test_accepted_layouts_round_trip(tmp_path, strategy):
    cfg = make_config(tmp_path, tmp_path, strategy=strategy)
    assert JobConfig.from_json(cfg.to_json()) == cfg
    defaults = JobConfig.from_dict(base_config(tmp_path, tmp_path)).strategy
    assert (defaults.activation_checkpointing_every, defaults.reshard_after_forward) == (1, True)


# --- selective activation checkpointing -----------------------------------------------------------------


def forward_calls_per_block(cfg) -> list[int]:
    """How often each block's MLP is entered in one training forward and backward: twice where the block is
    checkpointed (recomputed in backward: the MLP sits inside the block, under the checkpoint), once where
    it is not. Entered, not left: the recomputation stops once it has what backward needs."""
    model = load_model(cfg).train()
    calls = [0] * BLOCKS
    for index, block in enumerate(transformer_blocks(model)):
        block.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    return calls


@pytest.mark.parametrize(("checkpointing", "every", "calls"), [
    (False, 1, [1, 1, 1, 1]),
    (True, 1, [2, 2, 2, 2]),
    (True, 2, [2, 1, 2, 1]),  # the 1st and 3rd: the last block, recomputed first in backward, is kept
    (True, 3, [2, 1, 1, 2]),
])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_selective_checkpointing_recomputes_one_block_in_every_n(llama_of_four_blocks, tmp_path, checkpointing,
                                                                  every, calls, method):
    cfg = make_config(llama_of_four_blocks, tmp_path, method={"type": method},
                      strategy={"activation_checkpointing": checkpointing, "activation_checkpointing_every": every})
    assert forward_calls_per_block(cfg) == calls


@pytest.mark.slow
def test_checkpointing_every_block_or_every_other_trains_as_without(llama_of_four_blocks, tmp_path):
    """Recomputing a block's forward gives its activations bit for bit: the same losses and gradient norms
    over steps of two accumulated micro-batches, whichever blocks are checkpointed."""
    runs = {}
    for name, strategy in {"none": {}, "every": {"activation_checkpointing": True},
                           "every-other": {"activation_checkpointing": True, "activation_checkpointing_every": 2}
                           }.items():
        cfg = make_config(llama_of_four_blocks, tmp_path / name, method={"type": "full"},
                          hyperparameters={"max_steps": 3, "learning_rate": 1e-3},
                          strategy={"micro_batch_size": 2, **strategy}, eval={"max_batches": 1})
        train_without_ray(cfg)
        runs[name] = [(r.loss, r.grad_norm) for r in metrics(cfg)]
    assert len(runs["none"]) == 3 and runs["none"][-1][0] < runs["none"][0][0]
    assert runs["every"] == runs["none"]
    assert runs["every-other"] == runs["none"]


# --- weights kept unsharded from forward to backward ----------------------------------------------------


def _gathered_blocks_after_forward(rank: int, store: str, model_dir: str, out: str, reshard: bool) -> None:
    """One of two gloo ranks: FSDP2 over the model, one forward, then which blocks' parameters are the
    gathered (plain) tensors and which the sharded DTensors; again after backward."""
    from torch.distributed.tensor import DTensor

    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = make_config(Path(model_dir), Path(out), method={"type": "full"},
                          strategy={"type": "fsdp", "num_workers": 2, "micro_batch_size": 1,
                                    "reshard_after_forward": reshard})
        model = load_model(cfg)
        blocks = transformer_blocks(model)  # found by class name, which sharding changes
        model = shard_model(cfg, model, Dist(rank, 2, 0, torch.device("cpu"))).train()
        gathered = lambda: [not any(isinstance(p, DTensor) for p in b.parameters()) for b in blocks]  # noqa: E731
        ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
        after_forward = gathered()
        loss.backward()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"forward": after_forward, "backward": gathered()}))
        # both ranks done before either tears gloo down: a rank that exits while its peer still holds the
        # connection once aborted the peer ("terminate called without an active exception", CI 2026-12-07)
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_keeps_blocks_gathered_from_forward_to_backward_only_when_asked(llama_of_four_blocks, tmp_path,
                                                                              reshard):
    fd, store = tempfile.mkstemp(prefix="tunewright-test-pg-")
    os.close(fd)
    mp.spawn(_gathered_blocks_after_forward, args=(store, str(llama_of_four_blocks), str(tmp_path), reshard),
             nprocs=2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["forward"] == [not reshard] * BLOCKS
        assert seen["backward"] == [False] * BLOCKS  # resharded after backward either way


@pytest.mark.slow
def test_fsdp_trains_the_same_with_blocks_kept_gathered(llama_of_four_blocks, tmp_path):
    """Two gloo ranks, two micro-batches a step: keeping the gathered weights changes no number."""
    runs = {}
    for reshard in (True, False):
        cfg = make_config(llama_of_four_blocks, tmp_path / str(reshard), method={"type": "full"},
                          hyperparameters={"max_steps": 3, "learning_rate": 1e-3},
                          strategy={"type": "fsdp", "num_workers": 2, "micro_batch_size": 1,
                                    "reshard_after_forward": reshard},
                          eval={"max_batches": 1}, metrics={"profile": {"enabled": False}})
        (tmp_path / str(reshard)).mkdir()
        run_torchrun(cfg, tmp_path / str(reshard), 2)
        runs[reshard] = [value for r in metrics(cfg) for value in (r.loss, r.grad_norm)]
    assert len(runs[True]) == 6 and runs[True][-2] < runs[True][0]
    assert runs[False] == pytest.approx(runs[True], rel=1e-6, abs=0)
