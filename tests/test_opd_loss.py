"""The reverse-KL loss, its chunked evaluation, the schedule and the optimizer state."""

import math

import numpy as np
import pytest
import torch
from precision import PAIR, U32, U64, gradient_error, sum_error, token_kl_error

from fedopd.config import TrainSettings
from fedopd.distill.opd import (
    cosine_lr,
    load_optimizer_state,
    make_optimizer,
    micro_batches,
    optimizer_state_to_arrays,
    reverse_kl,
    reverse_kl_sum_from_hidden,
    token_reverse_kl,
)


def _logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def test_token_reverse_kl_matches_brute_force_sum():
    s, t = _logits(7, 11, seed=1), _logits(7, 11, seed=2)
    p, q = torch.softmax(s.double(), -1), torch.softmax(t.double(), -1)
    brute = [sum(p[i, v] * math.log(p[i, v] / q[i, v]) for v in range(11)) for i in range(7)]
    # fp32 log-softmax and sum against a float64 reference on the same fp32 logits:
    # precision.token_kl_error per position (≈ 1e-6 here).
    error = (token_reverse_kl(s, t).double() - torch.tensor(brute, dtype=torch.float64)).abs()
    assert torch.all(error <= token_kl_error(s, t))


def test_reverse_kl_is_the_token_mean_over_the_mask():
    s, t = _logits(2, 5, 13, seed=3), _logits(2, 5, 13, seed=4)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    per_token = token_reverse_kl(s, t)
    expected = per_token[mask.bool()].mean()
    # Two fp32 evaluations of the same token KLs (their errors: token_kl_error), then a weighted sum
    # over the 10 positions / the mean of the 4 kept ones, and a division: sum_error(10) + u of
    # the (non-negative) sum, each way.
    tol = PAIR * (token_kl_error(s, t)[mask.bool()].mean().item() + (sum_error(10) + U32) * expected.item())
    assert reverse_kl(s, t, mask).item() == pytest.approx(expected.item(), abs=tol)
    s2 = s.clone()
    s2[0, 0] += 100.0  # a masked-out position cannot change the loss
    assert reverse_kl(s2, t, mask).item() == pytest.approx(expected.item(), abs=tol)


def test_chunked_reverse_kl_equals_unchunked_in_value_and_gradient():
    t = _logits(3, 17, 29, seed=6)
    mask = (torch.rand(3, 17, generator=torch.Generator().manual_seed(7)) > 0.3).long()
    grads, values = [], []
    for chunk in (5, 10_000):
        s = _logits(3, 17, 29, seed=5).requires_grad_(True)
        loss = reverse_kl(s, t, mask, chunk_size=chunk)
        loss.backward()
        values.append(loss.item())
        grads.append(s.grad.clone())
    # The same token KLs summed in chunks of 5 rows or at once (51 non-negative terms): both within
    # sum_error(51) + u of the exact sum, the token KLs themselves within token_kl_error.
    s = _logits(3, 17, 29, seed=5)
    per_token = token_kl_error(s.reshape(-1, 29), t.reshape(-1, 29))
    tol = PAIR * (per_token.max().item() + (sum_error(51) + U32) * values[1])
    assert values[0] == pytest.approx(values[1], abs=tol)
    # The gradient p⊙(r − KL)·w/Σw per row: a log-softmax, the KL (a sum over V = 29) and the
    # log-softmax backward (another sum over V): ~3V + a few roundings (precision.gradient_error).
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=PAIR * gradient_error(grads[1], 3 * 29 + 8))
    assert grads[0].abs().sum() > 0


def test_chunked_loss_from_hidden_states_equals_loss_on_logits():
    gen = torch.Generator().manual_seed(8)
    hs = torch.randn(23, 6, generator=gen, requires_grad=True)
    ht = torch.randn(23, 9, generator=gen)
    ws, wt = torch.randn(31, 6, generator=gen), torch.randn(31, 9, generator=gen)
    total = reverse_kl_sum_from_hidden(hs, lambda h: h @ ws.T, ht, lambda h: h @ wt.T, chunk_size=4)
    total.backward()
    grad_chunked = hs.grad.clone()
    hs.grad = None
    reference = token_reverse_kl(hs @ ws.T, ht @ wt.T).sum()
    reference.backward()
    # The logits h @ wᵀ (sums of 6 and 9 terms, error ≤ sum_error·Σ|h||w|) shift each token KL by
    # at most 2·(that) per side (log-probabilities move by ≤ 2 max|Δz|), on top of token_kl_error;
    # then 23 non-negative terms summed in chunks of 4 or at once.
    with torch.no_grad():
        zs, zt = hs @ ws.T, ht @ wt.T
        dz = 2 * (sum_error(6) * (hs.abs() @ ws.abs().T).max() + sum_error(9) * (ht.abs() @ wt.abs().T).max()).item()
        per_token = token_kl_error(zs, zt) + 2 * dz
    tol = PAIR * (per_token.sum().item() + (sum_error(23) + U32) * reference.item())
    assert total.item() == pytest.approx(reference.item(), abs=tol)
    # The gradient adds the head's backward (a sum over V = 31) and its forward (6) to the path above.
    torch.testing.assert_close(grad_chunked, hs.grad, rtol=0, atol=PAIR * gradient_error(hs.grad, 3 * 31 + 6 + 8))


def test_reverse_kl_is_zero_for_identical_distributions():
    s = _logits(2, 4, 8)
    # The same log-softmax of the same bits on both sides: s − t is exactly 0, and so is the KL.
    assert reverse_kl(s, s.clone(), torch.ones(2, 4)).item() == 0.0


