"""Tolerances derived from floating-point precision, for the tests that compare two evaluations.

Every tolerance in the tests is either exact (the two sides run the same operations on the same
bits) or comes from a helper here, whose docstring shows the arithmetic. Notation: u is the unit
roundoff (half an ulp of 1.0), so a correctly rounded operation returns x(1 + δ) with |δ| ≤ u.

Two models of accumulated rounding (Higham, "Accuracy and Stability of Numerical Algorithms",
§3.1; Higham & Mary, SIAM J. Sci. Comput. 41 (2019) "A new approach to probabilistic rounding
error analysis"):

* worst case: a sum or dot product of n terms, in any order, is off by at most
  γ_n · Σ|terms|, γ_n = n·u/(1 − n·u). Rigorous; used for the short sums of hand-made examples.
* statistical: the n rounding errors are independent, mean zero, |δ| ≤ u, so variance ≤ u²/3
  each; the error is then at most SIGMAS · u · sqrt(n/3) · Σ|terms| except with probability
  P(|Z| > 5) ≈ 6e-7. Used for the long chains of a model forward, where the worst case
  (n·u with n in the thousands) would be vacuous.

:func:`sum_error` takes the smaller of the two (both hold). A comparison of two *different*
evaluation orders of the same function (batched vs sequential, packed vs padded, chunked vs
unchunked) is bounded by the triangle inequality through the exact value: twice the bound of one
evaluation (:data:`PAIR`).

Where a model is involved the bounds are written in terms of its configuration (hidden size H,
layers L, intermediate size I, head dim d, vocabulary V) and fp32's u, with the one stated
assumption that the network neither amplifies nor cancels relative errors from one rounding to
the logits (gain ≈ 1), which the Cauchy–Schwarz scale of :func:`logit_scale` over-covers by up to
sqrt(H). On the tiny models (2-core AMD EPYC) the observed differences sit ~8x below these bounds
for the student under large LoRA candidates (logits: 2.5e-6 vs 2.1e-5) and 100x or more below
them for the teacher, whose errors stay near one unit of u·S.

bf16 (the tests marked gpu, tests/devices.py). A bf16 model rounds each op's *output* to bf16
(u = 2^-8) after fp32 accumulation. Counting every reduction term at u_bf16 with the logit scale S,
as the fp32 model does, gives logit errors of ~0.7 on the tiny student, and a KL bound of the size
of the KLs under test. The bf16 bounds below instead count the rounding stages on the path to the
final hidden state h (:func:`bf16_roundings`), bound ||Δh|| with the same gain-1 statistical
model (:func:`hidden_error_bf16`: about 10 % of ||h||), and carry Δh through the head's rows to a
KL by a second-order inequality (:func:`logit_shift_kl`) whose scale is the spread of the head
rows under p, not their largest norm. Two bf16 evaluations of one function (the cache's forward
and a scoring pass, batched and sequential) are within PAIR times one evaluation's bound: after a
few layers their rounding differences are as large as independent roundings.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # fp32 unit roundoff ≈ 5.96e-8
U64 = 2.0**-53  # fp64 unit roundoff ≈ 1.11e-16
UBF16 = 2.0**-8  # bf16 unit roundoff ≈ 3.9e-3 (8 significant bits)
SIGMAS = 5.0  # statistical bounds: 5 standard deviations
PAIR = 2.0  # |a − b| ≤ |a − exact| + |exact − b|
ELEMENTWISE_PER_LAYER = 8  # rotary, softmax exp, SiLU, gate·up, scalings, two residual adds: one rounding each


# ---------------------------------------------------------------------------------------------
# Sums and small hand-made computations
# ---------------------------------------------------------------------------------------------


def sum_error(n: int, u: float = U32) -> float:
    """Relative error (w.r.t. Σ|terms|) of a sum or dot product of n terms in any order.

    min(worst case γ_n = n·u/(1 − n·u), statistical SIGMAS·u·sqrt(n/3)): for n = 4 that is 4u,
    for n = 261 it is 5·sqrt(87)·u ≈ 46.6u.
    """
    n = max(int(n), 1)
    return min(n * u / (1.0 - n * u), SIGMAS * u * math.sqrt(n / 3.0))


def kl_error(p: torch.Tensor, q: torch.Tensor, u: float = U32, inputs_rel: float = 0.0) -> torch.Tensor:
    """Bound on the error of ``fedopd.distill.cache.kl(p, q)`` = Σ xlogy(p, p) − xlogy(p, q), per row.

    Each term: log (≤ 1 ulp = 2u relative), product (u), subtraction (u on |p log p| + |p log q|):
    4u·(|p log p| + |p log q|); then the sum of n terms: sum_error(n)·Σ(|p log p| + |p log q|).
    ``inputs_rel``: p and q themselves carry a relative error up to that (decimal literals:
    u; a tail 1 − Σ: its absolute error over its value); the KL then moves by at most
    inputs_rel·Σ p(|log p/q| + 1) [Δp] + inputs_rel·Σ p [Δq/q], to first order.
    The bound is evaluated in float64 from the given values.
    """
    p, q = p.double(), q.double()
    plogp = torch.xlogy(p, p).abs()
    plogq = torch.xlogy(p, q).abs()
    n = p.shape[-1]
    bound = (4 * u + sum_error(n, u)) * (plogp + plogq).sum(-1)
    if inputs_rel:
        ratio = torch.where(p > 0, (torch.log(p) - torch.log(q)).abs(), torch.zeros_like(p))
        bound = bound + inputs_rel * (p * (ratio + 2)).sum(-1)
    return bound


def logsumexp_error(vocab: int, max_abs_logit: float, u: float = U32) -> float:
    """Absolute error of one logsumexp T = m + log Σ exp(z − m) over ``vocab`` logits in a float format.

    z − m is rounded (≤ u·|z − m| ≤ 2u·max|z|, relative on each exp term) and exp adds ≤ 1 ulp
    (2u): the terms are off by ≤ u(2·max|z| + 2) relative; their sum (positive terms) by
    sum_error(V) relative; log s adds ≤ 1 ulp of |log s| ≤ log V (2u·log V); the final m + log s
    is rounded (u·|T| ≤ u(max|z| + log V)). A relative error ρ of s is an absolute error ρ of log s.
        ε = u·(3·max|z| + 3·log V + 2) + sum_error(V)
    Tiny student (V = 261, max|z| ≤ 1.6): ε ≈ (4.8 + 16.7 + 2 + 46.6)u ≈ 70u ≈ 4.2e-6.
    """
    return u * (3 * max_abs_logit + 3 * math.log(vocab) + 2) + sum_error(vocab, u)


def log_softmax_error(vocab: int, max_abs_logit: float, u: float = U32) -> float:
    """Absolute error of one fp32 log-softmax entry z_i − T: ε_T plus rounding u·|z_i − T| ≤ u(2·max|z| + log V)."""
    return logsumexp_error(vocab, max_abs_logit, u) + u * (2 * max_abs_logit + math.log(vocab))


def token_kl_error(student_logits: torch.Tensor, teacher_logits: torch.Tensor, u: float = U32) -> torch.Tensor:
    """Bound on the error of ``fedopd.distill.opd.token_reverse_kl`` (fp32) per position, from the logits given.

    KL = Σ p·(s − t) with s, t fp32 log-softmax (errors e_s, e_t from :func:`log_softmax_error`)
    and p = exp(s) (relative error e_s + 2u). With A = Σ p|s − t| (computed here in float64):
        |ΔKL| ≤ (e_s + e_t)            [p·(Δs − Δt), Σp = 1]
              + (e_s + 2u)·A           [Δp·(s − t)]
              + (2u + sum_error(V))·A  [subtraction, product and the sum over V]
    """
    s64 = torch.log_softmax(student_logits.double(), -1)
    t64 = torch.log_softmax(teacher_logits.double(), -1)
    a = (s64.exp() * (s64 - t64).abs()).sum(-1)
    v = student_logits.shape[-1]
    e_s = log_softmax_error(v, float(student_logits.abs().max()), u)
    e_t = log_softmax_error(v, float(teacher_logits.abs().max()), u)
    return (e_s + e_t) + (e_s + 2 * u) * a + (2 * u + sum_error(v, u)) * a


def gradient_error(g: torch.Tensor, roundings: int, u: float = U32) -> float:
    """Absolute error of one evaluation of a gradient tensor g, on the scale of max|g|.

    Statistical bound over the ``roundings`` on the path from the inputs to g (forward and
    backward reductions), SIGMAS·u·sqrt(roundings/3)·max|g|, assuming no heavy cancellation in
    the sums that form g (Σ|contributions| ≈ max|g|).
    """
    return SIGMAS * u * math.sqrt(roundings / 3.0) * float(g.abs().max())


# ---------------------------------------------------------------------------------------------
# Model forwards
# ---------------------------------------------------------------------------------------------


def forward_roundings(config, seq_len: int, lora_rank: int = 0) -> int:
    """Roundings n on the path from the input to one logit of a (Qwen3-style) decoder, in fp32.

    Each length-k reduction on the path counts k (its k rounding errors, each at most the scale
    of the result); LoRA adds its rank-r second matmul after A·x (over H, run beside W·x):
      per layer: RMSNorm H + q/k/v proj H + r + q/k-norm d + QKᵀ d + softmax T + P·V T
                 + o_proj (heads·d) + r + RMSNorm H + gate/up H + r + down I + r + elementwise 8
      then the final RMSNorm H and the head H.
    Tiny student (H 64, I 192, d 16, 4 heads, L 2, r 8, T = 17): 1364; tiny teacher (H 128,
    I 384, d 32, L 3, T = 17): 3646.
    """
    h, i = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    r = lora_rank
    per_layer = h + h + r + 2 * d + 2 * seq_len + heads * d + r + h + h + r + i + r + ELEMENTWISE_PER_LAYER
    return config.num_hidden_layers * per_layer + 2 * h


def logit_scale(lm) -> float:
    """A priori bound on Σ_i |h_i·w_vi| for a logit v (Cauchy–Schwarz): ||h||·max_v ||w_v||.

    h is the final RMSNorm's output, γ ⊙ x/rms(x), so ||h|| ≤ sqrt(H)·max|γ|; w_v the head's rows.
    Also a bound on max|logit|. Tiny student: 8 · 0.2 ≈ 1.6; tiny teacher: 11.3 · 1.1 ≈ 12.5.
    """
    causal = lm.causal_lm
    norm = causal.model.norm.weight.detach().float()
    head = causal.get_output_embeddings().weight[: lm.logit_width].detach().float()
    return math.sqrt(causal.config.hidden_size) * float(norm.abs().max()) * float(head.norm(dim=-1).max())


def lora_rank(lm) -> int:
    peft_config = getattr(lm.model, "peft_config", None)
    return int(peft_config["default"].r) if peft_config else 0


def logit_error(lm, seq_len: int, u: float = U32) -> float:
    """Absolute error of one fp32 logit of ``lm`` (one evaluation order vs exact arithmetic).

        δ = SIGMAS · u · sqrt(n/3) · S,  n = forward_roundings, S = logit_scale
    Tiny student with LoRA: 5 · 5.96e-8 · sqrt(1364/3) · 1.62 ≈ 1.0e-5; tiny teacher:
    5 · 5.96e-8 · sqrt(3646/3) · 12.5 ≈ 1.3e-4.
    """
    n = forward_roundings(lm.causal_lm.config, seq_len, lora_rank(lm))
    return SIGMAS * u * math.sqrt(n / 3.0) * logit_scale(lm)


def lse_error(lm, u: float = U32) -> float:
    """:func:`logsumexp_error` over ``lm``'s vocabulary, with max|logit| ≤ logit_scale."""
    return logsumexp_error(lm.logit_width, logit_scale(lm), u)


