"""The average of a round's updates, behind one interface: a strategy never knows which one runs.

An :class:`Averager` takes the round's checked updates (:class:`Update`: a node, its float32
arrays θ_{t,i}^+, its weight) and θ_t, and returns the averaged adapter, or None when it averages
nothing. The strategy then moves θ_{t+1} = θ_t + a·(average − θ_t) in one place
(:func:`fedtops_strategy.round.apply_step`); no averager keeps a model
between rounds.

* :class:`WeightedMean`: Σ w_i θ_i / Σ w_i, with Flower's own ``aggregate_arrayrecords`` (FedAvg's);
* :class:`RobustMean`: one of Flower's robust strategies' ``aggregate_train`` (``strategy.aggregator``:
  median, trimmed mean, Krum, MultiKrum; :mod:`fedtops_strategy.aggregators`);
* :class:`PrivateMean`: the differentially private mean over a fixed denominator
  (``privacy.*``, :class:`fedtops_strategy.privacy.UpdatePrivacy`).

Flower's aggregators read messages; each gets fresh ones built from the checked arrays, holding
only the arrays and the weight (and the norm bit for adaptive client-side clipping).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg, Krum, MultiKrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore.differential_privacy import KEY_NORM_BIT

from fedopd.core.strategies import robust_tolerance
from fedopd.models.lora import Named, from_record

WEIGHT_KEY = "num-examples"


@dataclass(frozen=True)
class Update:
    """One client's checked contribution: float32 arrays with θ_t's keys and shapes, and its weight."""

    node_id: int
    arrays: Named
    weight: float
    metrics: dict[str, Any] = field(default_factory=dict)  # what an averager needs besides (the norm bit)


@dataclass
class Average:
    """The averaged adapter (None: nothing averaged) and what the round record gets from it."""

    arrays: Named | None
    record: dict[str, Any] = field(default_factory=dict)
    hold: str | None = None  # why nothing was averaged, when there were updates (the round's hold-reason)


class Averager(ABC):
    """Forms the round's average of the checked updates; the hooks let an averager take part in
    the round without the strategy knowing which one runs (their defaults do nothing)."""

    #: whether the average is the weighted mean of the factors (the aggregation-error diagnostic's premise)
    weighted_mean = True
    #: whether every update weighs the same (the DP mean: its noise is calibrated to the plain mean)
    equal_weights = False
    #: the most updates a round may average (the DP mean's fixed denominator n), None: no limit
    max_updates: int | None = None

    def configure_train(self, config) -> None:
        """What the round's train messages carry for it (client-side DP: the clipping norm)."""

    def refuse(self, reply, theta: Named) -> str | None:
        """Why a checked train reply cannot join this average, or None."""
        return None

    def update_metrics(self, reply) -> dict[str, Any]:
        """What an update carries to the average besides its weight (adaptive client-side DP: the norm bit)."""
        return {}

    @abstractmethod
    def average(self, server_round: int, updates: list[Update], theta: Named) -> Average:
        """The average of ``updates`` (θ_{t,i}^+, not increments) around ``theta`` (θ_t)."""

    def budget_stop(self, server_round: int, scores: bool) -> str | None:
        """Why ``server_round``'s releases would exceed a privacy budget (the private mean), or None."""
        return None

    def release_scores(self, rows: list, weights: dict[int, float], unscored: list[int], asked: list[int], candidates, server_round: int):
        """The score rows (node, Ĵ_i, K̂_i) as the selection may read them: (rows, weights, the
        round record's fields of the release, whether every trust constraint counts as known).
        Here as they are: the rule caps a at 1 while a node that trained is ``unscored``."""
        return rows, weights, {}, not unscored


def as_message(update: Update) -> Message:
    """An update as Flower's aggregators read a reply: its arrays and its weight only."""
    arrays = ArrayRecord({k: Array(np.asarray(v)) for k, v in update.arrays.items()})
    metrics = MetricRecord({WEIGHT_KEY: update.weight, **update.metrics})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), dst_node_id=update.node_id, message_type="train")


class WeightedMean(Averager):
    """Σ w_i θ_i / Σ w_i, as Flower's FedAvg computes it (``aggregate_arrayrecords``)."""

    weighted_mean = True

    def average(self, server_round: int, updates: list[Update], theta: Named) -> Average:
        if not updates:
            return Average(None)
        contents = [as_message(u).content for u in updates]
        return Average(from_record(aggregate_arrayrecords(contents, WEIGHT_KEY)))


