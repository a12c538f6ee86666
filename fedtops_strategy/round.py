"""One round as values: what each phase of Algorithm 1 returns and the next one takes.

Paper: "Trapped by Their Own Rollouts: Understanding Aggregation–Rollout Feedback in Federated
On-Policy Distillation", Algorithm 1. A round passes through these types, in order:

1. :class:`TrainRound`: the train messages (θ_t out to the sampled clients) and θ_t itself;
2. :class:`TrainAggregate`: the checked replies θ_{t,i}^+, their weights w_i, the average and
   Δ_t = average − θ_t, and who was refused and why;
3. :class:`ScoreRows` (a strategy with a score phase): each scored client's Ĵ_i(a) and K̂_i(a);
4. :class:`Step`: θ_{t+1} and what the strategy chose (a_t, a hold and why, the rule's fields);
5. :class:`RoundResult`: the four together, with :meth:`RoundResult.to_record` for the run
   folder's keys (docs/run-folder.md).

:func:`play_round` runs one round through a strategy's phases; the ServerApp's loop and
:meth:`fedtops_strategy.base.ServerStrategy.start` both call it. Nothing of a round is left on
the strategy: it holds its settings and the state its algorithm carries across rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log

from fedopd.models import lora
from fedopd.models.lora import Named, aggregation_errors_from_gram
from fedtops_strategy.bounds import all_finite
from fedtops_strategy.record import RoundRecord
from fedtops_strategy.replies import ScoreReply, TrainReply


@dataclass(frozen=True)
class TrainRound:
    """The train phase's messages: θ_t out to the sampled nodes (``sampled``), without the nodes
    that sit out (``skipped``)."""

    server_round: int
    theta: Named
    messages: list[Message]
    sampled: list[int]
    skipped: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class TrainAggregate:
    """The train phase's result: the kept replies in a fixed order, their weights in the average
    (Ĵ uses the same), the average (None: nothing averaged, the round holds) and Δ_t = mean − θ_t.

    ``notes`` holds the phase's other round-record fields (``disputed-partitions``, ``bounded``,
    ``bounds-skipped``, a private average's ``privacy`` and ``privacy-diagnostics``); ``gram``
    the aggregation error's Gram matrix and weights (:func:`fedopd.models.lora.aggregation_gram`)."""

    sent: TrainRound
    kept: list[TrainReply]
    refused: list[dict[str, Any]]
    weights: dict[int, float]
    mean: Named | None
    delta: Named | None
    hold_reason: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    gram: tuple[np.ndarray, list[float]] | None = None

    @property
    def server_round(self) -> int:
        return self.sent.server_round

    @property
    def theta(self) -> Named:
        return self.sent.theta


@dataclass(frozen=True)
class ScoreRows:
    """The score phase's result: one row (node, Ĵ_i(a), K̂_i(a)) per scored node in the order of
    the train replies, their weights, the nodes that trained without valid scores (``unscored``)
    and whether the rule may treat every trust constraint as known (``all_scored``). ``replies``:
    the checked score replies (a variant reads more of them); ``notes``: the privacy release's
    record fields."""

    rows: list[tuple[int, list[float], list[float]]]
    weights: dict[int, float]
    unscored: list[int]
    all_scored: bool
    refused: list[dict[str, Any]] = field(default_factory=list)
    replies: list[ScoreReply] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Step:
    """θ_{t+1} (θ_t where the round holds) and what the strategy chose: ``multiplier`` a_t (None:
    nothing applied, Local) and the round record's fields of the choice (``details``)."""

    theta: Named
    multiplier: float | None
    details: dict[str, Any] = field(default_factory=dict)

    def arrays(self) -> ArrayRecord:
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in self.theta.items()})


@dataclass(frozen=True)
class RoundResult:
    """One round, built once from its phases' values and handed to the observers."""

    strategy: str
    train: TrainAggregate
    scores: ScoreRows | None
    step: Step
    traffic: dict[str, list[dict[str, int]]] = field(default_factory=dict)

    @property
    def server_round(self) -> int:
        return self.train.server_round

    def to_record(self) -> RoundRecord:
        """The round's line of ``rounds.jsonl`` (docs/run-folder.md), without what the ServerApp
        adds after the step (timings, the evaluation, traffic)."""
        train, sent = self.train, self.train.sent
        record: dict[str, Any] = {
            "round": sent.server_round,
            "strategy": self.strategy,
            "sampled-node-ids": list(sent.sampled),
            "trained-node-ids": sorted(r.node_id for r in train.kept),
            "candidates": None,
            "teacher_scores": None,
            "change_scores": None,
            "clients": [r.client_entry() for r in train.kept],
            "excluded": list(train.refused) + (list(self.scores.refused) if self.scores else []),
        }
        if sent.skipped:
            record["skipped-node-ids"] = list(sent.skipped)
        for part in (train.notes, self.scores.notes if self.scores else {}, self.step.details):
            for key, value in part.items():
                if isinstance(value, dict) and isinstance(record.get(key), dict):
                    record[key] = {**record[key], **value}  # the private mean's and the score rows' releases
                else:
                    record[key] = value
        if self.scores is not None:
            record["score_seconds"] = self.scores.seconds
        record["multiplier"] = self.step.multiplier
        if self.step.multiplier is not None and train.delta is not None:  # where the step went relative to Δ_t
            record.update(step_geometry(sent.theta, self.step.theta, train.delta))
        return record