def coarse_log_prob_pair_error(logit_err: float, lse_err: float) -> float:
    """|Δ log q̃| between two fp32 evaluations of ``coarsen_logits`` (one logit error δ each).

    Kept entries log q̃_i = z_i − T: |Δz_i| ≤ 2δ (pair), |ΔT| ≤ 2δ (logsumexp is 1-Lipschitz in
    the max norm) + 2ε (T rounded in each evaluation). The tail log q̃ = O − T (O the logsumexp
    outside S, also rounded): 2δ + 2δ + 4ε. So max |Δ log q̃| ≤ 4δ + 4ε. Probabilities (≤ 1)
    move by at most the same amount in absolute terms, the tail included (|Δ tail| ≤ Σ|Δ kept|).
    """
    return 2 * PAIR * logit_err + 4 * lse_err


def coarse_kl_pair_error(kl_value: float, logit_err: float, lse_err: float) -> float:
    """|ΔKL(p̃ ‖ q̃)| between two fp32 evaluations of q̃ (p̃ fixed), mean over positions or one position.

    With e = Δz (|e| ≤ 2δ) and q the full softmax, to first order
        ΔKL = Σ_i (q_i − p̂_i)·e_i − ΔT_round + p̃_tail·ΔO_round
    (p̂ = p̃ with the tail spread over the outside ids like q), so
        |ΔKL| ≤ ||q̃ − p̃||₁ · 2δ + 2ε·(1 + p̃_tail) ≤ ||q̃ − p̃||₁ · 2δ + 4ε,
    and by Pinsker ||q̃ − p̃||₁ ≤ sqrt(2·KL) (a mean over positions: Jensen), plus the rounding of
    q̃ itself (:func:`coarse_log_prob_pair_error`) for KL ≈ 0. The float64 KL adds ~1e-15.
    """
    l1 = math.sqrt(2 * max(kl_value, 0.0)) + coarse_log_prob_pair_error(logit_err, lse_err)
    return l1 * PAIR * logit_err + 4 * lse_err


