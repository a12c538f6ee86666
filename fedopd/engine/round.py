"""One client round, named as in the paper: rollouts → grading → teacher → scoring cache → local
OPD, and the candidate scores of the server's query. Flower-free: the ClientApp is a thin shell
over :func:`train_round` and :func:`score_round`.

A round is the client's models, θ_t, its prompts and a :class:`RoundPlan` (which round, its
seed, the settings, where it stands in the learning-rate schedule, whether and from what it
builds a scoring cache). :func:`train_round` reads as its steps, each timed into the metric of
its name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from fedopd.core.settings import CACHE_SOURCES, CacheSettings, LoraSettings, RolloutSettings, RunConfig, TrainSettings
from fedopd.data import Prompt, round_indices
from fedopd.data.grading import is_correct
from fedopd.data.prompts import untrained_indices
from fedopd.distill.cache import ScoringCache, build_scoring_cache, score_candidates
from fedopd.distill.opd import OPDResult, hidden_in_rollout_order, local_opd, make_micro_batches, round_plan, teacher_pass, use_packing
from fedopd.distill.teacher import TokenBatch
from fedopd.engine.heldout import evaluate_heldout, heldout_correctness  # noqa: F401 - re-exported: the old import path
from fedopd.models.load import CausalLM, load_pair
from fedopd.models.positions import engine_context, model_positions
from fedopd.models.vocab import ModelFiles, StopTokens, resolve_stop_tokens
from fedopd.rollout import RolloutEngine, Rollouts, SamplingParams, make_rollout_engine


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


@dataclass(frozen=True)
class RoundPlan:
    """What one client round does, besides the models, θ_t and the prompts it runs on.

    ``seed`` is the learner's seed (the run seed and its partition id,
    :func:`client_app.handlers.learner_seed`): the round's prompts, the sampling and the cache's
    choice of positions derive from it and ``server_round``. ``rollout.per_round`` is the
    rollouts this learner generates this round (the Centralized reference pools several clients';
    :meth:`RunConfig.learner_budget`). ``step_offset`` and ``total_steps`` place the round's
    optimizer steps in the cosine schedule. ``teacher_batch``: sequences per teacher forward
    (``model.teacher-batch``; None = a micro-batch at a time).

    The scoring cache is built only when ``build_cache`` (FedTOPS: the server will ask for
    candidate scores), from ``cache.rollouts`` of the round's own rollouts (``cache_source =
    "round"``, the paper's) or from one rollout each of ``cache.rollouts`` prompts the client does
    not train on this round (``"untrained"``: the lr study's held-out scoring cache, generated at
    θ_t; the teacher runs on them).
    """

    server_round: int
    seed: int
    rollout: RolloutSettings
    cache: CacheSettings
    train: TrainSettings
    step_offset: int
    total_steps: int
    teacher_batch: int | None = None
    build_cache: bool = True
    cache_source: str = "round"

    def __post_init__(self) -> None:
        if self.cache_source not in CACHE_SOURCES:
            raise ValueError(f"RoundPlan: cache_source = {self.cache_source!r}; allowed: {', '.join(map(repr, CACHE_SOURCES))}")

    @classmethod
    def from_config(
        cls, cfg: RunConfig, server_round: int, seed: int, *, partitions: int = 1, build_cache: bool = True, cache_source: str = "round"
    ) -> RoundPlan:
        """Round ``server_round`` of a learner on ``partitions`` partitions' prompts (1: a client)
        under ``cfg``: their rollouts per round, its steps so far and over the run
        (:meth:`RunConfig.learner_budget`), the run's rollout, cache and train settings and
        ``model.teacher-batch``."""
        per_round, steps_per_round, total_steps = cfg.learner_budget(partitions)
        return cls(
            server_round=server_round,
            seed=seed,
            rollout=dataclasses.replace(cfg.rollout, per_round=per_round),
            cache=cfg.cache,
            train=cfg.train,
            step_offset=(server_round - 1) * steps_per_round,
            total_steps=total_steps,
            teacher_batch=cfg.model.teacher_batch,
            build_cache=build_cache,
            cache_source=cache_source,
        )


def train_round(
    models: ClientModels,
    theta: Mapping[str, np.ndarray],
    prompts: Sequence[Prompt],
    plan: RoundPlan,
    *,
    optimizer_state: dict[str, np.ndarray] | None = None,
    source: Mapping[str, np.ndarray] | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainOutput:
    """A client's work in one round, from the global factors θ_t, as ``plan`` says.

    ``optimizer_state``: the client's AdamW state from its previous round (None: a fresh one).
    ``source``: the adapter that generates the rollouts when it is not θ_t itself (the
    rollout-source intervention, ``python -m eval.source_swap``); on-policy training leaves it
    None. ``progress``: called with a line for every step that took at least
    :data:`PROGRESS_AFTER_S` seconds, and every :data:`PROGRESS_AFTER_S` seconds during a long HF
    generation (short rounds stay quiet).

    Each step's seconds are in the metrics: ``rollout_s``, ``grade_s``, ``teacher_s``, ``cache_s``,
    ``opd_s`` and their sum ``total_s``.
    """
    if not prompts:
        raise ValueError("train_round: the client has no prompts")
    steps = _Steps(progress, plan.server_round)

    with steps.timed("rollout_s") as step:
        batch, held_out = _draw_prompts(prompts, plan)
        rollouts = _rollouts(models, theta if source is None else source, batch, plan, progress)
        models.student.set_lora_arrays(theta)  # after generation: the HF engine samples from this very model
        step.note = f"{len(rollouts)} rollouts, mean {rollouts.response_lengths.mean():.0f} tokens"

    with steps.timed("grade_s"):
        accuracy = _grade(models, rollouts, batch)

    with steps.timed("teacher_s") as step:
        # The teacher runs once per rollout: the loss and the scoring cache both read this pass.
        minis, batches = _micro_batches(models, rollouts, plan.train)
        hidden = teacher_pass(models.teacher, batches, plan.teacher_batch)
        step.note = f"teacher pass over {sum(b.num_tokens for b in batches.values())} response tokens"

    with steps.timed("cache_s") as step:
        scoring_cache = _scoring_cache(models, theta, prompts, held_out, rollouts, hidden, plan)
        if scoring_cache is not None:
            step.note = f"scoring cache of {scoring_cache.num_positions} positions"

    with steps.timed("opd_s") as step:
        result = _local_opd(models, rollouts, batches, hidden, plan, optimizer_state)
        step.note = f"local OPD, {len(minis)} steps, loss {result.metrics['loss_first']:.4f} -> {result.metrics['loss_last']:.4f}"

    metrics = dict(result.metrics)
    metrics.update(
        response_length=float(rollouts.response_lengths.mean()),
        cap_hit_rate=rollouts.cap_hit_rate,
        accuracy=accuracy,
        **steps.seconds,
        total_s=steps.total_s,
    )
    if scoring_cache is not None:
        metrics["cache_teacher_score"] = scoring_cache.teacher_score_at_start()
    return TrainOutput(result.arrays, result.optimizer_state, scoring_cache, metrics)


# ---------------------------------------------------------------------------------------------
# The round's steps
# ---------------------------------------------------------------------------------------------


def _sampling(plan: RoundPlan, purpose: int) -> SamplingParams:
    """The round's rollout sampling, seeded for ``purpose`` (1: the round's rollouts, 5: a held-out cache's)."""
    rollout = plan.rollout
    return SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, derive_seed(plan.seed, plan.server_round, purpose))


