"""The reverse-KL loss, its chunked evaluation, the schedule and the optimizer state."""

import math

import numpy as np
import pytest
import torch

from fedopd.config import TrainSettings
from fedopd.opd import (
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
    assert torch.allclose(token_reverse_kl(s, t).double(), torch.tensor(brute, dtype=torch.float64), atol=1e-6)


def test_reverse_kl_is_the_token_mean_over_the_mask():
    s, t = _logits(2, 5, 13, seed=3), _logits(2, 5, 13, seed=4)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    per_token = token_reverse_kl(s, t)
    expected = per_token[mask.bool()].mean()
    assert reverse_kl(s, t, mask).item() == pytest.approx(expected.item(), rel=1e-6)
    s2 = s.clone()
    s2[0, 0] += 100.0  # a masked-out position cannot change the loss
    assert reverse_kl(s2, t, mask).item() == pytest.approx(expected.item(), rel=1e-6)


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
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
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
    assert total.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(grad_chunked, hs.grad, atol=1e-6)


def test_reverse_kl_is_zero_for_identical_distributions():
    s = _logits(2, 4, 8)
    assert reverse_kl(s, s.clone(), torch.ones(2, 4)).item() == pytest.approx(0.0, abs=1e-7)


def test_cosine_schedule_starts_at_lr_halves_midway_and_ends_at_zero():
    assert cosine_lr(3e-6, 0, 600) == pytest.approx(3e-6)
    assert cosine_lr(3e-6, 300, 600) == pytest.approx(1.5e-6)
    assert cosine_lr(3e-6, 600, 600) == pytest.approx(0.0, abs=1e-18)


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