def opd_loss_error(student, teacher, seq_len: int, loss: float, tokens: int, u: float = U32) -> float:
    """Absolute error of one fp32 evaluation of the OPD loss (token mean of KL(p_θ ‖ q)).

    Per token, with log-probability errors a_s = 2δ_s + ε_s, a_t = 2δ_t + ε_t (δ logit errors of
    :func:`logit_error`, ε log-softmax roundings), KL = Σ p·r, r = log p − log q:
        |ΔKL| ≤ a_s + a_t + (a_s + 2u)·Σp|r| + (2u + sum_error(V))·Σp|r|,
    and Σp|r| ≤ KL + 2 (the negative part of r: Σp·(log q/p)⁺ ≤ Σ(q − p)⁺ ≤ 1). Averaged over
    tokens (the bound is affine in KL, so the loss can stand in for KL), plus the token mean:
    sum_error(tokens)·loss + u·loss.
    """
    v = student.logit_width
    a_s = 2 * logit_error(student, seq_len, u) + log_softmax_error(v, logit_scale(student), u)
    a_t = 2 * logit_error(teacher, seq_len, u) + log_softmax_error(v, logit_scale(teacher), u)
    spread = loss + 2.0
    per_token = a_s + a_t + (a_s + 2 * u) * spread + (2 * u + sum_error(v, u)) * spread
    return per_token + (sum_error(tokens, u) + u) * loss


