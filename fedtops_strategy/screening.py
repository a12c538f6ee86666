"""The server side every strategy shares, built from parts with one job each.

A round's train phase, in order:

1. **sampling** (:mod:`fedtops_strategy.sampling`): a seeded draw over the sorted connected nodes,
   without those that sit out after staying silent (``timeout.skip-after``, every phase counted),
   with a deadline on waiting for them (``timeout.start``, :class:`NodesNotConnected`);
2. **the boundary** (:mod:`fedtops_strategy.replies`): each reply becomes a typed
   :class:`~fedtops_strategy.replies.TrainReply` or a rejection naming the node and the reason;
   two replies that claim one partition are both refused; the averager may refuse more
   (client-side adaptive privacy: a norm bit that the update's norm contradicts);
3. **update bounds** (:mod:`fedtops_strategy.bounds`, ``strategy.clip-norm``, ``strategy.max-weight``);
4. **the average** (:mod:`fedtops_strategy.averaging`): the weighted mean, a Flower robust
   aggregator or the DP mean, behind one interface;
5. **the step** θ_{t+1} = θ_t + a·Δ_t, Δ_t = average − θ_t, applied in one place
   (:meth:`ReplyScreening.apply_multiplier`) from θ_t; a non-finite result holds the round
   (θ_t kept). No strategy keeps a model of its own between rounds.

Each round leaves a record (``self.records``) that the ServerApp writes to ``rounds.jsonl``.

What a client does differently for a strategy travels in the train message's config, never as
the strategy's name (``client_app/handlers.py`` reads it):

* ``"learner"``: ``"federated"`` (its own prompts, from the adapter it is sent), ``"local"`` (the
  same, and it keeps its own adapter: a resumed client restores it), ``"centralized"`` (one
  learner on the pooled prompts of every partition, with their combined rollouts per round);
* ``"build-scoring-cache"``: build the scoring cache before the local epoch (FedTOPS scores
  candidates on it); ``"scoring-cache"`` (only when not ``"round"``): ``"untrained"`` builds it
  from rollouts of prompts the client does not train on this round (``fedtops-heldout-cache``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log

from fedopd.models import lora
from fedopd.models.lora import Named, aggregation_errors_from_gram, aggregation_gram, from_record
from fedtops_strategy.averaging import Average, Averager, PrivateMean, RobustMean, Update, WeightedMean
from fedtops_strategy.bounds import UpdateBounds, all_finite
from fedtops_strategy.record import RoundRecord
from fedtops_strategy.replies import WEIGHT_KEY, Expected, Rejection, TrainReply, parse_train, settle_partition_claims
from fedtops_strategy.sampling import NodeSampler, NodesNotConnected, Silence, missing_replies, reply_nodes

__all__ = ["WEIGHT_KEY", "NodesNotConnected", "ReplyScreening", "missing_replies", "parse_replies", "reply_nodes"]


def parse_replies(sent: list[Message], replies: Iterable[Message], parse, expected: Expected, phase: str):
    """(typed replies, rejections, ``excluded`` entries of the nodes that did not answer in time)
    of one phase: each reply through ``parse`` (the boundary), attributed to the node its message
    went to; a reply from a node that was not asked, or a second one, is a rejection too."""
    replies = list(replies)
    missing = missing_replies(sent, replies, phase)
    asked = {int(m.metadata.dst_node_id) for m in sent}
    typed, rejected, seen = [], [], set()
    for msg, node in zip(replies, reply_nodes(sent, replies)):
        if node not in asked or node in seen:
            rejected.append(Rejection(node, "a second reply" if node in seen else "from a node that was not asked"))
            continue
        seen.add(node)
        result = parse(msg, node, expected)
        (rejected if isinstance(result, Rejection) else typed).append(result)
    return typed, rejected, missing


class ReplyScreening:
    """Mixin for a Flower ``FedAvg`` subclass (it comes first in the bases): samples, checks and
    averages train replies through the parts in the module docstring, applies the step and
    records the round. Flower's ``FedAvg`` contributes its sampling (``configure_train``) only.

    Subclasses set :attr:`strategy_name` (the round record's ``strategy``), :attr:`learner` and
    :attr:`builds_scoring_cache` (the train config's ``learner`` and ``build-scoring-cache``), and
    may fill more of ``self.records[server_round]``.

    Parameters (keyword-only; the rest go to Flower's FedAvg)
    ----------
    sampling_seed : int
        The run's seed: which nodes round t samples.
    num_partitions, max_examples : int | None
        A reply's ``partition-id`` is in [0, num_partitions); its ``num-examples`` at most max_examples (None: no bound).
    clip_norm, max_weight : float
        ``strategy.clip-norm``, ``strategy.max-weight`` (0: off).
    aggregator : Flower strategy | None
        ``strategy.aggregator`` other than ``fedavg``: the robust average (:class:`RobustMean`).
    privacy : :class:`fedtops_strategy.privacy.UpdatePrivacy` | None
        ``privacy.*``: the DP average (:class:`PrivateMean`).
    start_timeout, skip_after : float, int
        ``timeout.start`` and ``timeout.skip-after``.
    """

    strategy_name = "fedavg"
    learner = "federated"
    builds_scoring_cache = False
    averages_factors = True  # records the aggregation error of averaging the LoRA factors
    scoring_cache = "round"  # where clients take the scoring cache's rollouts from (a variant: "untrained")

    def __init__(
        self,
        *args,
        sampling_seed: int = 0,
        num_partitions: int | None = None,
        max_examples: int | None = None,
        clip_norm: float = 0.0,
        max_weight: float = 0.0,
        aggregator=None,
        privacy=None,
        start_timeout: float = float("inf"),
        skip_after: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # the parts, one job each (module docstring)
        self.sampler = NodeSampler(sampling_seed, start_timeout)
        self.silence = Silence(skip_after)
        self.limits = Expected(num_partitions=num_partitions, max_examples=max_examples)  # θ_t's shapes join each round
        self.bounds = UpdateBounds(float(clip_norm), float(max_weight))
        self.privacy = privacy  # also FedTOPS's score channel, the ServerApp's ledger
        self.averager: Averager = (
            PrivateMean(privacy) if privacy is not None else (RobustMean(aggregator) if aggregator is not None else WeightedMean())
        )
        # the round in progress
        self.records: dict[int, RoundRecord] = {}
        self._theta: ArrayRecord | None = None
        self._theta_named: Named | None = None
        self._sent: list[Message] = []
        self.round_started = 0.0
        self.kept: list[TrainReply] = []  # the round's checked train replies, in the record's order
        self.mean: Named | None = None  # the round's average (None: nothing averaged)
        self.delta: Named | None = None  # Δ_t = mean − θ_t, formed once per round
        self._aggregation: tuple[np.ndarray, list[float]] | None = None  # the round's aggregation Gram matrix and client weights
        self.client_weights: dict[int, float] = {}  # node -> its weight in the round's average (Ĵ uses the same)

    @property
    def num_partitions(self) -> int | None:
        return self.limits.num_partitions

    @property
    def sampled_node_ids(self) -> list[int]:
        return self.sampler.sampled_node_ids

    # -- silence (every phase) ---------------------------------------------------------------------
    @property
    def skip_after(self) -> int:
        return self.silence.skip_after

    @property
    def skipped_until(self) -> dict[int, int]:
        return self.silence.skipped_until

    @property
    def timeouts(self) -> dict[int, int]:
        return self.silence.counts

    def sitting_out(self, server_round: int) -> frozenset[int]:
        """The nodes that sit out ``server_round`` (``timeout.skip-after``)."""
        return self.silence.sitting_out(server_round)

    def note_timeouts(self, server_round: int, asked: Iterable[int], timed_out: Iterable[int]) -> None:
        """A phase of ``server_round`` asked ``asked``; ``timed_out`` did not answer in time (:class:`Silence`)."""
        self.silence.note(server_round, asked, timed_out)

    # -- train: sampling -------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self.silence.close_round(server_round - 1)  # every phase of the last round, evaluation included, is over
        self._theta, self._theta_named = arrays, None
        self.round_started = time.perf_counter()
        config["learner"] = self.learner
        config["build-scoring-cache"] = self.builds_scoring_cache
        if self.scoring_cache != "round":  # the paper's messages stay as they were
            config["scoring-cache"] = self.scoring_cache
        self.averager.configure_train(config)  # client-side DP: the clipping norm for Flower's mod
        sampled = self.sampler.sample(self, super().configure_train, server_round, arrays, config, grid, self.sitting_out(server_round))
        cap = self.averager.max_updates
        if cap is not None and len(sampled) > cap:  # the DP mean's fixed n: more nodes connected than declared
            log(WARNING, "round %d: %d nodes sampled, %d asked (the private mean's denominator)", server_round, len(sampled), cap)
            sampled = sampled[:cap]  # Flower's draw is in random order: a random subset
            self.sampler.sampled_node_ids = sorted(int(m.metadata.dst_node_id) for m in sampled)
        messages = self.prepare_messages(sampled, arrays)
        self._sent = messages  # the grid sets their message ids when it pushes them
        return messages

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        """The train messages as sent (a subclass may replace or drop some); by default unchanged."""
        return messages

    # -- train: the boundary ---------------------------------------------------------------------
    def screen_train_replies(self, server_round: int, replies: Iterable[Message]) -> list[TrainReply]:
        """The round's train replies through the boundary; the kept ones, in a fixed order, and the
        round's record with its clients and exclusions."""
        theta = self.theta_arrays()
        expected = Expected.for_train(theta, self.limits.num_partitions, self.limits.max_examples)
        typed, rejected, excluded = parse_replies(self._sent, replies, parse_train, expected, "train")
        self.note_timeouts(server_round, [int(m.metadata.dst_node_id) for m in self._sent], [e["node-id"] for e in excluded])
        typed, disputes = settle_partition_claims(typed)
        for d in disputes:
            log(WARNING, "round %d: node %d's partition claim refused: %s", server_round, d["node-id"], d["reason"])
        kept = []
        for reply in typed:
            problem = self.averager.refuse(reply, theta)
            if problem:
                rejected.append(Rejection(reply.node_id, problem))
            else:
                kept.append(reply)
        for r in rejected:
            log(WARNING, "round %d: update of node %d left out of the average: %s", server_round, r.node_id, r.reason)
            excluded.append(r.entry())
        # Flower samples nodes in random order; fix one (by partition, then node id) so that the
        # fp32 average, the score query and the round record do not depend on it.
        kept.sort(key=lambda r: (r.partition_id if r.partition_id is not None else 0, r.node_id))
        self.kept = kept
        clients = [r.client_entry() for r in kept]
        self.records[server_round] = {
            "round": server_round,
            "strategy": self.strategy_name,
            "sampled-node-ids": list(self.sampler.sampled_node_ids),
            "trained-node-ids": sorted(r.node_id for r in kept),
            "candidates": None,
            "teacher_scores": None,
            "change_scores": None,
            "clients": clients,
            "excluded": excluded,
        }
        if disputes:
            self.records[server_round]["disputed-partitions"] = disputes
        if self.sampler.skipped_node_ids:
            self.records[server_round]["skipped-node-ids"] = list(self.sampler.skipped_node_ids)
        return kept

    # -- train: bounds and the average -----------------------------------------------------------
    def bounded_updates(self, server_round: int, kept: list[TrainReply]) -> list[Update]:
        """The kept replies as the averager sees them: equal weights where it needs them (the DP
        mean), else ``num-examples``; then :attr:`bounds` (clip-norm, max-weight). Sets
        :attr:`client_weights`, which Ĵ uses too."""
        weights = [1.0 if self.averager.equal_weights else float(r.num_examples) for r in kept]
        arrays, capped, bounded, skipped = self.bounds.apply(self.theta_arrays(), [r.arrays for r in kept], weights)
        self.client_weights = {r.node_id: w for r, w in zip(kept, capped)}
        if skipped:
            log(WARNING, "round %d: strategy.clip-norm / max-weight not applied: %s", server_round, skipped)
            self.records[server_round]["bounds-skipped"] = skipped
        if bounded:
            self.records[server_round]["bounded"] = [{"node-id": r.node_id, **b} for r, b in zip(kept, bounded)]
            for r, b, w in zip(kept, bounded, weights):
                if b["scale"] < 1.0 or b["weight"] < w:
                    log(
                        WARNING,
                        "round %d: node %d's update bounded: norm %.4g scaled by %.4g, weight %g -> %g",
                        server_round,
                        r.node_id,
                        b["update-norm"],
                        b["scale"],
                        w,
                        b["weight"],
                    )
        # an uncapped weight goes to the average as the client sent it (an int): Flower's mean as before
        return [
            Update(r.node_id, a, cw if cw < w or self.averager.equal_weights else r.num_examples, self.averager.update_metrics(r))
            for r, a, w, cw in zip(kept, arrays, weights, capped)
        ]

    def average_round(self, server_round: int, replies: Iterable[Message]) -> Named | None:
        """Screen, bound and average the round's train replies: :attr:`mean` (None: nothing averaged)."""
        kept = self.screen_train_replies(server_round, replies)
        updates = self.bounded_updates(server_round, kept)
        result: Average = self.averager.average(server_round, updates, self.theta_arrays())
        record = self.records[server_round]
        record.update(result.record)
        self.mean = result.arrays
        self._aggregation = None
        if self.mean is not None and self.averages_factors and self.averager.weighted_mean:
            try:
                self._aggregation = (
                    aggregation_gram(self.theta_arrays(), [u.arrays for u in updates], [float(u.weight) for u in updates]),
                    [float(u.weight) for u in updates],
                )
            except ValueError as err:  # a diagnostic never stops a round: factors without A/B pairs
                log(WARNING, "round %d: no aggregation error: %s", server_round, err)
        if self.mean is not None and not all_finite(self.mean):
            log(WARNING, "round %d holds: the average of the kept updates is not finite (θ_t kept)", server_round)
            record["hold-reason"] = "the averaged adapter is not finite"
            self.mean = None
        self.delta = None if self.mean is None else lora.increment(self.mean, self.theta_arrays())
        return self.mean

    # -- the step, in one place ------------------------------------------------------------------
    def apply_multiplier(self, server_round: int, multiplier: float) -> ArrayRecord:
        """θ_{t+1} = θ_t + a·Δ_t with Δ_t = :attr:`delta` (:attr:`mean` − θ_t), in fp32, from θ_t; the record's
        ``multiplier``. A result that is not finite holds the round (θ_t kept, ``hold-reason``)."""
        record = self.records[server_round]
        theta = self.theta_arrays()
        new = theta
        if self.mean is None:
            multiplier = 0.0
            record.setdefault("hold-reason", "no valid client update")
        elif multiplier != 0.0:
            new = lora.apply_increment(theta, self.delta, multiplier)
            if not all_finite(new):
                log(WARNING, "round %d holds: θ_t + %g Δ_t is not finite (θ_t kept)", server_round, multiplier)
                record["hold-reason"] = f"θ_t + {multiplier:g} Δ_t is not finite"
                multiplier, new = 0.0, theta
        record["multiplier"] = multiplier
        if self.averages_factors and self.mean is not None:
            self.record_aggregation_error(server_round, multiplier)
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in new.items()})

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's average, moved by the strategy's :attr:`default_multiplier` (FedAvg: 1;
        fixed: its a); None when no update was averaged (the round holds with θ_t)."""
        mean = self.average_round(server_round, replies)
        arrays = self.apply_multiplier(server_round, self.default_multiplier)
        if mean is None:
            return None, None
        return arrays, MetricRecord({"multiplier": self.records[server_round]["multiplier"]})

    def record_aggregation_error(self, server_round: int, multiplier: float) -> None:
        """Write the round's ``aggregation-error`` (the factor average against the average of the
        products BA) and ``aggregation-error-applied`` (the same for θ_t + aΔ_t at ``multiplier``)
        to its record, from the Gram matrix built once in :meth:`average_round`
        (:func:`fedopd.models.lora.aggregation_errors`; None where the update is 0)."""
        errors = aggregation_errors_from_gram(*self._aggregation, multiplier) if self._aggregation else {"mean": None, "applied": None}
        self.records[server_round]["aggregation-error"] = errors["mean"]
        self.records[server_round]["aggregation-error-applied"] = errors["applied"]

    @property
    def default_multiplier(self) -> float:
        return 1.0

    def evaluation_arrays(self, node_id: int, global_arrays: ArrayRecord) -> ArrayRecord:
        """The adapter that node ``node_id`` evaluates: the global one (Local: its own)."""
        return global_arrays

    def theta_arrays(self) -> Named:
        """θ_t of the current round, as named fp32 arrays (converted once per round)."""
        if self._theta_named is None:
            self._theta_named = from_record(self._theta)
        return self._theta_named
