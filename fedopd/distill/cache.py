"""Scoring cache and candidate scores (paper, Algorithm 1 and App. "Trajectory cache").

Before any optimizer step a client keeps, for ``cache.rollouts`` of its rollouts and at most
``cache.positions`` evenly spaced response positions in each, the teacher's and the starting
student's probabilities on S = teacher top-k ∪ student top-k plus one tail bucket (full-softmax
probabilities, not renormalized). A candidate θ_t + aΔ is then scored on the same prefixes with
the same S:

    Ĵ_i(a) = mean KL(q̃ ‖ π̃_{t,a}),     K̂_i(a) = mean KL(π̃_t ‖ π̃_{t,a}).

The first half of this module is pure tensor math; :func:`build_scoring_cache` and
:func:`score_candidates` run the student through :mod:`fedopd.models`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np
import torch

from fedopd.models.lora import apply_increment, name_mismatch

# ---------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------


def coarsen(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Coarsen full distributions onto retained ids plus one tail bucket.

    probs: (..., V) full-softmax probabilities. token_ids: (..., k) int64, ``-1`` = padding.
    Returns (..., k+1): ``probs`` at the ids (0 at padding), then the tail ``1 − Σ`` clamped at 0.
    The retained entries are not renormalized.
    """
    pad = token_ids < 0
    kept = probs.gather(-1, token_ids.clamp_min(0)).masked_fill(pad, 0.0)
    tail = (1.0 - kept.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([kept, tail], dim=-1)


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last dimension, with 0·log 0 = 0 (and +inf where q = 0 < p).

    Never negative: rounding-level negatives, as for two numerically identical
    distributions, are clamped to 0.
    """
    return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1).clamp_min(0.0)


def coarsen_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``coarsen(softmax(logits), token_ids)`` in float64, with the tail computed from the logits.

    logits: (..., V), any float dtype (upcast to fp32 first). token_ids: (..., k), ``-1`` = padding.
    Returns float64 (..., k+1). The retained probabilities are ``exp(logit − logsumexp)`` and the
    tail is ``exp(logsumexp over the ids outside S − logsumexp)``: mathematically the same
    ``1 − Σ_S p`` as :func:`coarsen`, but it does not round to 0 when the retained mass is within
    fp32 rounding of 1 (a KL against a zero tail would be infinite).
    """
    logits = logits.float()
    total = torch.logsumexp(logits, dim=-1, keepdim=True)
    pad = token_ids < 0
    safe = torch.where(pad, token_ids[..., :1].clamp_min(0), token_ids)  # padding -> an id already in S
    kept = torch.exp(logits.gather(-1, safe).double() - total.double()).masked_fill(pad, 0.0)
    outside = logits.scatter(-1, safe, float("-inf"))
    tail = torch.exp(torch.logsumexp(outside, dim=-1, keepdim=True).double() - total.double())
    return torch.cat([kept, tail], dim=-1)


def union_top_k(first: torch.Tensor, second: torch.Tensor, k: int) -> torch.Tensor:
    """Per position, the union of the top-``k`` ids of two score tensors (..., V).

    Returns (..., 2k) int64: the union sorted ascending, duplicates replaced by ``-1`` padding,
    padding moved to the end.
    """
    ids = torch.cat([first.topk(k, dim=-1).indices, second.topk(k, dim=-1).indices], dim=-1)
    ids, _ = ids.sort(dim=-1)
    dup = torch.zeros_like(ids, dtype=torch.bool)
    dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = ids.masked_fill(dup, -1)
    # Stable sort on "is padding" moves -1 to the end and keeps the ascending order of the rest.
    order = torch.sort(dup.to(torch.int8), dim=-1, stable=True).indices
    return ids.gather(-1, order)


def cache_positions(response_length: int, max_positions: int) -> np.ndarray:
    """At most ``max_positions`` evenly spaced response positions in [0, response_length).

    Position j means "the distribution that predicts response token j". Deterministic: the first
    and the last response token are always included when there are at least two.
    """
    if response_length <= 0:
        return np.zeros(0, dtype=np.int64)
    if response_length <= max_positions:
        return np.arange(response_length, dtype=np.int64)
    return np.unique(np.round(np.linspace(0, response_length - 1, max_positions)).astype(np.int64))


def choose_cache_rollouts(num_rollouts: int, num_cached: int, seed: int) -> np.ndarray:
    """Indices of the rollouts to cache: ``num_cached`` of ``num_rollouts`` at random, sorted."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_rollouts, size=min(num_cached, num_rollouts), replace=False))


# ---------------------------------------------------------------------------------------------
# The cache and candidate scoring
# ---------------------------------------------------------------------------------------------


@dataclass
class ScoringCache:
    """What a client keeps between its ``train`` reply and the ``query.score`` message.

    input_ids:      (R, L) int64, the cached prompt+response sequences, right-padded with 0.
    attention_mask: (R, L) int64.
    positions:      (N, 2) int64 rows of (sequence index, index in the sequence whose next-token
                    distribution is scored).
    token_ids:      (N, 2k) int64 retained ids S per position, -1 = padding.
    teacher:        (N, 2k+1) float64 coarsened teacher probabilities q̃.
    student:        (N, 2k+1) float64 coarsened starting-student probabilities π̃_t.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    teacher: np.ndarray
    student: np.ndarray

    @property
    def num_positions(self) -> int:
        return int(self.positions.shape[0])

    def teacher_score_at_start(self) -> float:
        """Mean KL(q̃ ‖ π̃_t): Ĵ_i(0) by construction."""
        return float(kl(torch.from_numpy(self.teacher).double(), torch.from_numpy(self.student).double()).mean())

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> ScoringCache:
        return cls(**{f.name: np.asarray(arrays[f.name]) for f in fields(cls)})


def build_scoring_cache(student, teacher, rollouts, settings, seed: int, teacher_hidden: torch.Tensor | None = None) -> ScoringCache:
    """Pick cached rollouts and positions, and store q̃ and π̃_t on S (before any optimizer step).

    ``student`` and ``teacher`` are :class:`fedopd.models.CausalLM` objects, the student holding
    θ_t; ``rollouts`` a :class:`fedopd.rollout.Rollouts`; ``settings`` a
    :class:`fedopd.config.CacheSettings`. ``teacher_hidden``: the teacher's final hidden states at
    every response position of every rollout, packed in rollout order (N_total, H), as the round's
    teacher pass computed them; the cache's teacher rows are then taken from it (the teacher runs
    once per rollout per round). Without it, the teacher runs on the cached rollouts here.
    """
    chosen = choose_cache_rollouts(len(rollouts), settings.rollouts, seed)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rollouts.response_ids])])
    seqs, positions, rows = [], [], []
    for r, idx in enumerate(chosen):
        prompt, response = rollouts.prompt_ids[idx], rollouts.response_ids[idx]
        seqs.append(list(prompt) + list(response))
        for j in cache_positions(len(response), settings.positions):
            positions.append((r, len(prompt) - 1 + int(j)))
            rows.append(int(offsets[idx]) + int(j))
    if not positions:
        raise ValueError("scoring cache: every cached rollout has an empty response")
    width = max(len(s) for s in seqs)
    input_ids = np.zeros((len(seqs), width), dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for r, s in enumerate(seqs):
        input_ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    positions = np.asarray(positions, dtype=np.int64)

    with torch.no_grad():
        if teacher_hidden is None:
            t_logits = _logits_at(teacher, input_ids, mask, positions)
        else:
            if teacher_hidden.shape[0] != offsets[-1]:
                raise ValueError(f"teacher_hidden has {teacher_hidden.shape[0]} rows, the rollouts {offsets[-1]} response tokens")
            t_logits = teacher.logits(teacher_hidden[torch.as_tensor(rows, device=teacher_hidden.device)])
        s_logits = _logits_at(student, input_ids, mask, positions)
        t_logits = t_logits.to(s_logits.device)
        token_ids = union_top_k(t_logits, s_logits, settings.top_k)
        q = coarsen_logits(t_logits, token_ids)
        p = coarsen_logits(s_logits, token_ids)
    return ScoringCache(
        input_ids=input_ids,
        attention_mask=mask,
        positions=positions,
        token_ids=token_ids.cpu().numpy(),
        teacher=q.cpu().numpy(),
        student=p.cpu().numpy(),
    )


def coarse_student(student, cache: ScoringCache) -> torch.Tensor:
    """π̃ of the student's current weights at the cached prefixes, (N, 2k+1) float64 on the model's device."""
    with torch.no_grad():
        logits = _logits_at(student, cache.input_ids, cache.attention_mask, cache.positions)
        return coarsen_logits(logits, torch.from_numpy(cache.token_ids).to(logits.device))


def candidate_scores(cache: ScoringCache, candidate: torch.Tensor, *, with_se: bool = False) -> tuple[float, ...]:
    """(Ĵ_i, K̂_i) of one candidate's coarsened distributions π̃_{t,a} against the cache:

    Ĵ_i(a) = mean over cached positions of KL(q̃ ‖ π̃_{t,a})  (teacher agreement),
    K̂_i(a) = mean over cached positions of KL(π̃_t ‖ π̃_{t,a}) (predictive change).
    Both are >= 0 (clamped at 0 against rounding). ``with_se``: also the standard error of Ĵ_i(a),
    the sample standard deviation of the per-position KLs over √(positions) (inf for one position).
    """
    candidate = candidate.double()
    q = torch.from_numpy(cache.teacher).to(candidate.device, torch.float64)
    p = torch.from_numpy(cache.student).to(candidate.device, torch.float64)
    per_position = kl(q, candidate)
    teacher_score = per_position.mean().clamp_min(0.0)
    change_score = kl(p, candidate).mean().clamp_min(0.0)
    if not with_se:
        return float(teacher_score), float(change_score)
    n = per_position.numel()
    se = float(per_position.std(unbiased=True)) / math.sqrt(n) if n > 1 else math.inf
    return float(teacher_score), float(change_score), se


def score_candidates(
    student,
    cache: ScoringCache,
    theta: Mapping[str, np.ndarray],
    increment: Mapping[str, np.ndarray],
    multipliers: Sequence[float],
    *,
    batched: bool = True,
    candidates_per_pass: int | None = None,
    with_se: bool = False,
) -> tuple[list[float], ...]:
    """Ĵ_i(a) and K̂_i(a) for each multiplier a, the student's LoRA at θ_t + aΔ (``with_se``: and
    the standard error of each Ĵ_i(a), :func:`candidate_scores`).

    ``batched`` (default): the candidates are scored together, their cached sequences stacked on
    the batch dimension with each candidate's factors (:func:`stacked_factors`),
    ``candidates_per_pass`` candidates per forward pass (None: all). The LM head runs only at the
    cached positions, and softmax, S and the tail are computed on the model's device. Otherwise
    one forward per candidate through the trained adapter (the reference path; it leaves that
    adapter at the last candidate, so callers load the factors they need before their next use).
    The batched path leaves the adapter untouched.
    """
    if not batched:
        rows = []
        for a in multipliers:
            student.set_lora_arrays(apply_increment(theta, increment, a))
            rows.append(candidate_scores(cache, coarse_student(student, cache), with_se=with_se))
        return tuple(list(column) for column in zip(*rows))

    per_pass = max(1, candidates_per_pass or len(multipliers))
    token_ids = torch.from_numpy(cache.token_ids)
    n = cache.num_positions
    rows = []
    for start in range(0, len(multipliers), per_pass):
        group = [apply_increment(theta, increment, a) for a in multipliers[start : start + per_pass]]
        with torch.no_grad():
            logits = _logits_at(student, cache.input_ids, cache.attention_mask, cache.positions, stacked=group)
            coarse = coarsen_logits(logits, token_ids.to(logits.device).repeat(len(group), 1))
        for c in range(len(group)):
            rows.append(candidate_scores(cache, coarse[c * n : (c + 1) * n], with_se=with_se))
    return tuple(list(column) for column in zip(*rows))


def _logits_at(model, input_ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, stacked: Sequence[Mapping[str, np.ndarray]] | None = None):
    """fp32 logits (N, V) at ``positions``, on the model's device (the head runs only there, in fp32).

    ``stacked``: factor sets; the sequences are repeated once per set on the batch dimension, each
    copy under its set, and the result is (len(stacked) · N, V), set-major.
    """
    ids = torch.from_numpy(input_ids).to(model.device)
    att = torch.from_numpy(mask).to(model.device)
    # Nothing after the last scored position influences it (causal attention): cut the batch there.
    width = int(positions[:, 1].max()) + 1
    ids, att = ids[:, :width], att[:, :width]
    pos = torch.from_numpy(positions).to(model.device)
    if stacked is None:
        hidden = model.hidden_states(ids, att)
        return model.logits(hidden[pos[:, 0], pos[:, 1]])
    rows, c = ids.shape[0], len(stacked)
    with stacked_factors(model, stacked):
        hidden = model.hidden_states(ids.repeat(c, 1), att.repeat(c, 1))
    seq = torch.cat([pos[:, 0] + i * rows for i in range(c)])
    return model.logits(hidden[seq, pos[:, 1].repeat(c)])


# ---------------------------------------------------------------------------------------------
# Candidates stacked on the batch dimension
# ---------------------------------------------------------------------------------------------


@contextmanager
def stacked_factors(lm, factor_sets: Sequence[Mapping[str, np.ndarray]]) -> Iterator[None]:
    """Inside this context, a forward of ``lm`` over C·R rows runs rows [c·R, (c+1)·R) under ``factor_sets[c]``.

    Candidate factors stacked on the batch dimension: every LoRA layer computes its base
    projection once for all C·R rows and its low-rank term as two batched matmuls over the C
    factor sets, (C, R·T, in) @ A_cᵀ @ B_cᵀ · scaling, exactly PEFT's arithmetic per set
    (input cast to the factors' fp32, sum rounded to the layer's dtype). Inference only.
    """
    params = lm.factor_parameters()
    for i, factors in enumerate(factor_sets):
        problem = name_mismatch(list(params), list(factors))
        if problem:
            raise ValueError(f"factor set {i} does not match the adapter of '{lm.name}': {problem}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in params.items():
        head, _, _ = name.rpartition(".")  # ...q_proj.lora_A
        path, _, kind = head.rpartition(".")
        stacked = np.stack([np.asarray(f[name], dtype=np.float32) for f in factor_sets])
        modules.setdefault(path, {})[kind] = torch.from_numpy(stacked).to(param.device, param.dtype)
    patched = []
    try:
        for path, factors in modules.items():
            module = lm.model.get_submodule(path)
            module.forward = _stacked_lora_forward(module, factors["lora_A"], factors["lora_B"], module.scaling["default"])
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def _stacked_lora_forward(module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float):
    """A LoRA Linear's forward with C factor sets (C, r, in) and (C, out, r) over C row blocks."""
    a_t, b_t = lora_a.transpose(1, 2).contiguous(), lora_b.transpose(1, 2).contiguous()  # (C, in, r), (C, r, out)

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        xs = x.to(a_t.dtype).reshape(a_t.shape[0], -1, x.shape[-1])
        low_rank = torch.bmm(torch.bmm(xs, a_t), b_t) * scaling
        return (result + low_rank.reshape(result.shape)).to(result.dtype)

    return forward