def model_gradient_roundings(lm, seq_len: int, tokens: int) -> int:
    """Roundings on the path to a LoRA-factor gradient: the forward, a backward of twice its
    reductions (dX = dY·W and dW = dYᵀX per matmul), the vocabulary sums of the loss, and the
    sum over the tokens of the batch."""
    return 3 * forward_roundings(lm.causal_lm.config, seq_len, lora_rank(lm)) + 3 * lm.logit_width + tokens


def opd_gradient_error(g: torch.Tensor, student, teacher, seq_len: int, loss: float, tokens: int, u: float = U32) -> float:
    """Absolute error of one fp32 evaluation of an OPD gradient tensor g (LoRA factor), scale max|g|.

    Two sources: the roundings on the student's path (:func:`gradient_error` over
    :func:`model_gradient_roundings`), and the log-probability errors a_s + a_t of
    :func:`opd_loss_error`, which perturb each token's signal p⊙(r − KL) by at most
    2(a_s + a_t)·p; relative to that signal, whose size E_p|r − KL| is of the order of the KL
    (≈ 0.7 against a loss ≈ 0.43 on the tiny pair), the loss stands in for it:
        |Δg| ≤ max|g|·[SIGMAS·u·sqrt(n/3) + 2(a_s + a_t)/loss].
    """
    v = student.logit_width
    a_s = 2 * logit_error(student, seq_len, u) + log_softmax_error(v, logit_scale(student), u)
    a_t = 2 * logit_error(teacher, seq_len, u) + log_softmax_error(v, logit_scale(teacher), u)
    rounding = gradient_error(g, model_gradient_roundings(student, seq_len, tokens), u)
    return rounding + float(g.abs().max()) * 2 * (a_s + a_t) / max(loss, 1e-12)


# ---------------------------------------------------------------------------------------------
# bf16 models (the tests marked gpu: on CUDA where there is one, and on the CPU in bf16)
# ---------------------------------------------------------------------------------------------

