"""Held-out evaluation of an adapter on a client's held-out prompts: greedy accuracy, Avg@k and
Pass@k at the paper's evaluation sampling, graded by math-verify. The client's ``evaluate``
handler, ``python -m eval.sandbox`` and ``python -m eval.source_swap`` call it; it imports nothing from ``eval/``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from fedopd.core.settings import EvalSettings
from fedopd.data import Prompt
from fedopd.data.grading import is_correct
from fedopd.engine.metrics import avg_at_k, pass_at_k
from fedopd.rollout import Rollouts, SamplingParams


def heldout_correctness(
    models,
    theta: Mapping[str, np.ndarray],
    prompts: Sequence[Prompt],
    settings: EvalSettings,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, Rollouts]:
    """Per-problem grades of the adapter ``theta``: greedy (n,), sampled (n, k), and the greedy rollouts.

    Greedy decoding, then ``settings.samples`` responses per prompt at the paper's evaluation
    sampling (temperature, top-p, seeded); graded by math-verify.
    """
    if not prompts:
        raise ValueError("held-out evaluation: the client has no held-out prompts")
    k = settings.samples
    greedy_ok, greedy = greedy_correctness(models, theta, prompts, settings.max_new_tokens)
    ids = [p.token_ids for p in prompts]
    sampled = models.rollout.generate(
        [p for p in ids for _ in range(k)], SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p, seed)
    )
    texts = models.student.tokenizer.batch_decode(sampled.response_ids, skip_special_tokens=True)
    correct = np.asarray([is_correct(t, prompts[i // k].answer) for i, t in enumerate(texts)], dtype=np.float64)
    return greedy_ok, correct.reshape(len(prompts), k), greedy


def greedy_correctness(models, theta: Mapping[str, np.ndarray], prompts: Sequence[Prompt], max_new_tokens: int) -> tuple[np.ndarray, Rollouts]:
    """Per-problem greedy grades (n,) of the adapter ``theta`` and its greedy rollouts."""
    models.rollout.set_adapter(theta)
    greedy = models.rollout.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens, temperature=0.0))
    texts = models.student.tokenizer.batch_decode(greedy.response_ids, skip_special_tokens=True)
    return np.asarray([is_correct(t, p.answer) for t, p in zip(texts, prompts)], dtype=np.float64), greedy


def heldout_scores(greedy_ok: np.ndarray, correct: np.ndarray) -> dict[str, float]:
    """Greedy ``accuracy``, Avg@k and Pass@k (percent) of per-problem grades: greedy (n,), sampled (n, k)."""
    k = np.shape(correct)[1]
    return {"accuracy": 100.0 * float(np.mean(greedy_ok)), f"avg@{k}": avg_at_k(correct), f"pass@{k}": pass_at_k(correct)}


def evaluate_heldout(
    models,
    theta: Mapping[str, np.ndarray],
    prompts: Sequence[Prompt],
    settings: EvalSettings,
    seed: int,
) -> dict[str, float]:
    """Held-out metrics of the adapter ``theta`` (percent): greedy ``accuracy``, Avg@k and Pass@k."""
    t0 = time.perf_counter()
    greedy_ok, correct, greedy = heldout_correctness(models, theta, prompts, settings, seed)
    return {
        **heldout_scores(greedy_ok, correct),
        "response_length": float(greedy.response_lengths.mean()),
        "cap_hit_rate": 100.0 * greedy.cap_hit_rate,
        "eval_s": time.perf_counter() - t0,
    }