def test_cosine_schedule_starts_at_lr_halves_midway_and_ends_at_zero():
    # float64: a division, cos (≤ 1 ulp), an addition and two products: ≤ 6u relative to base_lr
    # (cos(π/2) ≈ 6e-17 instead of 0 is within it); cos(π) = −1 exactly, so the end is exactly 0.
    tol = 6 * U64 * 3e-6
    assert cosine_lr(3e-6, 0, 600) == pytest.approx(3e-6, abs=tol)
    assert cosine_lr(3e-6, 300, 600) == pytest.approx(1.5e-6, abs=tol)
    assert cosine_lr(3e-6, 600, 600) == 0.0


def test_micro_batch_plan_covers_one_epoch_in_order():
    assert micro_batches(10, 8, 4) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9]]]
    with pytest.raises(ValueError, match="train.mini-batch = 6 is not a multiple of train.micro-batch = 4"):
        micro_batches(10, 6, 4)


def test_optimizer_state_round_trip_continues_training_identically():
    torch.manual_seed(0)
    settings = TrainSettings(lr=1e-2)
    w = torch.nn.Parameter(torch.randn(4, 3))
    target = torch.randn(4, 3)

    def step(opt, param):
        opt.zero_grad()
        ((param - target) ** 2).sum().backward()
        opt.step()

    opt = make_optimizer([w], settings)
    for _ in range(3):
        step(opt, w)
    arrays = optimizer_state_to_arrays(opt)
    assert {k.split(".", 1)[1] for k in arrays} == {"step", "exp_avg", "exp_avg_sq"}

    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = make_optimizer([w2], settings)
    load_optimizer_state(opt2, {k: np.array(v) for k, v in arrays.items()})
    step(opt, w)
    step(opt2, w2)
    assert torch.equal(w.detach(), w2.detach())


# --- the fused gradient (frozen student head) ---------------------------------------------------


def _counting(head, calls):
    def counted(h):
        calls.append(h.shape[0])
        return head(h)

    return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "jsd"])
def test_the_fused_gradient_is_bit_for_bit_the_checkpointed_one_and_runs_each_head_once(name, dtype):
    """The same chunks, the same ops, the same seed 1/tokens: the two ways to take the gradient are
    one computation, so they agree exactly, in fp32 and in bf16 hidden states alike."""
    from fedopd.distill.loss import DIVERGENCES
    from fedopd.distill.opd import divergence_sum_from_hidden
    from fedopd.models import fp32_head

    gen = torch.Generator().manual_seed(11)
    base = torch.randn(37, 16, generator=gen).to(dtype)
    ht = torch.randn(37, 24, generator=gen).to(dtype)
    ws, wt = torch.randn(101, 16, generator=gen).to(dtype), torch.randn(101, 24, generator=gen).to(dtype)
    tokens = 37
    results = {}
    for fused in (False, True):
        s_calls, t_calls = [], []
        hs = base.clone().requires_grad_(True)
        total = divergence_sum_from_hidden(
            hs,
            _counting(lambda h: fp32_head(h, ws), s_calls),
            ht,
            _counting(lambda h: fp32_head(h, wt), t_calls),
            DIVERGENCES[name],
            0.3,
            chunk_size=8,
            fused_scale=float(torch.ones(()) / tokens) if fused else None,
        )
        (total / tokens).backward()
        results[fused] = (total.detach(), hs.grad.clone(), sum(s_calls), sum(t_calls))
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert results[False][2] == results[False][3] == 2 * 37  # checkpointed: both heads again in the backward
    assert results[True][2] == results[True][3] == 37  # fused: each position through each head once


def test_the_fused_gradient_follows_any_incoming_gradient():
    """A caller that scales the sum otherwise than the seed it announced still gets its gradient:
    the kept gradient is rescaled. Seeded with 1 then scaled by 3, or seeded with 3: the same
    backward rounds differently, each within the gradient bound of the checkpointed test above."""
    from fedopd.distill.opd import divergence_sum_from_hidden

    gen = torch.Generator().manual_seed(12)
    ws, wt = torch.randn(31, 6, generator=gen), torch.randn(31, 9, generator=gen)
    hs, ht = torch.randn(23, 6, generator=gen, requires_grad=True), torch.randn(23, 9, generator=gen)
    (3.0 * divergence_sum_from_hidden(hs, lambda h: h @ ws.T, ht, lambda h: h @ wt.T, token_reverse_kl, chunk_size=5, fused_scale=1.0)).backward()
    fused = hs.grad.clone()
    hs.grad = None
    (3.0 * divergence_sum_from_hidden(hs, lambda h: h @ ws.T, ht, lambda h: h @ wt.T, token_reverse_kl, chunk_size=5)).backward()
    torch.testing.assert_close(fused, hs.grad, rtol=0, atol=PAIR * gradient_error(hs.grad, 3 * 31 + 6 + 8 + 1))


def test_a_student_whose_head_takes_gradients_is_refused_by_the_loss(tiny_pair):
    """The fp32 head treats the head as frozen (no weight gradient on either path): a head that
    LoRA or tied trainable embeddings would train is refused, naming the key, not trained nothing."""
    from fedopd.distill.opd import minibatch_gradient

    student, teacher = tiny_pair
    head = student.causal_lm.get_output_embeddings()
    assert not student.head_trainable()
    head.weight.requires_grad_(True)
    try:
        assert student.head_trainable()
        with pytest.raises(ValueError, match="the student's LM head takes gradients .*lora.target-modules"):
            minibatch_gradient(student, teacher, [], [], 256)
    finally:
        head.weight.requires_grad_(False)