# bf16 roundings per decoder layer on the path to the final hidden state. A bf16 model (transformers'
# Qwen3) runs every op with fp32 accumulation and rounds its *output* to bf16 (|δ| ≤ u_bf16):
#   input RMSNorm 2 (x/rms(x) rounded, then γ times it), q/k/v projections 3, q and k RMSNorms 2 + 2,
#   rotary 8 (cos and sin rounded, q·cos, rotate(q)·sin, their sum, the same for k), attention 4
#   (scores, their scaling, softmax, P·V), o_proj 1, residual add 1, post-attention RMSNorm 2,
#   gate and up projections 2, SiLU 1, gate·up 1, down projection 1, residual add 1.
BF16_ROUNDINGS_PER_LAYER = 31
FINAL_NORM_ROUNDINGS = 2  # the final RMSNorm, as above; its output h feeds the fp32 head


def adapted_projections(lm) -> int:
    """Projections per layer that carry a LoRA adapter (0 without one): PEFT adds the fp32 low-rank
    term to the bf16 base output and rounds the sum to bf16, one more rounding each."""
    peft_config = getattr(lm.model, "peft_config", None)
    return len(peft_config["default"].target_modules) if peft_config else 0


def bf16_roundings(lm) -> int:
    """bf16 roundings on the path from the input to the final hidden state h of ``lm`` in bf16:
    L·(BF16_ROUNDINGS_PER_LAYER + adapted projections) + FINAL_NORM_ROUNDINGS.
    Tiny student with its rank-8 adapter on 7 projections: 2·(31 + 7) + 2 = 78; tiny teacher: 3·31 + 2 = 95."""
    config = lm.causal_lm.config
    return config.num_hidden_layers * (BF16_ROUNDINGS_PER_LAYER + adapted_projections(lm)) + FINAL_NORM_ROUNDINGS


def hidden_norm(lm) -> float:
    """A priori bound on ||h|| for the final hidden state h = γ ⊙ x/rms(x): ||x/rms(x)|| = sqrt(H),
    so ||h|| ≤ sqrt(H)·max|γ| (the factor of :func:`logit_scale`). Tiny student: 8."""
    causal = lm.causal_lm
    return math.sqrt(causal.config.hidden_size) * float(causal.model.norm.weight.detach().float().abs().max())


def hidden_error_bf16(lm, seq_len: int) -> float:
    """Bound on ||ĥ − h||, the error of the final hidden state of one bf16 evaluation of ``lm``.

    The model of the fp32 bounds above, with bf16's u at the n_b = :func:`bf16_roundings` stage
    outputs: gain 1 (a stage's relative rounding, |δ| ≤ u_bf16 entrywise, moves h by at most
    u_bf16·||h||), the n_b roundings independent and mean zero: SIGMAS·u_bf16·sqrt(n_b/3)·||h||.
    Inside the stages the fp32 accumulations (tensor cores may truncate: 2u per addition, not mean
    zero) add at most γ(n, 2u32) relative, n = :func:`forward_roundings`, worst case:
        Δh ≤ (SIGMAS·u_bf16·sqrt(n_b/3) + n·2u32/(1 − n·2u32))·sqrt(H)·max|γ|
    Tiny student with LoRA (T = 17): (5·2^-8·sqrt(78/3) + 1.6e-4)·8 ≈ (0.0996 + 0.0002)·8 ≈ 0.80,
    a relative error of 10 %. A check of the model, not its source: bf16 forwards of the four
    built-in models (no adapter) against float64 forwards of the same weights, 240 positions each,
    have max ||Δh|| at 8 % (tiny student), 21 % (tiny teacher), 11 % (sandbox student) and 44 %
    (sandbox teacher) of this bound.
    """
    n32 = forward_roundings(lm.causal_lm.config, seq_len, lora_rank(lm))
    return (SIGMAS * UBF16 * math.sqrt(bf16_roundings(lm) / 3.0) + truncating_sum_error(n32)) * hidden_norm(lm)


def head_rows(lm) -> torch.Tensor:
    """The LM head's rows w_v (V, H) in float64, the compared width only."""
    return lm.causal_lm.get_output_embeddings().weight[: lm.logit_width].detach().double().cpu()


