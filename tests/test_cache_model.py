"""The scoring cache on the tiny models, against direct forwards (paper App. cache).

Every reference here is a plain transformers forward of the (PEFT-wrapped) model on one unpadded
prefix, with softmax, top-k and coarsening written out in float64 in the test.
"""

import dataclasses

import numpy as np
import pytest
import torch
from devices import on_bf16_devices
from precision import coarse_log_prob_pair_error, head_sum_error, logit_error, logsumexp_error, lse_error

from fedopd.config import CacheSettings
from fedopd.distill.cache import build_scoring_cache
from fedopd.rollout import Rollouts

pytestmark = pytest.mark.slow

PROMPTS = [[258, 70, 71, 72, 73], [258, 80, 81]]
RESPONSES = [[60, 61, 62, 63, 64, 65, 66], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101]]
# cache.positions = 4 evenly spaced response tokens: of 7 -> 0, 2, 4, 6; of 12 -> 0, 4, 7, 11.
RESPONSE_TOKENS = [(0, 0), (0, 2), (0, 4), (0, 6), (1, 0), (1, 4), (1, 7), (1, 11)]
SETTINGS = CacheSettings(rollouts=2, positions=4, top_k=3)


@pytest.fixture()
def lora_student(tiny_pair):
    """The tiny student with random non-zero LoRA factors (so the adapter matters), restored after."""
    student, teacher = tiny_pair
    original = student.get_lora_arrays()
    rng = np.random.default_rng(5)
    student.set_lora_arrays({n: 0.2 * rng.standard_normal(a.shape).astype(np.float32) for n, a in original.items()})
    yield student, teacher
    student.set_lora_arrays(original)


def _next_token_probs(lm, tokens):
    """float64 softmax of the model's logits after ``tokens`` (one unpadded sequence)."""
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return torch.softmax(logits.double()[: lm.logit_width], -1)


def _coarse(probs, ids):
    kept = [probs[i].item() if i >= 0 else 0.0 for i in ids]
    return kept + [1.0 - sum(kept)]


def _row_rtol(lm, width):
    """How far a cached row may be from the reference, relative to each probability.

    Both are fp32 forwards of the same prefix (the cache's padded batch and fp32 head, the
    reference's single unpadded sequence and transformers' head), so |Δ log q̃| ≤ 4δ + 4ε
    (precision.coarse_log_prob_pair_error; the reference's softmax is float64, which only
    helps): each q̃ (the tail included) moves by at most a factor e^(±that). A priori, from H, L,
    V and u: ≈ 6e-5 for the student with its LoRA, ≈ 5e-4 for the teacher (observed: < 2e-6).
    """
    return float(np.expm1(coarse_log_prob_pair_error(logit_error(lm, width), lse_error(lm))))


@pytest.fixture()
def cache_and_refs(lora_student):
    student, teacher = lora_student
    rollouts = Rollouts(PROMPTS, RESPONSES, [False, False])
    cache = build_scoring_cache(student, teacher, rollouts, SETTINGS, seed=0)
    refs = []
    for r, j in RESPONSE_TOKENS:
        prefix = PROMPTS[r] + RESPONSES[r][:j]  # the distribution that predicts response token j
        refs.append((_next_token_probs(teacher, prefix), _next_token_probs(student, prefix)))
    return cache, refs


def test_cached_row_j_is_the_distribution_after_the_prompt_and_j_response_tokens(cache_and_refs, lora_student):
    cache, refs = cache_and_refs
    student, teacher = lora_student
    width = cache.input_ids.shape[1]
    assert cache.num_positions == len(RESPONSE_TOKENS)
    for row, (q, p) in enumerate(refs):
        ids = cache.token_ids[row].tolist()
        assert cache.teacher[row] == pytest.approx(_coarse(q, ids), rel=_row_rtol(teacher, width), abs=0), f"teacher row {row}"
        assert cache.student[row] == pytest.approx(_coarse(p, ids), rel=_row_rtol(student, width), abs=0), f"student row {row}"


