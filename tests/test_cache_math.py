"""Coarsening, KL and the cache's choice of rollouts and positions."""

import math

import numpy as np
import pytest
import torch
from precision import U32, kl_error, sum_error

from fedopd.distill.cache import cache_positions, choose_cache_rollouts, coarsen, kl, union_top_k

# coarsen in fp32: the kept entries are copies (exact); the tail 1 − Σ_k kept is a sum of k + 1
# terms of magnitude ≤ 1 (sum_error(k + 1)); the expected literals are rounded to fp32 (u each).


def test_coarsen_keeps_probabilities_at_ids_and_adds_unrenormalized_tail():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    out = coarsen(probs, torch.tensor([3, 0]))
    torch.testing.assert_close(out, torch.tensor([0.1, 0.5, 0.4]), rtol=0, atol=sum_error(3) + U32)


def test_coarsen_padding_contributes_zero_and_is_not_in_the_tail_sum():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.0, 0.0, 1.0, 0.0, 0.0]])
    ids = torch.tensor([[1, -1, -1], [2, 4, -1]])
    out = coarsen(probs, ids)
    expected = torch.tensor([[0.2, 0.0, 0.0, 0.8], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=sum_error(4) + U32)
    assert out.shape == (2, 4)


def test_coarsen_tail_is_clamped_at_zero():
    probs = torch.tensor([0.6, 0.4 + 1e-6])  # sums to slightly more than 1
    out = coarsen(probs, torch.tensor([0, 1]))
    assert out[-1].item() == 0.0


def test_kl_matches_hand_computation():
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.25, 0.75])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    # fp32 KL of exactly representable inputs: precision.kl_error (≈ 8u·Σ|p log p| + |p log q|).
    assert kl(p, q).item() == pytest.approx(expected, abs=kl_error(p, q).item())


def test_kl_uses_zero_log_zero_and_is_infinite_where_q_vanishes():
    p, q = torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5])
    assert kl(p, q).item() == pytest.approx(math.log(2.0), abs=kl_error(p, q).item())
    assert kl(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])).item() == math.inf
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    assert torch.equal(kl(p, p), torch.zeros(2))  # the same fp32 terms subtracted: exactly 0


def test_coarsened_kl_lower_bounds_full_kl():
    # Paper eq. (tail identity): KL(p||q) = KL(p~||q~) + p_T KL(p(.|T) || q(.|T)) >= KL(p~||q~).
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, 100, generator=gen), -1)
    q = torch.softmax(torch.randn(50, 100, generator=gen), -1)
    ids = union_top_k(p, q, 4)
    cp, cq = coarsen(p, ids), coarsen(q, ids)
    # Both sides are fp32 KLs, so the inequality holds up to their rounding (precision.kl_error);
    # the coarsened tails 1 − Σ (9 terms) carry sum_error(9) of absolute error, relative to the
    # smallest tail an input error of the coarsened KL (the kept entries are exact copies).
    tail_rel = sum_error(ids.shape[-1] + 1) / float(torch.minimum(cp[:, -1], cq[:, -1]).min())
    slack = kl_error(cp, cq, inputs_rel=tail_rel) + kl_error(p, q)
    assert torch.all(kl(cp, cq) <= kl(p, q) + slack)


def test_union_top_k_pads_duplicates_at_the_end():
    first = torch.tensor([0.0, 9.0, 8.0, 1.0, 0.5])  # top-2: ids 1, 2
    second = torch.tensor([7.0, 0.0, 9.0, 0.1, 0.2])  # top-2: ids 2, 0
    assert union_top_k(first, second, 2).tolist() == [0, 1, 2, -1]


def test_cache_positions_are_evenly_spaced_and_at_most_the_maximum():
    pos = cache_positions(151, 16)
    assert len(pos) == 16
    assert pos[0] == 0 and pos[-1] == 150
    assert np.all(np.abs(np.diff(pos) - 10) <= 1)  # 150 / 15 = 10 apart
    assert cache_positions(5, 16).tolist() == [0, 1, 2, 3, 4]
    assert cache_positions(0, 16).tolist() == []
    assert np.array_equal(cache_positions(151, 16), pos)  # no randomness


def test_cache_rollouts_are_distinct_and_deterministic_in_the_seed():
    a = choose_cache_rollouts(32, 4, seed=7)
    assert len(set(a.tolist())) == 4 and a.min() >= 0 and a.max() < 32
    assert np.array_equal(a, choose_cache_rollouts(32, 4, seed=7))
    draws = {tuple(choose_cache_rollouts(32, 4, seed=s)) for s in range(10)}
    assert len(draws) > 1
    assert choose_cache_rollouts(3, 4, seed=0).tolist() == [0, 1, 2]