def head_rounding(lm) -> float:
    """|r_v|, the rounding of one logit by the fp32 head (:func:`fedopd.models.fp32_head`) on bf16 h and
    W: products exact in fp32, the H-term sum accumulated in fp32, on tensor cores possibly
    truncating, so the worst case with 2u per addition: γ(H, 2u32)·Σ|h_i w_vi| ≤ γ(H, 2u32)·logit_scale.
    Tiny student: 64·2^-23·1.62 ≈ 1.2e-5."""
    return truncating_sum_error(lm.causal_lm.config.hidden_size) * logit_scale(lm)


def truncating_sum_error(n: int, u: float = U32) -> float:
    """Relative error (w.r.t. Σ|terms|) of an n-term fp32 sum on CUDA tensor cores, which accumulate
    in fp32 but may truncate (Fasi et al., PeerJ CS 2021): not mean zero, so only the worst case,
    with one ulp (2u) per addition: γ(n, 2u) = n·2u/(1 − n·2u)."""
    return n * 2 * u / (1 - n * 2 * u)


def head_sum_error(n: int, device_type: str) -> float:
    """Relative error of one logit of :func:`fedopd.models.fp32_head` on bf16 values over n terms
    (the products are exact in fp32): on the CPU an fp32 sum rounded to nearest, :func:`sum_error`;
    on CUDA TF32 tensor cores, :func:`truncating_sum_error`."""
    return truncating_sum_error(n) if device_type == "cuda" else sum_error(n)


def bennett(b: float) -> float:
    """ψ(b) = (e^b − 1 − b)/b², with e^x ≤ 1 + x + ψ(b)·x² for every x ≤ b ((e^x − 1 − x)/x² is
    increasing in x). ψ → 1/2 as b → 0."""
    return (math.expm1(b) - b) / b**2 if b > 1e-4 else 0.5 + b / 6.0


