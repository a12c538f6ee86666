"""Candidate scores Ĵ_i(a), K̂_i(a) and their rounding rules (paper eq. for Ĵ, K̂).

Expected values are written out by hand (``_kl`` below is an independent float64 reference).
"""

import math

import numpy as np
import pytest
import torch
from precision import U64, kl_error, logsumexp_error, sum_error

from fedopd.distill.cache import ScoringCache, candidate_scores, coarsen, coarsen_logits, kl

Q = [0.7, 0.2, 0.1]  # q̃: the teacher, coarsened
P0 = [0.5, 0.3, 0.2]  # π̃_t: the starting student
PA = [0.2, 0.5, 0.3]  # π̃_{t,a}: a candidate


def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _tol(*pairs):
    """Float64 error of the mean over ``pairs`` of kl(p, q), plus that of the reference ``_kl``.

    precision.kl_error with u = 2^-53 for each side (the reference's log(p/q) rounds p/q and the
    log: at most the same count of roundings as xlogy's two logs), then the mean (sum_error).
    """
    per = [2 * kl_error(torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), u=U64).item() for p, q in pairs]
    return sum(per) / len(per) + sum_error(len(pairs) + 1, U64) * sum(_kl(p, q) for p, q in pairs) / len(pairs)


def _cache(teacher, student):
    n = len(teacher)
    return ScoringCache(
        input_ids=np.zeros((1, 4), np.int64),
        attention_mask=np.ones((1, 4), np.int64),
        positions=np.array([[0, i] for i in range(n)], np.int64),
        token_ids=np.zeros((n, 2), np.int64),
        teacher=np.asarray(teacher, np.float64),
        student=np.asarray(student, np.float64),
    )


def test_teacher_score_is_kl_from_teacher_to_candidate_not_the_reverse():
    j, _ = candidate_scores(_cache([Q], [P0]), torch.tensor([PA], dtype=torch.float64))
    assert _kl(Q, PA) != pytest.approx(_kl(PA, Q), rel=0.05)  # the two directions differ here (by far more than rounding)
    assert j == pytest.approx(_kl(Q, PA), abs=_tol((Q, PA)))


def test_change_score_is_kl_from_starting_student_to_candidate_not_the_reverse():
    _, k = candidate_scores(_cache([Q], [P0]), torch.tensor([PA], dtype=torch.float64))
    assert _kl(P0, PA) != pytest.approx(_kl(PA, P0), rel=0.05)
    assert k == pytest.approx(_kl(P0, PA), abs=_tol((P0, PA)))


def test_scores_are_the_mean_over_cached_positions():
    q2, p2, a2 = [0.1, 0.1, 0.8], [0.3, 0.3, 0.4], [0.25, 0.25, 0.5]
    j, k = candidate_scores(_cache([Q, q2], [P0, p2]), torch.tensor([PA, a2], dtype=torch.float64))
    assert j == pytest.approx((_kl(Q, PA) + _kl(q2, a2)) / 2, abs=_tol((Q, PA), (q2, a2)))
    assert k == pytest.approx((_kl(P0, PA) + _kl(p2, a2)) / 2, abs=_tol((P0, PA), (p2, a2)))


def test_teacher_score_at_start_is_kl_from_teacher_to_starting_student():
    assert _cache([Q], [P0]).teacher_score_at_start() == pytest.approx(_kl(Q, P0), abs=_tol((Q, P0)))


def test_kl_rounding_negatives_are_clamped_to_zero():
    # Coarsened rows sum to 1 only up to rounding: a q heavier by 1e-7 gives a raw KL of about -5e-8.
    p, q = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.5, 0.5000001], dtype=torch.float64)
    raw = 0.5 * math.log(0.5 / 0.5000001)
    assert raw < 0
    assert kl(p, q).item() == 0.0
    j, k = candidate_scores(_cache([[0.5, 0.5]], [[0.5, 0.5]]), q[None])
    assert j == 0.0 and k == 0.0


def test_coarsening_from_logits_equals_coarsening_the_full_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    ids = torch.tensor([[1, 3, -1], [4, -1, -1]])
    p = torch.softmax(logits.double(), -1)
    # By hand: retained probabilities at the ids (0 at padding) and the unrenormalized tail.
    expected = torch.stack(
        [
            torch.stack([p[0, 1], p[0, 3], torch.tensor(0.0, dtype=torch.float64), 1 - p[0, 1] - p[0, 3]]),
            torch.tensor([0.2, 0.0, 0.0, 0.8], dtype=torch.float64),
        ]
    )
    out = coarsen_logits(logits, ids)
    assert out.dtype == torch.float64
    # coarsen_logits: exp(z − T) in float64 with T the fp32 logsumexp (error ε), the tail
    # exp(O − T) with O fp32 too: |Δ log| ≤ ε (kept), 2ε (tail); probabilities ≤ 1.
    eps = logsumexp_error(5, 3.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=2 * eps)
    # coarsen in float64: the tail 1 − Σ of 3 terms against the reference's 1 − p1 − p3 (and
    # softmax(0)·5 = 1/5 rounded): sum_error(4) each way.
    torch.testing.assert_close(coarsen(p, ids), expected, rtol=0, atol=2 * sum_error(4, U64))


def test_the_tail_from_logits_stays_positive_where_one_minus_the_sum_rounds_to_zero():
    # The retained token has probability 1 - 1e-12: in fp32, 1 - Σ is exactly 0 and a KL against
    # that tail would be infinite; the tail from the logits keeps its true value.
    logits = torch.tensor([[0.0, -30.0, -30.0]])
    ids = torch.tensor([[0]])
    tail = coarsen_logits(logits, ids)[0, 1].item()
    # exp(O − T): O and T fp32 logsumexps (over 2 and 3 logits, |z| ≤ 30), each off by ε in log.
    assert tail == pytest.approx(2 * math.exp(-30.0), rel=math.expm1(logsumexp_error(2, 30.0) + logsumexp_error(3, 30.0)))
    assert coarsen(torch.softmax(logits, -1), ids)[0, 1].item() == 0.0  # what fp32 1 − Σ gives
