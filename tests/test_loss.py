"""The per-token divergences of ``train.loss`` (fedopd.distill.loss) against float64 references written out
here, the registry and its run-config key, and their wiring into the local OPD loop.

Notation: s, t are the student's and the teacher's logits, p = softmax(s), q = softmax(t).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import TINY
from precision import U32, log_softmax_error, logsumexp_error, sum_error, token_kl_error

from fedopd.config import ConfigError, parse_run_config
from fedopd.distill.loss import DIVERGENCES, forward_kl, jsd, reverse_kl
from fedopd.distill.opd import divergence_mean

BETAS = (0.1, 0.5, 0.9)


def _logits(*shape, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).float()


# ---------------------------------------------------------------------------------------------
# float64 references and fp32 error bounds
# ---------------------------------------------------------------------------------------------


def _ref_kl(a_logits, b_logits):
    """KL(softmax(a) ‖ softmax(b)) = Σ a_i log(a_i / b_i), float64, per row."""
    a, b = torch.softmax(a_logits.double(), -1), torch.softmax(b_logits.double(), -1)
    return (a * torch.log(a / b)).sum(-1)


def _ref_jsd(s_logits, t_logits, beta):
    """β·Σ q log(q/m) + (1 − β)·Σ p log(p/m), m = β·q + (1 − β)·p, float64, per row."""
    p, q = torch.softmax(s_logits.double(), -1), torch.softmax(t_logits.double(), -1)
    m = beta * q + (1 - beta) * p
    return beta * (q * torch.log(q / m)).sum(-1) + (1 - beta) * (p * torch.log(p / m)).sum(-1)


def jsd_error(s_logits, t_logits, beta, u=U32):
    """Bound on the error of fp32 ``fedopd.distill.loss.jsd`` per position (β strictly inside (0, 1)).

    fedopd.distill.loss.jsd computes, in fp32: log-softmaxes ls, lt (abs. error e_s, e_t per entry,
    precision.log_softmax_error; entries within [−(2·max|z| + log V), 0]); the mixture
    lm = logsumexp(ls + c1, lt + c2), c1 = log(1 − β), c2 = log β. Each argument carries its
    log-softmax error, the fp32 rounding of the constant (u·|c|) and of the sum (u·|arg|);
    logsumexp is 1-Lipschitz in the max norm and adds its own rounding over 2 terms
    (precision.logsumexp_error(2, max|arg|)):
        e_m = max(e_s + u|c1| + u·max|ls + c1|, e_t + u|c2| + u·max|lt + c2|) + logsumexp_error(2, .)
    Then K_t = Σ exp(lt)(lt − lm) and K_s = Σ exp(ls)(ls − lm) have the shape of
    precision.token_kl_error with (e_s, e_t) -> (e_t, e_m) and (e_s, e_m):
        |ΔK_t| ≤ (e_t + e_m) + (e_t + 2u)·A_t + (2u + sum_error(V))·A_t,  A_t = Σ q|log q − log m|
    (likewise K_s with p, e_s, A_s). Finally β·K_t + (1 − β)·K_s: β and 1 − β rounded to fp32 (u),
    two products (u) and one sum (u): 3u·JSD on top of β|ΔK_t| + (1 − β)|ΔK_s|.
    A, K and JSD are evaluated in float64 from the given fp32 logits.
    """
    v = s_logits.shape[-1]
    zs, zt = float(s_logits.abs().max()), float(t_logits.abs().max())
    e_s, e_t = log_softmax_error(v, zs, u), log_softmax_error(v, zt, u)
    c1, c2 = abs(math.log(1 - beta)), abs(math.log(beta))
    arg_s, arg_t = 2 * zs + math.log(v) + c1, 2 * zt + math.log(v) + c2  # max |ls + c1|, |lt + c2|
    e_m = max(e_s + u * c1 + u * arg_s, e_t + u * c2 + u * arg_t) + logsumexp_error(2, max(arg_s, arg_t), u)
    ls, lt = torch.log_softmax(s_logits.double(), -1), torch.log_softmax(t_logits.double(), -1)
    lm = torch.log(beta * lt.exp() + (1 - beta) * ls.exp())
    a_t, a_s = (lt.exp() * (lt - lm).abs()).sum(-1), (ls.exp() * (ls - lm).abs()).sum(-1)
    k_t, k_s = (lt.exp() * (lt - lm)).sum(-1), (ls.exp() * (ls - lm)).sum(-1)
    d_t = (e_t + e_m) + (e_t + 2 * u) * a_t + (2 * u + sum_error(v, u)) * a_t
    d_s = (e_s + e_m) + (e_s + 2 * u) * a_s + (2 * u + sum_error(v, u)) * a_s
    return beta * d_t + (1 - beta) * d_s + 3 * u * (beta * k_t + (1 - beta) * k_s)


def _within(got, reference, bound):
    return bool(torch.all((got.double() - reference).abs() <= bound))


# ---------------------------------------------------------------------------------------------
# The divergences
# ---------------------------------------------------------------------------------------------


def test_reverse_kl_matches_the_float64_formula():
    s, t = _logits(7, 11, seed=1), _logits(7, 11, seed=2)
    # fp32 log-softmaxes and sum against float64 on the same fp32 logits: precision.token_kl_error.
    assert _within(reverse_kl(s, t), _ref_kl(s, t), token_kl_error(s, t))


def test_forward_kl_matches_the_float64_formula():
    s, t = _logits(7, 11, seed=3), _logits(7, 11, seed=4)
    ref = _ref_kl(t, s)  # KL(q ‖ p)
    assert not _within(ref, _ref_kl(s, t), 1e-3)  # the two directions differ on these logits
    # KL(q ‖ p) in fp32 is the reverse-KL computation with the roles swapped: token_kl_error(t, s).
    assert _within(forward_kl(s, t), ref, token_kl_error(t, s))


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_matches_the_float64_generalized_jsd(beta):
    s, t = _logits(7, 11, seed=5), _logits(7, 11, seed=6)
    # Bound derived in jsd_error above (fp32 log-softmax, mixture logsumexp, two KL sums), ≈ 1e-6 here.
    assert _within(jsd(s, t, beta), _ref_jsd(s, t, beta), jsd_error(s, t, beta))


def test_jsd_at_beta_zero_is_forward_kl_and_at_one_reverse_kl():
    # TRL's GKDTrainer.generalized_jsd_loss: β = 0 is KL(q ‖ p), β = 1 is KL(p ‖ q), by definition
    # (the mixture formula itself tends to 0 at both ends). Same code path: exactly equal.
    s, t = _logits(5, 13, seed=7), _logits(5, 13, seed=8)
    assert torch.equal(jsd(s, t, 0.0), forward_kl(s, t))
    assert torch.equal(jsd(s, t, 1.0), reverse_kl(s, t))
    assert _within(jsd(s, t, 0.0), _ref_kl(t, s), token_kl_error(t, s))
    assert _within(jsd(s, t, 1.0), _ref_kl(s, t), token_kl_error(s, t))


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_is_symmetric_under_swapping_student_and_teacher_with_one_minus_beta(beta):
    s, t = _logits(6, 17, seed=9), _logits(6, 17, seed=10)
    # Exactly equal in real arithmetic (same mixture, same two KL terms); two fp32 evaluations in
    # different orders, each within its own jsd_error of that value.
    bound = jsd_error(s, t, beta) + jsd_error(t, s, 1 - beta)
    assert _within(jsd(s, t, beta), jsd(t, s, 1 - beta).double(), bound)


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl"])
def test_a_kl_of_identical_inputs_is_exactly_zero(name):
    s = _logits(4, 9, seed=11)
    # The same log-softmax of the same bits on both sides: every log-ratio is exactly 0.
    assert torch.equal(DIVERGENCES[name](s, s.clone()), torch.zeros(4))


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_of_identical_inputs_is_zero(beta):
    s = _logits(4, 9, seed=11)
    # The mixture logsumexp is not bit-equal to the log-softmax, so 0 only up to jsd_error
    # (with K_s = K_t = 0: the log-softmax and mixture roundings alone).
    assert _within(jsd(s, s.clone(), beta), torch.zeros(4, dtype=torch.float64), jsd_error(s, s, beta))


@pytest.mark.parametrize("beta", BETAS)
def test_chunked_token_mean_of_jsd_threads_beta(beta):
    s, t = _logits(3, 7, 19, seed=12), _logits(3, 7, 19, seed=13)
    mask = (torch.rand(3, 7, generator=torch.Generator().manual_seed(14)) > 0.3).long()
    keep = mask.bool()
    ref = _ref_jsd(s, t, beta)[keep].mean().item()
    got = divergence_mean(s, t, mask, jsd, beta, chunk_size=5).item()
    # Per-token jsd_error averaged over the kept tokens, then the weighted sums over 21 positions
    # (in chunks, non-negative terms: sum_error(21)) and the division (u).
    n = int(keep.sum())
    tol = jsd_error(s.reshape(-1, 19), t.reshape(-1, 19), beta)[keep.reshape(-1)].sum().item() / n
    tol += (sum_error(21) + U32) * ref
    assert got == pytest.approx(ref, abs=tol)


# ---------------------------------------------------------------------------------------------
# The registry and train.loss
# ---------------------------------------------------------------------------------------------


def test_the_registry_holds_exactly_the_three_divergences():
    assert set(DIVERGENCES) == {"reverse_kl", "forward_kl", "jsd"}
    assert DIVERGENCES["reverse_kl"] is reverse_kl and DIVERGENCES["forward_kl"] is forward_kl
    assert DIVERGENCES["jsd"] is jsd


def test_train_loss_accepts_the_registered_names_and_rejects_another():
    for name in DIVERGENCES:
        assert parse_run_config({"train.loss": name}).train.loss == name
    assert parse_run_config({}).train.loss == "reverse_kl"
    with pytest.raises(ConfigError) as err:
        parse_run_config({"train.loss": "cross_entropy"})
    message = str(err.value)
    assert "train.loss" in message and all(repr(n) in message for n in ("reverse_kl", "forward_kl", "jsd"))


# ---------------------------------------------------------------------------------------------
# Wiring into local_opd (tiny models)
# ---------------------------------------------------------------------------------------------


def _rollouts(student, n, seed):
    from fedopd.rollout import HFRolloutEngine, SamplingParams

    return HFRolloutEngine(student).generate([[258, 70, 71]] * n, SamplingParams(16, seed=seed))


@pytest.mark.slow
def test_train_loss_forward_kl_trains_differently_from_reverse_kl(tiny_pair):
    from fedopd.distill.opd import local_opd

    student, teacher = tiny_pair
    theta = student.get_lora_arrays()
    rollouts = _rollouts(student, 16, seed=3)
    base = parse_run_config(TINY).train  # mini-batch 8: two AdamW steps on 16 rollouts
    runs = {}
    try:
        for key, loss in (("reverse", "reverse_kl"), ("again", "reverse_kl"), ("forward", "forward_kl")):
            student.set_lora_arrays(theta)
            settings = dataclasses.replace(base, loss=loss)
            runs[key] = local_opd(student, teacher, rollouts, settings, step_offset=0, total_steps=2)
    finally:
        student.set_lora_arrays(theta)

    def gap(a, b):
        return max(float(np.abs(runs[a].arrays[n] - runs[b].arrays[n]).max()) for n in runs[a].arrays)

    if student.device.type == "cpu":
        # Deterministic CPU kernels: the same loss on the same data reproduces the update bit for bit,
        # so any difference below comes from train.loss alone.
        assert gap("reverse", "again") == 0.0
    assert gap("reverse", "forward") > gap("reverse", "again")
    assert runs["forward"].metrics["loss_first"] != runs["reverse"].metrics["loss_first"]


@pytest.mark.slow
def test_the_loss_of_a_jsd_step_is_the_float64_jsd_of_its_logits(tiny_pair):
    from fedopd.distill.opd import local_opd, make_micro_batches, round_plan, teacher_pass, use_packing

    student, teacher = tiny_pair
    theta = student.get_lora_arrays()
    beta = 0.3  # not the default 0.5: the value must come from train.loss-beta
    rollouts = _rollouts(student, 4, seed=4)
    settings = dataclasses.replace(parse_run_config(TINY).train, loss="jsd", loss_beta=beta, mini_batch=4, micro_batch=4)
    plan = round_plan(rollouts, settings)  # one step, one micro-batch
    batches = make_micro_batches(rollouts, plan, 0, student.device, use_packing(student, settings.packing))
    hidden = teacher_pass(teacher, batches)
    (batch,), (th,) = batches.values(), hidden.values()
    assert batch.num_tokens <= settings.loss_chunk  # one loss chunk: the head sees the same rows below
    try:
        # The step's logits: the same student forward (train mode, gradients on) and the same heads on
        # the same hidden states as inside local_opd, so the same fp32 bits.
        student.model.train()
        with torch.enable_grad():
            zs = student.logits(batch.hidden(student)).detach()
        student.model.eval()
        with torch.no_grad():
            zt = teacher.logits(th)
        result = local_opd(student, teacher, rollouts, settings, step_offset=0, total_steps=1, batches=batches, hidden=hidden)
    finally:
        student.model.eval()
        student.set_lora_arrays(theta)
    ref = _ref_jsd(zs, zt, beta)
    n = batch.num_tokens
    # fp32 JSD per token (jsd_error), the sum over the n tokens of the one chunk (non-negative
    # terms: sum_error(n)) and the division by n (u); the float64 reference adds ~1e-15.
    tol = jsd_error(zs, zt, beta).sum().item() / n + (sum_error(n) + U32) * ref.mean().item()
    assert result.metrics["loss_first"] == pytest.approx(ref.mean().item(), abs=tol)
    assert result.metrics["steps"] == 1
    # The test tells the JSD at β apart from the reverse KL and from the JSD at the default β: both
    # lie more than 2·tol away (their own fp32 evaluation could not land within tol of ref).
    assert abs(_ref_kl(zs, zt).mean().item() - ref.mean().item()) > 2 * tol
    assert abs(_ref_jsd(zs, zt, 0.5).mean().item() - ref.mean().item()) > 2 * tol
