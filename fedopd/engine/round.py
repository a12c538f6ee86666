"""One client round, named as in the paper: rollouts → teacher → scoring cache → local OPD, and
the candidate scores of the server's query. Flower-free: the ClientApp is a thin shell over
:func:`train_round` and :func:`score_round`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedopd.core.settings import CacheSettings, LoraSettings, RolloutSettings, TrainSettings
from fedopd.data import Prompt, round_indices
from fedopd.data.grading import is_correct
from fedopd.data.prompts import untrained_indices
from fedopd.distill.cache import ScoringCache, build_scoring_cache, score_candidates
from fedopd.distill.opd import hidden_in_rollout_order, local_opd, make_micro_batches, round_plan, teacher_pass, use_packing
from fedopd.engine.heldout import evaluate_heldout, heldout_correctness  # noqa: F401 - re-exported: the old import path
from fedopd.models.load import CausalLM, load_pair
from fedopd.models.positions import engine_context, model_positions
from fedopd.models.vocab import ModelFiles, StopTokens, resolve_stop_tokens
from fedopd.rollout import RolloutEngine, SamplingParams, make_rollout_engine


@dataclass
class ClientModels:
    """The base models of one worker process, shared by every logical client it serves."""

    student: CausalLM  # with a LoRA adapter; its factors are loaded per use
    teacher: CausalLM
    rollout: RolloutEngine
    stop_tokens: StopTokens | None = None  # where the rollout engine ends responses


def load_client_models(
    student: str,
    teacher: str,
    *,
    lora: LoraSettings,
    backend: str,
    dtype: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.3,
    stop_tokens: str = "auto",
    max_num_seqs: int | None = None,
) -> ClientModels:
    """Student (LoRA attached), teacher and the rollout engine for ``backend``.

    Responses end at the pair's stop set (``rollout.stop-tokens``; ``auto``: every EOS id the
    student or the teacher declares, so a Base student stops where the chat turn ends).

    With vLLM, the engine asks for ``gpu_memory_utilization`` of the whole GPU, which must still
    be free after the HF student and teacher are loaded (docs/reproducing-the-paper.md: memory split per card).

    ``max_model_len``: the positions the run needs (``data.max-prompt-tokens`` plus the longer of
    ``rollout.max-new-tokens`` and ``eval.max-new-tokens``), refused if the student or the teacher
    has fewer (:mod:`fedopd.models.positions`); None = the student's own positions.
    """
    s, t = load_pair(student, teacher, lora=lora, seed=seed, dtype=dtype)
    if max_model_len is not None:
        for role, lm in (("model.student", s), ("model.teacher", t)):
            positions, key = model_positions(lm.causal_lm.config)
            if positions is not None and max_model_len > positions:
                raise ValueError(
                    f"this run needs {max_model_len} positions (data.max-prompt-tokens + the longer of rollout.max-new-tokens and "
                    f"eval.max-new-tokens), but {role} '{lm.name}' has {positions} ({key} in its config.json); lower them"
                )
    context = engine_context(s.causal_lm.config, max_model_len)
    stop = resolve_stop_tokens(stop_tokens, ModelFiles.of(s), ModelFiles.of(t))
    engine = make_rollout_engine(
        backend,
        s,
        stop_token_ids=stop.ids,
        max_model_len=context,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        max_num_seqs=max_num_seqs,
    )
    return ClientModels(s, t, engine, stop)


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from (run seed, round, partition id, purpose...): independent streams."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


@dataclass
class TrainOutput:
    arrays: dict[str, np.ndarray]
    optimizer_state: dict[str, np.ndarray]
    cache: ScoringCache | None
    metrics: dict[str, float]


def train_round(
    models: ClientModels,
    theta: Mapping[str, np.ndarray],
    prompts: Sequence[Prompt],
    *,
    rollout: RolloutSettings,
    cache: CacheSettings,
    train: TrainSettings,
    server_round: int,
    seed: int,
    step_offset: int,
    total_steps: int,
    optimizer_state: dict[str, np.ndarray] | None = None,
    teacher_batch: int | None = None,
    build_cache: bool = True,
    cache_source: str = "round",
    source: Mapping[str, np.ndarray] | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainOutput:
    """A client's work in one round, from the global factors θ_t.

    ``seed`` is the client's seed (run seed and partition id); the prompt order, sampling and
    cache choice derive from it and ``server_round``. The scoring cache is built only when
    ``build_cache`` (FedTOPS: the server will ask for candidate scores), from ``cache.rollouts`` of
    the round's own rollouts (``cache_source = "round"``, the paper's) or from one rollout each of
    ``cache.rollouts`` prompts the client does not train on this round (``"untrained"``: the lr
    study's held-out scoring cache, generated at θ_t; the teacher runs on them). ``source``: the adapter
    that generates the rollouts when it is not θ_t itself (the rollout-source intervention,
    ``python -m eval.source_swap``); on-policy training leaves it None. ``progress``: called with a
    line for every phase that took at least :data:`PROGRESS_AFTER_S` seconds, and every
    :data:`PROGRESS_AFTER_S` seconds during a long HF generation (short rounds stay quiet).
    """
    if not prompts:
        raise ValueError("train_round: the client has no prompts")
    t0 = time.perf_counter()
    models.rollout.set_adapter(theta if source is None else source)
    batch_indices = round_indices(len(prompts), server_round, rollout.per_round, seed)
    batch = [prompts[i] for i in batch_indices]
    # The held-out cache's prompts are drawn first: too few prompts fail before any rollout.
    held_out = (
        untrained_indices(len(prompts), batch_indices, cache.rollouts, derive_seed(seed, server_round, 4))
        if build_cache and cache_source == "untrained"
        else None
    )
    params = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, derive_seed(seed, server_round, 1))
    note = _phase_reporter(progress, server_round)
    if progress is not None and hasattr(models.rollout, "progress"):
        models.rollout.progress = lambda text: progress(f"round {server_round}: {text}")
        models.rollout.progress_every_s = PROGRESS_AFTER_S
    try:
        rollouts = models.rollout.generate([p.token_ids for p in batch], params)
    finally:
        if hasattr(models.rollout, "progress"):
            models.rollout.progress = None
    models.student.set_lora_arrays(theta)  # after generation: the HF engine samples from this very model
    t1 = time.perf_counter()
    note(t1 - t0, f"{len(rollouts)} rollouts, mean {rollouts.response_lengths.mean():.0f} tokens")

    texts = models.student.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    accuracy = float(np.mean([is_correct(text, p.answer) for text, p in zip(texts, batch)]))
    t2 = time.perf_counter()

    # The teacher runs once per rollout: the loss and the scoring cache both read this pass.
    plan = round_plan(rollouts, train)  # micro-batches of similar lengths: the least padding
    pad = models.student.tokenizer.pad_token_id or 0
    batches = make_micro_batches(rollouts, plan, pad, models.student.device, use_packing(models.student, train.packing))
    hidden = teacher_pass(models.teacher, batches, teacher_batch)
    t_teacher = time.perf_counter()
    note(t_teacher - t2, f"teacher pass over {sum(b.num_tokens for b in batches.values())} response tokens")

    scoring_cache = None
    if held_out is not None:
        models.rollout.set_adapter(theta)
        held = models.rollout.generate([prompts[i].token_ids for i in held_out], dataclasses.replace(params, seed=derive_seed(seed, server_round, 5)))
        models.student.set_lora_arrays(theta)
        scoring_cache = build_scoring_cache(models.student, models.teacher, held, cache, derive_seed(seed, server_round, 2))
    elif build_cache:
        all_hidden = hidden_in_rollout_order(hidden, rollouts.response_lengths)
        scoring_cache = build_scoring_cache(
            models.student, models.teacher, rollouts, cache, derive_seed(seed, server_round, 2), teacher_hidden=all_hidden
        )
    t3 = time.perf_counter()
    if scoring_cache is not None:
        note(t3 - t_teacher, f"scoring cache of {scoring_cache.num_positions} positions")

    result = local_opd(
        models.student,
        models.teacher,
        rollouts,
        train,
        step_offset=step_offset,
        total_steps=total_steps,
        optimizer_state=optimizer_state,
        batches=batches,
        hidden=hidden,
    )
    t4 = time.perf_counter()
    note(t4 - t3, f"local OPD, {len(plan)} steps, loss {result.metrics['loss_first']:.4f} -> {result.metrics['loss_last']:.4f}")

    metrics = dict(result.metrics)
    metrics.update(
        response_length=float(rollouts.response_lengths.mean()),
        cap_hit_rate=rollouts.cap_hit_rate,
        accuracy=accuracy,
        rollout_s=t1 - t0,
        grade_s=t2 - t1,
        teacher_s=t_teacher - t2,
        cache_s=t3 - t_teacher,
        opd_s=t4 - t3,
        total_s=t4 - t0,
    )
    if scoring_cache is not None:
        metrics["cache_teacher_score"] = scoring_cache.teacher_score_at_start()
    return TrainOutput(result.arrays, result.optimizer_state, scoring_cache, metrics)


CACHE_SOURCES = ("round", "untrained")  # train_round's cache_source

PROGRESS_AFTER_S = 10.0  # phases shorter than this are not reported while the round runs


def _phase_reporter(progress: Callable[[str], None] | None, server_round: int) -> Callable[[float, str], None]:
    def note(seconds: float, what: str) -> None:
        if progress is not None and seconds >= PROGRESS_AFTER_S:
            progress(f"round {server_round}: {what} in {seconds:.1f} s")

    return note


def score_round(
    models: ClientModels,
    theta: Mapping[str, np.ndarray],
    increment: Mapping[str, np.ndarray],
    scoring_cache: ScoringCache,
    multipliers: Sequence[float],
    *,
    with_se: bool = False,
) -> tuple[list[float], ...]:
    """Ĵ_i(a) and K̂_i(a) for each multiplier (``with_se``: and Ĵ_i(a)'s standard error; only
    scalars leave this function)."""
    return score_candidates(models.student, scoring_cache, theta, increment, multipliers, with_se=with_se)