def apply_step(train: TrainAggregate, multiplier: float, details: dict[str, Any] | None = None, *, factors: bool = True) -> Step:
    """θ_{t+1} = θ_t + a·Δ_t in fp32 from θ_t, in one place for every averaging strategy.

    No average (``train.mean`` None): the round holds (a = 0, ``hold-reason``). A result that is
    not finite holds it too (θ_t kept). With ``factors`` (the average is of the LoRA factors) the
    details get the aggregation errors at the applied a (:func:`aggregation_errors`)."""
    details = dict(details or {})
    theta, new = train.theta, train.theta
    if train.mean is None:
        details["hold-reason"] = train.hold_reason or details.get("hold-reason") or "no valid client update"
        return Step(theta, 0.0, details)
    if multiplier != 0.0:
        new = lora.apply_increment(theta, train.delta, multiplier)
        if not all_finite(new):
            log(WARNING, "round %d holds: θ_t + %g Δ_t is not finite (θ_t kept)", train.server_round, multiplier)
            details["hold-reason"] = f"θ_t + {multiplier:g} Δ_t is not finite"
            multiplier, new = 0.0, theta
    if factors:
        details.update(aggregation_errors(train, multiplier))
    return Step(new, multiplier, details)


def step_geometry(theta: Named, new: Named, delta: Named | None) -> dict[str, float | None]:
    """Where the step went relative to Δ_t, in float64 over every LoRA factor: ``effective-multiplier``
    ‖θ_{t+1} − θ_t‖ / ‖Δ_t‖ and ``step-cosine`` ⟨θ_{t+1} − θ_t, Δ_t⟩ / (‖θ_{t+1} − θ_t‖‖Δ_t‖)
    (None where Δ_t or the step is 0, or there is no Δ_t). θ_{t+1} = θ_t + aΔ_t gives a and 1 (a > 0)."""
    if delta is None:
        return {"effective-multiplier": None, "step-cosine": None}
    dot = moved = size = 0.0
    for key, d in delta.items():
        s = np.asarray(new[key], dtype=np.float64) - np.asarray(theta[key], dtype=np.float64)
        d = np.asarray(d, dtype=np.float64)
        dot += float(np.vdot(s, d))
        moved += float(np.vdot(s, s))
        size += float(np.vdot(d, d))
    if size == 0.0:
        return {"effective-multiplier": None, "step-cosine": None}
    ratio = math.sqrt(moved / size)
    cosine = dot / math.sqrt(moved * size) if moved > 0.0 else None
    return {"effective-multiplier": ratio, "step-cosine": None if cosine is None else max(-1.0, min(1.0, cosine))}


def aggregation_errors(train: TrainAggregate, multiplier: float) -> dict[str, float | None]:
    """The round's ``aggregation-error`` (the factor average against the average of the products
    BA) and ``aggregation-error-applied`` (the same for θ_t + aΔ_t), from the Gram matrix the
    train phase built (None where there is none or the update is 0)."""
    errors = aggregation_errors_from_gram(*train.gram, multiplier) if train.gram else {"mean": None, "applied": None}
    return {"aggregation-error": errors["mean"], "aggregation-error-applied": errors["applied"]}


def play_round(
    strategy,
    grid,
    server_round: int,
    theta: ArrayRecord,
    config: ConfigRecord,
    *,
    train_timeout: float | None,
    score_timeout: float | None,
    meter: Callable[[], list[dict[str, int]]] | None = None,
) -> RoundResult:
    """Algorithm 1, one round: θ_t out to the sampled clients and θ_{t,i}^+ back (train), Δ_t
    (the average), Ĵ_i(a) and K̂_i(a) for every candidate (score, where the strategy has that
    phase), then a_t and θ_{t+1} (the step). ``meter``: the bytes per node of the phase just run
    (the ServerApp's grid), kept in the result by phase."""
    sent = strategy.configure_train(server_round, theta, config, grid)
    train = strategy.aggregate_train(sent, grid.send_and_receive(sent.messages, timeout=train_timeout))
    traffic = {"train": meter()} if meter else {}
    scores = None
    queries = strategy.configure_score(train)
    if queries is not None:
        started = time.perf_counter()
        replies = grid.send_and_receive(queries, timeout=score_timeout)
        scores = strategy.aggregate_score(train, queries, replies, started)
        if meter:
            traffic["score"] = meter()
    step = strategy.step(train, scores)
    return RoundResult(strategy.strategy_name, train, scores, step, traffic)
