"""The inequalities behind the bf16 bounds of tests/precision.py, on random instances in float64:
they hold, and the second-order one is tight where the logit shift points along the head rows'
widest spread under p (so it is no looser than it has to be)."""

import math

import pytest
import torch
from precision import bennett, head_spread, kl_change_from_logit_shift, logit_shift_e_max, logit_shift_kl

from fedopd.distill.cache import coarsen, kl

V, H = 40, 6


def _instance(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 2.0
    return g, rows, logits


def _shift(g, rows, dh, r):
    """e = W·Δh + Δr with ||Δh|| = dh (a random direction) and |Δr_v| ≤ r."""
    direction = torch.randn(H, generator=g, dtype=torch.float64)
    dr = (torch.rand(V, generator=g, dtype=torch.float64) * 2 - 1) * r
    return rows @ (direction / direction.norm() * dh) + dr


def test_bennett_factor_bounds_the_exponential_below_its_cap():
    for b in (1e-6, 0.1, 1.0, 3.0):
        x = torch.linspace(-10, b, 2001, dtype=torch.float64)
        assert torch.all(torch.exp(x) <= 1 + x + bennett(b) * x**2 + 1e-12)
    assert bennett(1e-9) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dh, r", [(0.05, 0.0), (0.5, 1e-3), (2.0, 1e-2)])
def test_logit_shift_kl_bounds_the_kl_of_any_shift_of_that_size(seed, dh, r):
    g, rows, logits = _instance(seed)
    p = torch.softmax(logits, -1)
    bound = logit_shift_kl(p, rows, dh, r).item()
    for _ in range(50):
        q = torch.softmax(logits + _shift(g, rows, dh, r), -1)
        assert kl(p, q).item() <= bound


@pytest.mark.parametrize("seed", range(5))
def test_logit_shift_kl_is_tight_along_the_widest_spread(seed):
    _, rows, logits = _instance(seed)
    p = torch.softmax(logits, -1)
    mean = p @ rows
    cov = torch.einsum("v,vi,vj->ij", p, rows, rows) - torch.outer(mean, mean)
    top = torch.linalg.eigh(cov).eigenvectors[:, -1]
    dh = 0.05
    q = torch.softmax(logits + rows @ (top * dh), -1)
    bound = logit_shift_kl(p, rows, dh, 0.0).item()
    assert head_spread(p, rows).item() ** 2 == pytest.approx(float(top @ cov @ top))
    assert 0.8 * bound <= kl(p, q).item() <= bound  # KL ≈ Var/2, the bound ψ(b)·Var with ψ ≈ 1/2


@pytest.mark.parametrize("seed", range(5))
def test_coarsening_cannot_increase_the_kl(seed):
    g, rows, logits = _instance(seed)
    p, q = torch.softmax(logits, -1), torch.softmax(logits + _shift(g, rows, 1.0, 0.0), -1)
    ids = torch.tensor([3, 7, 11, -1])
    assert kl(coarsen(p, ids), coarsen(q, ids)).item() <= kl(p, q).item()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dh, r", [(0.05, 0.0), (0.5, 1e-3), (2.0, 1e-2)])
def test_kl_change_from_logit_shift_bounds_the_change_of_a_score(seed, dh, r):
    """|KL(p̃ ‖ q̃₁) − KL(p̃ ‖ q̃₂)| for a fixed cached row p̃ and a candidate evaluated twice."""
    g, rows, logits = _instance(seed)
    q = torch.softmax(logits, -1)
    cached = torch.softmax(logits + torch.randn(V, generator=g, dtype=torch.float64), -1)
    ids = torch.tensor([[2, 5, 9, 13, 21, -1]])
    p_coarse, q_coarse = coarsen(cached[None], ids), coarsen(q[None], ids)
    bound = kl_change_from_logit_shift(p_coarse, q_coarse, q[None], ids, rows, dh, r).item()
    assert bound < 0.5 * kl(p_coarse, q_coarse).item() or dh > 0.1  # not trivial at a small shift
    worst = 0.0
    for _ in range(50):
        q2 = coarsen(torch.softmax(logits + _shift(g, rows, dh, r), -1)[None], ids)
        worst = max(worst, abs(kl(p_coarse, q_coarse).item() - kl(p_coarse, q2).item()))
    assert worst <= bound
    assert logit_shift_e_max(rows, dh, r) == pytest.approx(float(rows.norm(dim=-1).max()) * dh + r)
    assert math.isfinite(bound)
