"""Full fine-tuning with bf16 weights and moments (`optimizer_state: bf16`): the rounding is unbiased, so small
updates accumulate where rounding to nearest would drop them; a step is AdamW's to bf16's resolution; the tiny
Llama learns about as well as with fp32 masters; a resumed run continues exactly; the wrong uses are refused."""

import re
from pathlib import Path

import pytest
import torch

from tests.jobs.conftest import make_config, metrics
from tunewright_jobs.bf16_adamw import Bf16AdamW, stochastic_round_
from tunewright_jobs.config import ConfigError
from tunewright_jobs.run import train_without_ray


def rounded(value: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(value, dtype=torch.bfloat16)
    stochastic_round_(out, value.clone())
    return out


def test_rounding_lands_on_a_neighbour_as_often_as_the_value_is_near_it():
    torch.manual_seed(0)
    step = 2.0 ** -7  # bf16's spacing in [1, 2)
    for share in (0.1, 0.25, 0.5, 0.9):
        out = rounded(torch.full((100_000,), 1.0 + share * step))
        assert set(out.float().unique().tolist()) == {1.0, 1.0 + step}
        # the share that rounds up, within five standard errors
        assert (out.float() > 1.0).float().mean().item() == pytest.approx(share, abs=5 * (share * (1 - share) / 1e5) ** 0.5)
    values = torch.randn(100_000) * 100
    out = rounded(values).float()
    assert ((out - values).abs() <= values.abs() * 2.0 ** -7).all()  # one of the two neighbours, never further


def test_small_updates_accumulate_where_rounding_to_nearest_drops_them():
    """1,000 updates of 1e-4 on a weight of 1 (bf16 spacing 2^-7 there, 78 times larger): to nearest, the
    weight never moves; rounded stochastically it moves by 0.1 give or take the rounding's noise."""
    torch.manual_seed(0)
    nearest = torch.ones(4096, dtype=torch.bfloat16)
    stochastic = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(1000):
        nearest = (nearest.float() + 1e-4).bfloat16()
        stochastic_round_(stochastic, stochastic.float() + 1e-4)
    assert nearest.float().eq(1.0).all()
    assert stochastic.float().mean().item() == pytest.approx(1.1, abs=0.005)


def test_a_step_is_adamws_to_bf16s_resolution():
    torch.manual_seed(0)
    weights, gradient = torch.randn(256, 256), torch.randn(256, 256)
    ours = torch.nn.Parameter(weights.bfloat16())
    reference = torch.nn.Parameter(weights.bfloat16().float())
    ours.grad, reference.grad = gradient.bfloat16(), gradient.bfloat16().float()
    for optimizer in (Bf16AdamW([ours], lr=1e-2, weight_decay=0.1),
                      torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)):
        optimizer.step()
    spacing = reference.detach().abs() * 2.0 ** -7
    assert ((ours.float() - reference).abs() <= spacing + 1e-12).all()
    with pytest.raises(TypeError, match="steps bf16 parameters"):
        Bf16AdamW([reference], lr=1e-2).step()  # an fp32 parameter: the model was not loaded in bf16


def test_replicas_round_alike_whatever_their_own_generators_hold():
    """DDP and HSDP reseed each rank's generator apart (dropout): the rounding's bits come from (seed, step,
    parameter), so every replica of a weight steps to the same bf16 value."""
    weights, gradient = torch.randn(300, 70), torch.randn(300, 70)
    replicas = []
    for rank in range(2):
        torch.manual_seed(1000 + rank)
        p = torch.nn.Parameter(weights.bfloat16())
        optimizer = Bf16AdamW([p], lr=1e-3, seed=42)
        for _ in range(3):
            p.grad = gradient.bfloat16()
            optimizer.step()
        replicas.append(p.detach().clone())
    assert replicas[0].equal(replicas[1])


def test_a_tensor_larger_than_a_chunk_steps_as_one(monkeypatch):
    from tunewright_jobs import bf16_adamw

    weights, gradient = torch.randn(64, 64), torch.randn(64, 64)
    stepped = {}
    for chunk in (1 << 24, 1000):  # one piece, and five
        monkeypatch.setattr(bf16_adamw, "CHUNK_ELEMENTS", chunk)
        p = torch.nn.Parameter(weights.bfloat16())
        p.grad = gradient.bfloat16()
        Bf16AdamW([p], lr=1e-2, seed=1).step()
        stepped[chunk] = p.detach().float()
    spacing = torch.maximum(stepped[1000].abs(), stepped[1 << 24].abs()) * 2.0 ** -7
    assert ((stepped[1000] - stepped[1 << 24]).abs() <= spacing + 1e-12).all()  # a neighbour apart at most


def test_a_nan_stays_a_nan():
    value = torch.tensor([1.0, float("nan"), -2.5, float("inf")])
    assert rounded(value).float().isnan().tolist() == [False, True, False, False]


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict:
    out = {}
    for state in ("fp32", "bf16"):
        cfg = make_config(tiny_models["llama"], tmp_path_factory.mktemp(state), method={"type": "full"},
                          hyperparameters={"max_steps": 60, "learning_rate": 2e-3, "optimizer_state": state})
        out[state] = (cfg, train_without_ray(cfg))
    return out


def test_the_tiny_llama_learns_with_bf16_state_about_as_well_as_with_fp32_masters(runs):
    (fp32_cfg, fp32), (bf16_cfg, bf16) = runs["fp32"], runs["bf16"]
    for result in (fp32, bf16):
        assert result["eval_after"]["val_loss"] < 0.1 * result["eval_before"]["val_loss"]
    # measured: 0.28 (fp32 masters) and 0.25 (bf16) from 9.73, after 60 steps
    assert bf16["eval_after"]["val_loss"] < 1.5 * fp32["eval_after"]["val_loss"] + 0.05
    first = metrics(fp32_cfg)[0], metrics(bf16_cfg)[0]
    assert first[1].loss == pytest.approx(first[0].loss, rel=1e-2)  # bf16 compute either way


def test_the_export_is_bf16(runs):
    from safetensors import safe_open

    _, result = runs["bf16"]
    with safe_open(Path(result["export"]["model"]) / "model.safetensors", "pt") as exported:
        assert {exported.get_tensor(k).dtype for k in exported.keys()} == {torch.bfloat16}  # noqa: SIM118


def test_a_resumed_run_continues_exactly(tiny_models, tmp_path):
    def config(out: Path, steps: int, storage: Path):
        return make_config(tiny_models["llama"], out, method={"type": "full"},
                           hyperparameters={"max_steps": steps, "lr_schedule": "constant", "optimizer_state": "bf16"},
                           checkpoint={"storage": str(storage)}, eval={"max_batches": 1})
    train_without_ray(config(tmp_path / "first", 3, tmp_path / "ckpt"))
    resumed = config(tmp_path / "resumed", 6, tmp_path / "ckpt")
    assert train_without_ray(resumed)["resumed_from_step"] == 3
    straight = config(tmp_path / "straight", 6, tmp_path / "straight-ckpt")
    train_without_ray(straight)
    assert [r.loss for r in metrics(resumed)] == [r.loss for r in metrics(straight)][3:]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"method": {"type": "lora"}}, "hyperparameters.optimizer_state: bf16 is for full fine-tuning"),
    ({"method": {"type": "full"}, "strategy": {"precision": "fp32"}}, "strategy.precision: bf16 weights compute in bf16"),
])
def test_bf16_state_refuses_what_it_cannot_mean(tiny_models, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(tiny_models["llama"], tmp_path, hyperparameters={"optimizer_state": "bf16"}, **overrides)