def test_retained_set_is_the_union_of_teacher_and_starting_student_top_k(cache_and_refs):
    cache, refs = cache_and_refs
    differ = 0
    for row, (q, p) in enumerate(refs):
        teacher_top = set(torch.topk(q, 3).indices.tolist())
        student_top = set(torch.topk(p, 3).indices.tolist())
        ids = cache.token_ids[row].tolist()
        assert {i for i in ids if i >= 0} == teacher_top | student_top
        assert sum(i >= 0 for i in ids) == len(teacher_top | student_top)  # each id once, rest padding
        differ += teacher_top != student_top
    assert differ > 0  # the two top-k sets differ somewhere, so the union is not one of them


def test_cached_tail_is_one_minus_the_full_softmax_mass_on_s_not_renormalized(cache_and_refs, lora_student):
    cache, refs = cache_and_refs
    rtol = _row_rtol(lora_student[1], cache.input_ids.shape[1])  # the teacher's, as above
    for row, (q, _) in enumerate(refs):
        ids = [i for i in cache.token_ids[row].tolist() if i >= 0]
        assert cache.teacher[row, -1] == pytest.approx(1.0 - q[ids].sum().item(), rel=rtol, abs=0)
        assert cache.teacher[row, -1] > 1e-3  # a real tail: renormalizing S would have dropped it


@on_bf16_devices
def test_cached_probabilities_of_a_bf16_model_come_from_fp32_logits(device):
    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm

    on = torch.device(device)
    student = attach_lora(load_causal_lm("builtin:tiny-student", dtype="bfloat16", device=on), LoraSettings(), seed=0)
    teacher = load_causal_lm("builtin:tiny-teacher", dtype="bfloat16", device=on)
    rollouts = Rollouts([PROMPTS[0]], [RESPONSES[0]], [False])
    cache = build_scoring_cache(student, teacher, rollouts, dataclasses.replace(SETTINGS, rollouts=1), seed=0)

    # The bf16 hidden states of the cache's own forward (the same call on the same inputs), so the
    # two sides differ only in the head.
    width = int(cache.positions[:, 1].max()) + 1
    ids, mask = (torch.from_numpy(a[:, :width]).to(on) for a in (cache.input_ids, cache.attention_mask))
    with torch.no_grad():
        hidden = student.hidden_states(ids, mask)[0]
    hidden, weight = hidden.cpu(), student.causal_lm.get_output_embeddings().weight.cpu()
    fp32_head = torch.softmax(hidden.double() @ weight.double().T, -1)  # the head in high precision
    bf16_head = torch.softmax((hidden @ weight.T).double(), -1)  # bf16 logits, upcast afterwards
    prompt_len = len(PROMPTS[0])
    # What differs is the head. bf16·bf16 products are exact in fp32, so an fp32 logit is off only
    # by its fp32 sum over H terms, e ≤ head_sum_error(H)·Σ|h_i w_vi| (rounded to nearest on the
    # CPU: precision.sum_error; TF32 tensor cores on CUDA may truncate: the worst case). A kept
    # q̃_i = exp(z_i − T) then moves by e + |ΔT| ≤ 2e + ε in log (ε: the fp32 logsumexp T), the
    # tail exp(O − T) by 2e + 2ε (O: the logsumexp outside S).
    logits = hidden.double() @ weight.double().T
    e = head_sum_error(hidden.shape[-1], device) * float((hidden.double().abs() @ weight.double().abs().T).max())
    eps = logsumexp_error(student.logit_width, float(logits.abs().max()))
    rtol = np.expm1([2 * e + eps] * (cache.token_ids.shape[1]) + [2 * e + 2 * eps])
    max_bf16_error = 0.0
    for row, j in enumerate([0, 2, 4, 6]):
        ids = cache.token_ids[row].tolist()
        at = prompt_len - 1 + j
        reference = np.array(_coarse(fp32_head[at], ids))
        assert np.all(np.abs(cache.student[row] - reference) <= rtol * reference), f"row {row}"
        bf16_error = np.abs(cache.student[row] - np.array(_coarse(bf16_head[at], ids))) / np.maximum(reference, 1e-300)
        max_bf16_error = max(max_bf16_error, float((bf16_error / rtol).max()))
    assert max_bf16_error > 10  # bf16 logits would have been told apart: 10x outside this tolerance somewhere
