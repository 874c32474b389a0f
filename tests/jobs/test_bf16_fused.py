"""Bf16AdamW's fused update (one Triton kernel, what runs on a GPU), run here in Triton's interpreter: each stored
value is one of the two bf16 neighbours of the eager update's exact fp32 value; the rounding is unbiased, so small
updates accumulate; the bits are a function of (seed, step, parameter, element), so replicas and resumed runs agree;
a NaN stays a NaN; the optimizer takes the fused path where it is asked to and the eager one elsewhere."""

import pytest
import torch

from tunewright_jobs.bf16_adamw import Bf16AdamW

triton = pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def fused():
    """The kernel module: compiled on a GPU; here, in Triton's interpreter (on CPU tensors, in numpy), which the
    root conftest asks for before anything imports Triton."""
    from tunewright_jobs import bf16_adamw_fused

    interpreted = type(bf16_adamw_fused._adamw_kernel).__name__ == "InterpretedFunction"
    assert interpreted or DEVICE == "cuda", "Triton was imported before TRITON_INTERPRET was set"
    return bf16_adamw_fused


def exact_step(weight, grad, exp_avg, exp_avg_sq, step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, decay=0.1):
    """torch's AdamW step in fp64 from the bf16 values: what the stored values round."""
    w, g, m, v = (t.double() for t in (weight, grad, exp_avg, exp_avg_sq))
    m = m * betas[0] + g * (1 - betas[0])
    v = v * betas[1] + g * g * (1 - betas[1])
    w = w * (1 - lr * decay) - lr / (1 - betas[0] ** step) * m / ((v / (1 - betas[1] ** step)).sqrt() + eps)
    return w, m, v


def bf16_neighbours(exact: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Whether each stored value is the bf16 at or just below / above `exact` (fp32 arithmetic's error allowed)."""
    gap = exact.abs() * 2.0 ** -7 + 1e-30
    return (stored.double() - exact).abs() <= gap * (1 + 1e-3)


def state(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight, grad = (torch.randn(n, generator=generator).bfloat16() for _ in range(2))
    exp_avg = (torch.randn(n, generator=generator) * 0.1).bfloat16()
    exp_avg_sq = (torch.rand(n, generator=generator) * 0.01).bfloat16()
    return [t.to(DEVICE) for t in (weight, grad, exp_avg, exp_avg_sq)]


def update(fused, tensors, step, seed, lr=1e-2, decay=0.1):
    fused.adamw_update_(*tensors, step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=decay, seed=seed)


def test_each_stored_value_is_a_neighbour_of_the_exact_step(fused):
    tensors = state(5000)
    exact = exact_step(*tensors, step=3)
    update(fused, tensors, step=3, seed=12345)
    weight, _, exp_avg, exp_avg_sq = tensors
    for want, got in zip(exact, (weight, exp_avg, exp_avg_sq), strict=True):
        assert bf16_neighbours(want, got).all()
    assert (weight.double() != exact[0]).any()  # it did round: not all values were bf16 already


def test_small_updates_accumulate_where_rounding_to_nearest_drops_them(fused):
    """A weight of 1 (bf16 spacing 2^-8 just below), 300 steps of lr 1e-4 with a constant gradient: AdamW moves
    it by lr each step (3e-2 in all, give or take the rounding's noise, ~3e-4 on the mean); rounded to nearest
    it would never move."""
    weight = torch.ones(1024, dtype=torch.bfloat16, device=DEVICE)
    grad = torch.ones_like(weight)
    exp_avg, exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
    for step in range(1, 301):
        update(fused, (weight, grad, exp_avg, exp_avg_sq), step=step, seed=step, lr=1e-4, decay=0.0)
    assert weight.float().mean().item() == pytest.approx(1 - 300 * 1e-4, abs=2e-3)


def test_the_same_seed_draws_the_same_bits_and_another_does_not(fused):
    first, again, other = state(3000), state(3000), state(3000)
    update(fused, first, step=1, seed=99)
    update(fused, again, step=1, seed=99)
    update(fused, other, step=1, seed=100)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


def test_a_nan_stays_a_nan(fused):
    weight, grad, exp_avg, exp_avg_sq = state(64)
    grad[5] = float("nan")
    update(fused, (weight, grad, exp_avg, exp_avg_sq), step=1, seed=1)
    assert weight[5].isnan() and exp_avg[5].isnan() and exp_avg_sq[5].isnan()
    assert not weight[:5].isnan().any()


def test_the_optimizer_takes_the_fused_path_when_asked_and_matches_the_eager_one(fused):
    torch.manual_seed(0)
    weights, gradient = torch.randn(64, 48), torch.randn(64, 48)
    paths = {}
    for name, use_fused in (("fused", True), ("eager", False)):
        p = torch.nn.Parameter(weights.bfloat16().to(DEVICE))
        p.grad = gradient.bfloat16().to(DEVICE)
        optimizer = Bf16AdamW([p], lr=1e-2, weight_decay=0.1, seed=7, fused=use_fused)
        optimizer.step()
        paths[name] = (p.detach().cpu(), optimizer.state[p]["exp_avg"].cpu())
    exact_weight, exact_avg, _ = exact_step(weights.bfloat16(), gradient.bfloat16(), torch.zeros(64, 48),
                                            torch.zeros(64, 48), step=1)
    for weight, exp_avg in paths.values():
        assert bf16_neighbours(exact_weight, weight).all() and bf16_neighbours(exact_avg, exp_avg).all()
    assert not torch.equal(paths["fused"][0], paths["eager"][0])  # two generators: each unbiased, not the same bits
    on_cpu = torch.zeros(2, dtype=torch.bfloat16)
    assert Bf16AdamW([torch.nn.Parameter(on_cpu)], lr=1e-3)._kernel_for(on_cpu) is None  # by default: CUDA only
    assert Bf16AdamW([torch.nn.Parameter(on_cpu)], lr=1e-3, fused=True)._kernel_for(on_cpu) is fused
    huge = torch.empty(2**31, dtype=torch.bfloat16, device="meta")  # past the kernel's 32-bit index: eager
    assert Bf16AdamW([torch.nn.Parameter(on_cpu)], lr=1e-3, fused=True)._kernel_for(huge) is None
    columns = torch.zeros(4, 8, dtype=torch.bfloat16)[:, :4]  # strided: the kernel would walk past it
    assert Bf16AdamW([torch.nn.Parameter(columns)], lr=1e-3, fused=True)._kernel_for(columns) is None