def _draw_prompts(prompts: Sequence[Prompt], plan: RoundPlan) -> tuple[list[Prompt], np.ndarray | None]:
    """The round's prompts, and those of a held-out scoring cache (None: the cache, if any, is
    built from the round's rollouts). The held-out ones are drawn before any rollout, so that too
    few prompts fail first."""
    indices = round_indices(len(prompts), plan.server_round, plan.rollout.per_round, plan.seed)
    held_out = (
        untrained_indices(len(prompts), indices, plan.cache.rollouts, derive_seed(plan.seed, plan.server_round, 4))
        if plan.build_cache and plan.cache_source == "untrained"
        else None
    )
    return [prompts[i] for i in indices], held_out


def _rollouts(
    models: ClientModels, generator: Mapping[str, np.ndarray], batch: Sequence[Prompt], plan: RoundPlan, progress: Callable[[str], None] | None
) -> Rollouts:
    """One rollout per prompt of ``batch`` from the adapter ``generator`` (θ_t, or the source),
    with the engine's generation progress passed on while it runs."""
    models.rollout.set_adapter(generator)
    if progress is not None and hasattr(models.rollout, "progress"):
        models.rollout.progress = lambda text: progress(f"round {plan.server_round}: {text}")
        models.rollout.progress_every_s = PROGRESS_AFTER_S
    try:
        return models.rollout.generate([p.token_ids for p in batch], _sampling(plan, 1))
    finally:
        if hasattr(models.rollout, "progress"):
            models.rollout.progress = None