class RobustMean(Averager):
    """A Flower robust strategy's ``aggregate_train`` on the updates (``strategy.aggregator``).

    ``planned``: the updates a round averages when every asked client answers (the count the run
    was checked for before round 1); the rule tolerates f arbitrary updates at that size
    (:func:`fedopd.core.strategies.robust_tolerance`), and keeps f fixed in a shorter round: the
    trimmed mean cuts f at each end whatever arrives, and a round with fewer than the rule needs
    for f holds (None: each round's own count)."""

    weighted_mean = False

    def __init__(self, strategy, planned: int | None = None) -> None:
        self.strategy = strategy
        self.planned = planned
        # its strategy.aggregator name, for its breakdown rule (Krum is a MultiKrum that selects one)
        kinds = ((Krum, "krum"), (MultiKrum, "multikrum"), (FedMedian, "median"), (FedTrimmedAvg, "trimmed-mean"))
        self.name = next((name for cls, name in kinds if isinstance(strategy, cls)), type(strategy).__name__)

    def average(self, server_round: int, updates: list[Update], theta: Named) -> Average:
        if not updates:
            return Average(None)
        n = len(updates)
        why = self.too_few(n)
        if why is not None:
            log(WARNING, "round %d holds: %s", server_round, why)
            return Average(None, hold=why)
        strategy = self.strategy
        if isinstance(strategy, MultiKrum) and not isinstance(strategy, Krum):  # Krum is MultiKrum selecting 1
            strategy.num_nodes_to_select = max(1, n - strategy.num_malicious_nodes)
        if isinstance(strategy, FedTrimmedAvg):  # cut exactly f at each end: Flower cuts ⌊β' n⌋, and ⌊(f + ¼)/n · n⌋ = f (β' < ½ as Flower requires)
            f, _ = robust_tolerance(self.name, self.planned or n, strategy.beta)
            strategy = FedTrimmedAvg(beta=(f + 0.25) / n)
        arrays, _ = strategy.aggregate_train(server_round, [as_message(u) for u in updates])
        return Average(None if arrays is None else from_record(arrays))

    def too_few(self, n: int) -> str | None:
        """Why a round of ``n`` updates cannot keep the rule's protection, or None."""
        f, needed = robust_tolerance(
            self.name, self.planned or n, getattr(self.strategy, "beta", 0.0), getattr(self.strategy, "num_malicious_nodes", 0)
        )
        if self.name == "trimmed-mean" and f == 0:
            return f"{n} updates: the trimmed mean (strategy.trim-fraction = {self.strategy.beta:g}) would cut none: it would be the plain mean"
        if self.name == "median" and n < 3:
            return f"{n} updates: 'median' of {n} update(s) is their mean"
        if n < needed:
            return (
                f"{n} updates: {self.name!r} is set up to tolerate {f} arbitrary update(s) ({self.planned} per round), which needs at least {needed}"
            )
        return None


class PrivateMean(Averager):
    """The private mean (:class:`~fedtops_strategy.privacy.UpdatePrivacy`): the clipped updates'
    sum over the fixed denominator n, plus Gaussian noise; released every round, even when no
    update arrived. Its record splits what may be published (``privacy``) from what may not
    (``privacy-diagnostics``)."""

    equal_weights = True

    def __init__(self, privacy) -> None:
        self.privacy = privacy
        self.max_updates = privacy.denominator

    def configure_train(self, config) -> None:
        self.privacy.train_config(config)

    def budget_stop(self, server_round: int, scores: bool) -> str | None:
        return self.privacy.budget_stop(server_round, scores)

    def refuse(self, reply, theta: Named) -> str | None:
        return self.privacy.reply_problem(reply.metrics, theta, reply.arrays)

    def update_metrics(self, reply) -> dict[str, Any]:
        return self.privacy.view_metrics(reply.metrics)

    def release_scores(self, rows: list, weights: dict[int, float], unscored: list[int], asked: list[int], candidates, server_round: int):
        """One released row per node the round asked (a public row for each that gave no valid
        scores), clipped and noised, each weighing the same (docs/privacy.md); the selection is
        post-processing of them. An unscored node's public row already caps a at 1 (feasible up
        to 1): the cap must not read who answered, which is not private."""
        rows, released, filled = self.privacy.release_scores({node: (j, k) for node, j, k in rows}, list(asked), candidates, server_round)
        notes = {"privacy": {**released, **self.privacy.ledger.summary()}, "privacy-diagnostics": {"public-score-rows": filled}}
        return rows, dict.fromkeys(asked, 1.0), notes, True

    def average(self, server_round: int, updates: list[Update], theta: Named) -> Average:
        bits = [u.metrics.get(KEY_NORM_BIT) for u in updates]
        mean, public, diagnostics = self.privacy.release(server_round, [u.arrays for u in updates], bits, theta)
        # ε so far, in every round's record
        return Average(mean, {"privacy": {**public, **self.privacy.ledger.summary()}, "privacy-diagnostics": diagnostics})
