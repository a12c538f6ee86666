"""The local OPD step: loss normalisation, AdamW, clipping, the schedule across rounds, optimizer
state. References are written out in the test (float64 or literal numbers).
"""

import numpy as np
import pytest
import torch
from precision import PAIR, U32, opd_gradient_error, opd_loss_error

from fedopd.config import TrainSettings
from fedopd.distill.opd import load_optimizer_state, make_optimizer, minibatch_gradient, optimizer_step
from fedopd.distill.teacher import make_batch, teacher_hidden


def test_adamw_step_uses_betas_weight_decay_clipping_and_the_stored_moments():
    settings = TrainSettings()  # betas (0.9, 0.999), weight decay 0.01, clip 1.0
    p0 = np.array([1.0, -2.0])
    m0, v0 = np.array([0.2, -0.1]), np.array([0.04, 0.09])
    g = np.array([3.0, 4.0])  # norm 5: clipped to norm 1
    lr = 0.1

    w = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
    opt = make_optimizer([w], settings)
    load_optimizer_state(opt, {"0.step": np.array(1.0, np.float32), "0.exp_avg": m0.astype(np.float32), "0.exp_avg_sq": v0.astype(np.float32)})
    w.grad = torch.tensor(g, dtype=torch.float32)
    optimizer_step(opt, [w], lr, settings.grad_clip)

    # By hand (float64): clip, Adam moments, bias correction at step 2, decoupled weight decay.
    gc = g * (1.0 / (5.0 + 1e-6))
    m = 0.9 * m0 + 0.1 * gc
    v = 0.999 * v0 + 0.001 * gc**2
    m_hat, v_hat = m / (1 - 0.9**2), v / (1 - 0.999**2)
    expected = p0 * (1 - lr * 0.01) - lr * m_hat / (np.sqrt(v_hat) + 1e-8)
    # fp32 against float64: the stored m0, v0 are rounded (u); the update lr·m̂/(√v̂ + eps) goes
    # through ~16 roundings (clip: squares, sum, sqrt, division, product; moments: 3 each; bias
    # corrections; sqrt, eps, division, lr) each ≤ u relative; the decayed weight through 3.
    update = lr * np.abs(m_hat / (np.sqrt(v_hat) + 1e-8))
    assert np.all(np.abs(w.detach().numpy() - expected) <= U32 * (16 * update + 3 * np.abs(p0)))
    assert w.grad is None  # gradients are cleared after the step
    assert float(opt.state[w]["step"]) == 2.0


def test_a_gradient_within_the_clip_norm_is_not_rescaled():
    w = torch.nn.Parameter(torch.tensor([0.0, 0.0]))
    opt = make_optimizer([w], TrainSettings(weight_decay=0.0))
    w.grad = torch.tensor([0.3, 0.4])  # norm 0.5 < 1
    optimizer_step(opt, [w], 0.1, 1.0)
    # First Adam step: m̂ = g, v̂ = g², update = lr · g / (|g| + eps).
    # fp32: g rounded (u), m = 0.1·g and v = 0.001·g² (2-3 roundings), the bias corrections,
    # sqrt, + eps, the division and lr (5 more): ≤ 10u relative to the update's 0.1.
    assert w.detach().numpy() == pytest.approx([-0.1 * 0.3 / (0.3 + 1e-8), -0.1 * 0.4 / (0.4 + 1e-8)], rel=10 * U32)
    # m = (1 − β1)·g: g and 1 − β1 rounded, one product: 3u relative.
    assert opt.state[w]["exp_avg"].numpy() == pytest.approx([0.03, 0.04], rel=3 * U32)  # unclipped g


@pytest.mark.slow
def test_the_loss_is_the_token_mean_over_the_whole_mini_batch(tiny_pair):
    student, teacher = tiny_pair
    original = student.get_lora_arrays()
    rng = np.random.default_rng(3)
    student.set_lora_arrays({n: 0.1 * rng.standard_normal(a.shape).astype(np.float32) for n, a in original.items()})
    prompts = [[258, 70, 71], [258, 80, 81, 82, 83]]
    responses = [[60, 61], [90, 91, 92, 93, 94, 95, 96, 97, 98]]  # 2 and 9 tokens: unequal micro-batches
    params = student.lora_parameters()
    try:
        # The module: two micro-batches of one rollout each, accumulated.
        micro = [make_batch([p], [r], pad_id=0) for p, r in zip(prompts, responses)]
        hidden = [teacher_hidden(teacher, b) for b in micro]
        for q in params:
            q.grad = None
        loss = minibatch_gradient(student, teacher, micro, hidden, chunk=4)
        grads = [q.grad.clone() for q in params]

        # Reference: Σ over all 11 response tokens of KL(p_θ ‖ q), divided by 11, in float64.
        for q in params:
            q.grad = None
        total = 0.0
        for p, r in zip(prompts, responses):
            seq = torch.tensor([p + r])
            s_logits = student.model(input_ids=seq).logits[0].double()
            with torch.no_grad():
                t_logits = teacher.model(input_ids=seq).logits[0].double()
            at = slice(len(p) - 1, len(p) - 1 + len(r))  # the positions that predict the response
            ls, lt = torch.log_softmax(s_logits[at], -1), torch.log_softmax(t_logits[at], -1)
            total = total + (ls.exp() * (ls - lt)).sum()
        reference = total / 11
        reference.backward()
        # The module's fp32 forwards (micro-batches, fp32 head, fp32 log-softmax) against fp32
        # forwards of each sequence with the KL in float64: twice the error of one fp32 evaluation
        # of the loss and of each gradient (precision.opd_loss_error, opd_gradient_error).
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        assert loss == pytest.approx(reference.item(), abs=PAIR * opd_loss_error(student, teacher, width, reference.item(), 11))
        for got, q in zip(grads, params):
            bound = PAIR * opd_gradient_error(q.grad, student, teacher, width, reference.item(), 11)
            torch.testing.assert_close(got.double(), q.grad.double(), rtol=0, atol=bound)
        assert sum(g.abs().sum().item() for g in grads) > 0
    finally:
        for q in params:
            q.grad = None
        student.set_lora_arrays(original)


@pytest.mark.slow
def test_activation_checkpointing_is_enabled_once_per_model_not_once_per_round():
    from fedopd.config import LoraSettings
    from fedopd.distill.opd import enable_activation_checkpointing
    from fedopd.models import attach_lora, load_causal_lm

    student = attach_lora(load_causal_lm("builtin:tiny-student"), LoraSettings(), seed=0)

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in student.model.modules())

    before = hooks()
    enable_activation_checkpointing(student.causal_lm)
    once = hooks()
    for _ in range(3):  # later rounds
        enable_activation_checkpointing(student.causal_lm)
    assert once > before and hooks() == once
