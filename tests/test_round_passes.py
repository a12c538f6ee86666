"""What a client round computes, and how often (no pass only for a metric).

The teacher runs once per rollout per round and the scoring cache reads its rows from that pass;
the candidates are scored together in one batched pass that equals one forward per candidate;
packed (padding-free) micro-batches give the padded loss and gradient; the exact before/after KL
over all rollouts is opt-in. References are independent forwards on the tiny models.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import TINY
from precision import (
    PAIR,
    U32,
    UBF16,
    coarse_kl_pair_error,
    coarse_log_prob_pair_error,
    logit_error,
    lse_error,
    opd_gradient_error,
    opd_loss_error,
    sum_error,
)

import fedopd.distill.cache as cache_module
from fedopd.config import CacheSettings, parse_run_config
from fedopd.data import encode_prompts, tiny_arith_partition
from fedopd.distill.cache import build_scoring_cache, score_candidates
from fedopd.distill.opd import (
    hidden_in_rollout_order,
    make_micro_batches,
    micro_batches,
    minibatch_gradient,
    padding_share,
    sequence_lengths,
    teacher_pass,
    use_packing,
)
from fedopd.engine.round import ClientModels, RoundPlan, train_round
from fedopd.rollout import HFRolloutEngine, Rollouts

pytestmark = pytest.mark.slow

PROMPTS = [[258, 70, 71, 72, 73], [258, 80, 81], [258, 40], [258, 50, 51, 52]]
RESPONSES = [[60, 61, 62, 63, 64, 65, 66], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101], [30, 31], [20, 21, 22, 23, 24]]


@pytest.fixture()
def lora_student(tiny_pair):
    """The tiny student with random non-zero LoRA factors, restored afterwards."""
    student, teacher = tiny_pair
    original = student.get_lora_arrays()
    rng = np.random.default_rng(7)
    theta = {n: 0.2 * rng.standard_normal(a.shape).astype(np.float32) for n, a in original.items()}
    student.set_lora_arrays(theta)
    yield student, teacher, theta
    student.set_lora_arrays(original)


class Counter:
    """Counts the sequences (rows) and calls that go through ``lm.hidden_states``."""

    def __init__(self, lm, monkeypatch):
        self.rows, self.calls = 0, 0
        original = lm.hidden_states

        def counted(input_ids, attention_mask=None, position_ids=None):
            self.calls += 1
            self.rows += int(input_ids.shape[0]) if position_ids is None else int((position_ids == 0).sum())
            return original(input_ids, attention_mask, position_ids)

        monkeypatch.setattr(lm, "hidden_states", counted)


def _round(student, teacher, train_overrides, monkeypatch, build_cache=True):
    cfg = parse_run_config(TINY)
    models = ClientModels(student, teacher, HFRolloutEngine(student))
    prompts = encode_prompts(student.tokenizer, tiny_arith_partition(0, 3, 64, 42), 2048)
    theta = student.get_lora_arrays()
    rollout = dataclasses.replace(cfg.rollout, per_round=8, max_new_tokens=16)
    # Count only after generation (HF generate runs the student's body through its own path).
    original_generate = models.rollout.generate
    counts = {}

    def generate_then_count(*args, **kwargs):
        out = original_generate(*args, **kwargs)
        counts["student"], counts["teacher"] = Counter(student, monkeypatch), Counter(teacher, monkeypatch)
        return out

    monkeypatch.setattr(models.rollout, "generate", generate_then_count)
    plan = RoundPlan(
        server_round=1,
        seed=42,
        rollout=rollout,
        cache=CacheSettings(rollouts=4, positions=4, top_k=4),
        train=dataclasses.replace(cfg.train, mini_batch=4, micro_batch=2, **train_overrides),
        step_offset=0,
        total_steps=4,
        build_cache=build_cache,
    )
    out = train_round(models, theta, prompts, plan)
    return out, counts["student"], counts["teacher"]


def test_the_teacher_runs_once_per_rollout_per_round(tiny_pair, monkeypatch):
    out, _, teacher = _round(*tiny_pair, {}, monkeypatch)
    assert out.cache is not None
    assert teacher.rows == 8  # the 8 rollouts, once: the 4 cached ones are not run again


def test_the_round_makes_no_student_pass_only_for_a_metric_by_default(tiny_pair, monkeypatch):
    out, student, _ = _round(*tiny_pair, {}, monkeypatch)
    # 4 cached rollouts (π̃_t, before any step) + 8 rollouts trained on, once each.
    assert student.rows == 4 + 8
    assert "kl_before" not in out.metrics and "kl_after" not in out.metrics
    assert np.isfinite(out.metrics["loss_first"]) and np.isfinite(out.metrics["loss_last"])


def test_exact_kl_before_and_after_is_opt_in_and_costs_two_passes(tiny_pair, monkeypatch):
    out, student, _ = _round(*tiny_pair, {"exact_kl": True}, monkeypatch)
    assert student.rows == 4 + 8 + 2 * 8
    assert out.metrics["kl_before"] > 0 and out.metrics["kl_after"] > 0


def test_without_a_cache_the_round_runs_no_cache_pass(tiny_pair, monkeypatch):
    out, student, teacher = _round(*tiny_pair, {}, monkeypatch, build_cache=False)
    assert out.cache is None and student.rows == 8 and teacher.rows == 8


def test_cache_teacher_rows_from_the_round_pass_equal_a_teacher_forward_on_the_cached_rollouts(lora_student):
    student, teacher, _ = lora_student
    rollouts = Rollouts(PROMPTS, RESPONSES, [False] * 4)
    settings = CacheSettings(rollouts=2, positions=3, top_k=3)
    plan = micro_batches(4, 4, 2, sequence_lengths(rollouts))  # grouped by length: not rollout order
    assert plan == [[[2, 3], [0, 1]]]
    hidden = teacher_pass(teacher, make_micro_batches(rollouts, plan, 0, student.device, packed=False))
    in_order = hidden_in_rollout_order(hidden, rollouts.response_lengths)
    from_pass = build_scoring_cache(student, teacher, rollouts, settings, seed=3, teacher_hidden=in_order)
    direct = build_scoring_cache(student, teacher, rollouts, settings, seed=3)
    assert not np.array_equal(from_pass.positions[:, 0], np.zeros_like(from_pass.positions[:, 0]))  # two rollouts
    np.testing.assert_array_equal(from_pass.token_ids, direct.token_ids)
    # Two fp32 teacher forwards of the same rows in different batches (micro-batches vs the cached
    # rollouts): |Δ log q̃| ≤ 4δ + 4ε (precision.coarse_log_prob_pair_error; teacher δ ≈ 1.3e-4,
    # ε ≈ 6e-6), so each probability moves by at most a factor e^(±bound); padding stays 0 in both.
    log_bound = coarse_log_prob_pair_error(logit_error(teacher, direct.input_ids.shape[1]), lse_error(teacher))
    np.testing.assert_allclose(from_pass.teacher, direct.teacher, rtol=np.expm1(log_bound), atol=0)
    np.testing.assert_array_equal(from_pass.student, direct.student)


@pytest.mark.parametrize("per_pass", [None, 4, 1])
def test_batched_candidate_scores_equal_one_forward_per_candidate(lora_student, per_pass, monkeypatch):
    student, teacher, theta = lora_student
    rollouts = Rollouts(PROMPTS, RESPONSES, [False] * 4)
    cache = build_scoring_cache(student, teacher, rollouts, CacheSettings(rollouts=3, positions=4, top_k=3), seed=1)
    rng = np.random.default_rng(11)
    delta = {n: 0.05 * rng.standard_normal(a.shape).astype(np.float32) for n, a in theta.items()}
    candidates = [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]
    logits = []  # what each path hands to coarsen_logits, candidate-major in both
    original = cache_module.coarsen_logits
    monkeypatch.setattr(cache_module, "coarsen_logits", lambda z, ids: logits.append(z.detach().clone()) or original(z, ids))

    student.model.eval()
    batched = score_candidates(student, cache, theta, delta, candidates, candidates_per_pass=per_pass)
    batched_logits = torch.cat(logits)
    logits.clear()
    student.set_lora_arrays(theta)
    sequential = score_candidates(student, cache, theta, delta, candidates, batched=False)
    sequential_logits = torch.cat(logits)

    # Both paths are fp32 forwards of the same function in different orders (stacked batch vs one
    # candidate at a time); each logit is within δ of exact (precision.logit_error: statistical
    # bound over the ~1.4e3 roundings from input to logit, scale ||h||·max||w_v|| ≈ 1.6: δ ≈ 1.0e-5),
    # so the two within 2δ. Scoring under a wrong adapter or multiplier (even the low-rank term
    # scaled by 1.001: logits move by ~8e-4) is far outside this.
    delta_z = logit_error(student, cache.input_ids.shape[1])
    torch.testing.assert_close(batched_logits, sequential_logits, rtol=0, atol=PAIR * delta_z)
    # The scores are float64 KLs of those fp32 logits: |ΔĴ|, |ΔK̂| ≤ sqrt(2·KL)·2δ + 4ε
    # (precision.coarse_kl_pair_error; ε ≈ 4e-6 the fp32 logsumexp rounding), ≈ 2e-5 here.
    eps = lse_error(student)
    bound = np.array([[coarse_kl_pair_error(v, delta_z, eps) for v in row] for row in sequential])
    difference = np.abs(np.array(batched) - np.array(sequential))
    assert np.all(difference <= bound), f"|batched - sequential| {difference.max():.3g} exceeds the fp32 bound {bound.min():.3g}"
    assert len(set(np.round(batched[0], 6))) == len(candidates)  # every candidate scored under its own adapter


def test_batched_scoring_leaves_the_trained_adapter_active_and_alone_trainable(lora_student):
    student, teacher, theta = lora_student
    rollouts = Rollouts(PROMPTS[:2], RESPONSES[:2], [False] * 2)
    cache = build_scoring_cache(student, teacher, rollouts, CacheSettings(rollouts=2, positions=4, top_k=3), seed=1)
    trainable = [id(p) for p in student.lora_parameters()]
    delta = {n: np.full(a.shape, 0.01, np.float32) for n, a in theta.items()}
    student.model.eval()
    score_candidates(student, cache, theta, delta, [1.0, 3.0])
    assert [id(p) for p in student.lora_parameters()] == trainable
    for name, a in student.get_lora_arrays().items():
        np.testing.assert_array_equal(a, theta[name])
    with torch.no_grad():  # the forward uses θ_t, not a candidate
        ids = torch.tensor([PROMPTS[0] + RESPONSES[0]])
        now = student.hidden_states(ids, torch.ones_like(ids))
    student.set_lora_arrays(theta)
    with torch.no_grad():
        again = student.hidden_states(ids, torch.ones_like(ids))
    torch.testing.assert_close(now, again, rtol=0, atol=0)


def _loss_and_grad(student, teacher, rollouts, plan, packed):
    """One mini-batch's loss and LoRA gradients from micro-batches ``plan`` (gradients cleared
    before and after), and the micro-batches."""
    batches = make_micro_batches(rollouts, plan, 0, student.device, packed=packed)
    hidden = teacher_pass(teacher, batches)
    params = student.lora_parameters()
    for p in params:
        p.grad = None
    loss = minibatch_gradient(student, teacher, list(batches.values()), list(hidden.values()), 1024)
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss, grads, batches


def test_packed_micro_batches_give_the_padded_loss_and_gradient(lora_student):
    student, teacher, _ = lora_student
    rollouts = Rollouts(PROMPTS, RESPONSES, [False] * 4)
    plan = micro_batches(4, 4, 2)  # one mini-batch of two micro-batches of unequal length
    padded_loss, padded_grads, padded = _loss_and_grad(student, teacher, rollouts, plan, False)
    packed_loss, packed_grads, packed = _loss_and_grad(student, teacher, rollouts, plan, True)
    assert all(b.packed and b.input_ids.shape[0] == 1 for b in packed.values())
    assert sum(b.input_ids.numel() for b in packed.values()) < sum(b.input_ids.numel() for b in padded.values())
    # Two fp32 evaluations (packed vs padded rows) of the same loss and gradient: twice the error
    # of one (precision.opd_loss_error, opd_gradient_error: the student's and the teacher's logit
    # errors through the KL, and the roundings of the backward pass, on the scale of max|g|).
    width = max(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
    tokens = sum(len(r) for r in RESPONSES)
    assert packed_loss == pytest.approx(padded_loss, abs=PAIR * opd_loss_error(student, teacher, width, padded_loss, tokens))
    for g_packed, g_padded in zip(packed_grads, padded_grads):
        bound = PAIR * opd_gradient_error(g_padded, student, teacher, width, padded_loss, tokens)
        torch.testing.assert_close(g_packed, g_padded, rtol=0, atol=bound)


def test_packing_auto_means_packed_exactly_with_flash_attention(tiny_pair):
    student, _ = tiny_pair
    assert student.attn_implementation == "sdpa"
    assert not use_packing(student, "auto")
    assert use_packing(student, "packed") and not use_packing(student, "padded")

    class FlashModel:
        attn_implementation = "flash_attention_2"

    assert use_packing(FlashModel(), "auto")


def test_fp32_head_gives_fp32_logits_and_the_gradient_of_a_plain_linear():
    from fedopd.models import fp32_head

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 8, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(11, 8, generator=g).bfloat16()
    out = fp32_head(h, w)
    assert out.dtype == torch.float32
    # bf16·bf16 products are exact in fp32 (8 + 8 significant bits ≤ 24): the only error is the
    # fp32 sum over H = 8 terms, at most γ_8·Σ|h_i w_i| (precision.sum_error, worst case 8u).
    magnitude = h.detach().double().abs() @ w.double().abs().T
    error = (out.double() - h.detach().double() @ w.double().T).abs()
    assert torch.all(error <= sum_error(8) * magnitude)
    upstream = torch.randn(5, 11, generator=g)
    out.backward(upstream)
    assert h.grad.dtype == torch.bfloat16
    # The fp32 product upstream @ w (sum over 11 terms, error ≤ γ_11·Σ|up||w| =: e) is rounded to
    # bf16 (u = 2^-8), as is the reference: |bf16(a) − bf16(b)| ≤ 2^-8(|a| + |b|) + |a − b|
    # ≤ e(1 + 2^-8) + 2^-7·|b| (one bf16 ulp: a rounding that lands on the neighbouring value),
    # plus u32·|b| for the reference's float64 -> fp32 -> bf16 conversion.
    reference = upstream.double() @ w.double()
    e = sum_error(11) * (upstream.double().abs() @ w.double().abs())
    bound = e * (1 + UBF16) + (2 * UBF16 + U32) * reference.abs()
    assert torch.all((h.grad.double() - reference.bfloat16().double()).abs() <= bound)


def _progress_lines(tiny_pair) -> tuple[list[str], ClientModels]:
    """The progress lines of a 4-rollout round 3 on the tiny pair, and the models it ran on."""
    student, teacher = tiny_pair
    cfg = parse_run_config(TINY)
    models = ClientModels(student, teacher, HFRolloutEngine(student))
    prompts = encode_prompts(student.tokenizer, tiny_arith_partition(0, 3, 16, 42), 2048)
    lines = []
    plan = RoundPlan(
        server_round=3,
        seed=1,
        rollout=dataclasses.replace(cfg.rollout, per_round=4, max_new_tokens=6),
        cache=CacheSettings(rollouts=2, positions=4, top_k=4),
        train=dataclasses.replace(cfg.train, mini_batch=4, micro_batch=4),
        step_offset=0,
        total_steps=4,
    )
    train_round(models, student.get_lora_arrays(), prompts, plan, progress=lines.append)
    return lines, models


def test_a_round_reports_its_long_phases_and_generation_steps(tiny_pair, monkeypatch):
    import fedopd.engine.round as round_module

    monkeypatch.setattr(round_module, "PROGRESS_AFTER_S", 0.0)  # every phase counts as long
    lines, models = _progress_lines(tiny_pair)
    assert [line.split(":")[0] for line in lines] == ["round 3"] * len(lines)
    phases = [line for line in lines if not line.startswith("round 3: generating")]
    assert [p.split(": ", 1)[1].split(" ")[0:2] for p in phases] == [["4", "rollouts,"], ["teacher", "pass"], ["scoring", "cache"], ["local", "OPD,"]]
    assert any(line.startswith("round 3: generating 4 responses: step ") for line in lines)
    assert models.rollout.progress is None  # the reporter does not outlive the round


def test_a_short_round_reports_nothing(tiny_pair):
    lines, _ = _progress_lines(tiny_pair)
    assert lines == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_head_is_upcast_block_by_block_to_the_same_fp32_logits(dtype, monkeypatch):
    """Blocks of head rows (forced small here: 7 rows of 40) give each logit the same H-term fp32
    dot product as one fp32 copy of the whole head; its gradient sums 40 fp32 terms either way.
    Both are within the fp32 sum bound γ_n·Σ|a||b| of the float64 product of the same values."""
    from fedopd.models import fp32_head, head

    monkeypatch.setattr(head, "HEAD_BLOCK_BYTES", 7 * 4 * 24)
    assert head.head_block_rows(24) == 7
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, 5, 24, generator=gen).to(dtype).requires_grad_(True)
    w = torch.randn(40, 24, generator=gen).to(dtype)
    out = fp32_head(h, w)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 40)
    exact = h.detach().double() @ w.double().T
    n = 24
    assert torch.all((out.double() - exact).abs() <= n * U32 / (1 - n * U32) * (h.detach().double().abs() @ w.double().abs().T))
    g = torch.randn(3, 5, 40, generator=gen)
    out.backward(g)
    exact_grad = g.double() @ w.double()
    m = 40  # fp32 sums of 40 terms, then one rounding to the half type (unit roundoff u_half)
    u_half = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    e = m * U32 / (1 - m * U32) * (g.double().abs() @ w.double().abs())
    assert torch.all((h.grad.double() - exact_grad).abs() <= e * (1 + u_half) + u_half * exact_grad.abs())
    assert h.grad.dtype == dtype


# --- micro-batches grouped by length ----------------------------------------------------------

SHUFFLED = (0, 2, 1, 3)  # sequence lengths 12, 4, 15, 9: rollout order pairs long with short


def test_micro_batches_group_rollouts_of_similar_length_within_each_mini_batch():
    lengths = [12, 4, 15, 9, 7, 30, 2, 8]
    assert micro_batches(8, 4, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # mini-batches stay consecutive (the same optimizer steps); inside each, sorted by length
    assert micro_batches(8, 4, 2, lengths) == [[[1, 3], [0, 2]], [[6, 4], [7, 5]]]
    assert micro_batches(3, 4, 2, [5, 5, 1]) == [[[2, 0], [1]]]  # ties keep rollout order
    # padded slots: rollout order 2·12 + 2·15 + 2·30 + 2·8 = 130; grouped 2·9 + 2·15 + 2·7 + 2·30 = 122; tokens 87
    assert padding_share(micro_batches(8, 4, 2), lengths) == pytest.approx(1 - 87 / 130, abs=1e-15)
    assert padding_share(micro_batches(8, 4, 2, lengths), lengths) == pytest.approx(1 - 87 / 122, abs=1e-15)
    with pytest.raises(ValueError, match="3 lengths for 8 rollouts"):
        micro_batches(8, 4, 2, [1, 2, 3])


def test_hidden_states_of_grouped_micro_batches_are_put_back_in_rollout_order():
    rows = torch.arange(10.0).reshape(10, 1)  # rollouts 0..2 with 3, 5 and 2 response positions
    hidden = {(2, 0): torch.cat([rows[8:10], rows[0:3]]), (1,): rows[3:8]}
    assert torch.equal(hidden_in_rollout_order(hidden, [3, 5, 2]), rows)
    with pytest.raises(ValueError, match="expected 0..2"):
        hidden_in_rollout_order({(2, 0): hidden[(2, 0)]}, [3, 5, 2])


def test_length_grouped_micro_batches_give_the_rollout_order_loss_and_gradient(lora_student):
    """The same tokens in the same mini-batch, split into micro-batches otherwise: the same token
    mean and gradient up to two fp32 evaluations' error, with less padding."""
    student, teacher, _ = lora_student
    rollouts = Rollouts([PROMPTS[i] for i in SHUFFLED], [RESPONSES[i] for i in SHUFFLED], [False] * 4)
    lengths = sequence_lengths(rollouts)
    assert lengths == [12, 4, 15, 9]

    in_order, grouped = micro_batches(4, 4, 2), micro_batches(4, 4, 2, lengths)
    assert grouped == [[[1, 3], [0, 2]]] != in_order
    order_loss, order_grads, order_batches = _loss_and_grad(student, teacher, rollouts, in_order, False)
    grouped_loss, grouped_grads, grouped_batches = _loss_and_grad(student, teacher, rollouts, grouped, False)
    # padded slots 2·12 + 2·15 = 54 in rollout order, 2·9 + 2·15 = 48 grouped
    assert [sum(b.input_ids.numel() for b in bs.values()) for bs in (order_batches, grouped_batches)] == [54, 48]
    width = max(lengths)
    tokens = sum(len(r) for r in RESPONSES)
    assert grouped_loss == pytest.approx(order_loss, abs=PAIR * opd_loss_error(student, teacher, width, order_loss, tokens))
    for g_grouped, g_order in zip(grouped_grads, order_grads):
        bound = PAIR * opd_gradient_error(g_order, student, teacher, width, order_loss, tokens)
        torch.testing.assert_close(g_grouped, g_order, rtol=0, atol=bound)