def _grade(models: ClientModels, rollouts: Rollouts, batch: Sequence[Prompt]) -> float:
    """The share of the round's responses that reach their prompt's answer."""
    texts = models.student.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    return float(np.mean([is_correct(text, p.answer) for text, p in zip(texts, batch)]))


def _micro_batches(models: ClientModels, rollouts: Rollouts, train: TrainSettings) -> tuple[list[list[list[int]]], dict[tuple[int, ...], TokenBatch]]:
    """The round's one grouping of its rollouts: mini-batches (one optimizer step each) of
    micro-batches (one forward each) of rollouts of similar lengths (the least padding,
    :func:`fedopd.distill.opd.micro_batches`), as rollout indices, and the micro-batches' tokens
    keyed by those indices. The teacher pass, the scoring cache and local OPD all read it."""
    plan = round_plan(rollouts, train)
    pad = models.student.tokenizer.pad_token_id or 0
    return plan, make_micro_batches(rollouts, plan, pad, models.student.device, use_packing(models.student, train.packing))


def _scoring_cache(
    models: ClientModels,
    theta: Mapping[str, np.ndarray],
    prompts: Sequence[Prompt],
    held_out: np.ndarray | None,
    rollouts: Rollouts,
    hidden: dict[tuple[int, ...], torch.Tensor],
    plan: RoundPlan,
) -> ScoringCache | None:
    """The scoring cache the server's score query will read, or None when ``plan`` builds none:
    from rollouts of the ``held_out`` prompts generated at θ_t, else from the round's rollouts
    with the teacher's hidden states of the round's one teacher pass."""
    seed = derive_seed(plan.seed, plan.server_round, 2)
    if held_out is not None:
        models.rollout.set_adapter(theta)
        held = models.rollout.generate([prompts[i].token_ids for i in held_out], _sampling(plan, 5))
        models.student.set_lora_arrays(theta)
        return build_scoring_cache(models.student, models.teacher, held, plan.cache, seed)
    if plan.build_cache:
        all_hidden = hidden_in_rollout_order(hidden, rollouts.response_lengths)
        return build_scoring_cache(models.student, models.teacher, rollouts, plan.cache, seed, teacher_hidden=all_hidden)
    return None


def _local_opd(
    models: ClientModels,
    rollouts: Rollouts,
    batches: dict[tuple[int, ...], TokenBatch],
    hidden: dict[tuple[int, ...], torch.Tensor],
    plan: RoundPlan,
    optimizer_state: dict[str, np.ndarray] | None,
) -> OPDResult:
    """One epoch of local OPD from θ_t over the round's micro-batches and the teacher's hidden
    states on them, at the round's place in the learning-rate schedule."""
    return local_opd(
        models.student,
        models.teacher,
        rollouts,
        plan.train,
        step_offset=plan.step_offset,
        total_steps=plan.total_steps,
        optimizer_state=optimizer_state,
        batches=batches,
        hidden=hidden,
    )


@dataclass
class _Step:
    note: str | None = None  # what the step did, for the progress line


class _Steps:
    """Times the round's steps into ``seconds`` under the metric names run folders record, and
    reports each step with a note that took at least :data:`PROGRESS_AFTER_S` seconds. The steps
    tile the round: each starts where the previous one ended, so they sum to ``total_s``."""

    def __init__(self, progress: Callable[[str], None] | None, server_round: int) -> None:
        self.progress, self.server_round = progress, server_round
        self.seconds: dict[str, float] = {}
        self.started = self.ended = time.perf_counter()

    @property
    def total_s(self) -> float:
        return self.ended - self.started

    @contextmanager
    def timed(self, name: str) -> Iterator[_Step]:
        step, start = _Step(), self.ended
        yield step
        self.ended = time.perf_counter()
        self.seconds[name] = seconds = self.ended - start
        if self.progress is not None and step.note is not None and seconds >= PROGRESS_AFTER_S:
            self.progress(f"round {self.server_round}: {step.note} in {seconds:.1f} s")


PROGRESS_AFTER_S = 10.0  # steps shorter than this are not reported while the round runs


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