def head_spread(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """sqrt(λ_max(Cov_p(w))) per distribution: the largest standard deviation, under p (..., V), of
    a projection u·w_v of the head rows (V, H) onto a unit vector u. Float64."""
    p = p.double()
    mean = p @ rows
    second = (rows.T * p[..., None, :]) @ rows  # Σ_v p_v w_v w_vᵀ, one batched GEMM
    cov = second - mean[..., :, None] * mean[..., None, :]
    return torch.linalg.eigvalsh(cov)[..., -1].clamp_min(0.0).sqrt()


def logit_shift_kl(p: torch.Tensor, rows: torch.Tensor, dh: float, r: float) -> torch.Tensor:
    """Bound on KL(p ‖ q) per distribution when q's logits are p's plus e = W·Δh + Δr, ||Δh|| ≤ dh,
    |Δr_v| ≤ r (two evaluations of one distribution whose final hidden states differ by Δh and whose
    heads round differently by Δr).

    Proof. q = p·e^e / E_p[e^e], so KL(p ‖ q) = log E_p[e^X] with X = e − E_p[e], E_p[X] = 0.
    X ≤ b := max e − min e ≤ 2·e_max, e_max = max_v ||w_v||·dh + r (Cauchy–Schwarz). By
    :func:`bennett`, E_p[e^X] ≤ 1 + ψ(b)·Var_p(X), and log(1 + y) ≤ y:
        KL(p ‖ q) ≤ ψ(b)·Var_p(e),
    Var_p(e) ≤ (sd_p(W·Δh) + sd_p(Δr))² ≤ (sqrt(λ_max(Cov_p(w)))·dh + r)²
    (Δhᵀ Cov_p(w) Δh ≤ λ_max·||Δh||²). Second order in dh, unlike the max-norm bound
    KL ≤ (2·e_max)²/8 (Hoeffding's lemma), which is larger by about max||w_v||²/λ_max.
    Coarsening both onto S and a tail cannot increase a KL (data processing), so the bound holds
    for KL(p̃ ‖ q̃) of the coarsened pair too.
    """
    e_max = float(rows.norm(dim=-1).max()) * dh + r
    return bennett(2 * e_max) * (head_spread(p, rows) * dh + r) ** 2


def logit_shift_e_max(rows: torch.Tensor, dh: float, r: float) -> float:
    """max_v |e_v| for e = W·Δh + Δr, ||Δh|| ≤ dh, |Δr| ≤ r: max_v ||w_v||·dh + r."""
    return float(rows.norm(dim=-1).max()) * dh + r


def coarse_rounding_kl(lse_err: float, e_max: float) -> float:
    """What the fp32 logsumexps of ``coarsen_logits`` add to a KL of two coarsened distributions.

    Each evaluation's coarse entries are exp(z − T̂) (kept) and exp(Ô − T̂) (tail), T̂ and Ô off by
    at most ε = lse_err: the computed entries are the exact ones times e^α, |α| ≤ 2ε. With
    ℓ = log(p̃/q̃) of the exact pair (|ℓ| ≤ 2·e_max: z and each logsumexp move by at most e_max),
        Σ p̂·log(p̂/q̂) ≤ Σ p̂·ℓ + e^{2ε}·4ε ≤ KL(p̃ ‖ q̃) + expm1(2ε)·2·e_max + e^{2ε}·4ε.
    The float64 KL itself adds ~1e-15.
    """
    return math.expm1(2 * lse_err) * 2 * e_max + math.exp(2 * lse_err) * 4 * lse_err


def coarse_rounding_kl_change(lse_err: float, e_max: float) -> float:
    """What the fp32 logsumexps of ``coarsen_logits`` add to KL(p̃ ‖ q̃₁) − KL(p̃ ‖ q̃₂), p̃ a fixed
    cached row: each q̂ is the exact coarsening times e^β, |β| ≤ 2ε, so Σ p̂·log(q̂₂/q̂₁) moves by at
    most Σp̂·4ε ≤ e^{2ε}·4ε; and p̂ itself sums to 1 within expm1(2ε), which scales the common
    shift T₂ − T₁ (|T₂ − T₁| ≤ e_max) of the proof of :func:`kl_change_from_logit_shift`."""
    return math.exp(2 * lse_err) * 4 * lse_err + math.expm1(2 * lse_err) * e_max


def kl_change_from_logit_shift(
    p_coarse: torch.Tensor, q_coarse: torch.Tensor, q_full: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor, dh: float, r: float
) -> torch.Tensor:
    """Bound on |KL(p̃ ‖ q̃₁) − KL(p̃ ‖ q̃₂)| per position: p̃ fixed (a cached row), q̃₁ = ``q_coarse``
    the coarsening of q = ``q_full`` on ``token_ids`` (−1: padding), q̃₂ that of q's logits plus
    e = W·Δh + Δr (||Δh|| ≤ dh, |Δr_v| ≤ r).

    Proof. With ẽ the coarse log-shift (e_i on kept ids, ẽ_tail = O₂ − O₁ the move of the logsumexp
    outside S, |ẽ_tail| ≤ e_max) and T₂ − T₁ = log E_q[e^e] (exactly log E_q̃₁[e^ẽ]),
        KL(p̃ ‖ q̃₁) − KL(p̃ ‖ q̃₂) = E_p̃[ẽ] − (T₂ − T₁)
                                  = (E_p̃ − E_q̃₁)[ẽ] − (T₂ − T₁ − E_q̃₁[ẽ]).
    The last bracket is ≥ 0 (Jensen on S and the tail) and ≤ log E_q[e^e] − E_q[e] (ẽ_tail ≥ the
    q-mean of e outside S, Jensen) ≤ ψ(2·e_max)·Var_q(e) as in :func:`logit_shift_kl`. The first:
        |Σ_S (p̃_i − q̃_i)(w_i·Δh + Δr_i) + (p̃_t − q̃_t)·ẽ_tail|
            ≤ ||Σ_S (p̃_i − q̃_i)·w_i||·dh + Σ_S |p̃_i − q̃_i|·r + |p̃_t − q̃_t|·e_max.
    First order in dh only through the mean head row of p̃ against that of q̃₁.
    """
    p_coarse, q_coarse = p_coarse.double(), q_coarse.double()
    kept = token_ids >= 0
    diff = (p_coarse[..., :-1] - q_coarse[..., :-1]) * kept
    w = rows[token_ids.clamp_min(0)] * kept[..., None]  # (N, k, H)
    mean_shift = torch.einsum("nk,nkh->nh", diff, w).norm(dim=-1)
    e_max = logit_shift_e_max(rows, dh, r)
    first = mean_shift * dh + diff.abs().sum(-1) * r + (p_coarse[..., -1] - q_coarse[..., -1]).abs() * e_max
    second = bennett(2 * e_max) * (head_spread(q_full, rows) * dh + r) ** 2
    return first + second
