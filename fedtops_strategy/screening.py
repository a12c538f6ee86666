"""What the three strategies share: screening train replies and recording each round.

A train reply joins the average only if it carries one ArrayRecord with exactly the keys and
shapes of θ_t, finite values, and metrics that pass the train schema
(:mod:`fedtops_strategy.schema`). Anything else is left out and logged, and never reaches the
global adapter. The kept updates may then be bounded (:mod:`fedtops_strategy.bounds`) and are
averaged by the strategy's own Flower FedAvg or by Flower's robust aggregator
(:mod:`fedtops_strategy.aggregators`); an average that is not finite holds the round. Each
round leaves a record (``self.records``) that the ServerApp writes to ``rounds.jsonl``.

Nodes that stop answering are skipped for a while (``timeout.skip-after``), and a round that
waits for nodes to connect gives up after ``timeout.start`` (:class:`NodesNotConnected`).

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

import copy
import random
import time
from collections.abc import Iterable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy import Krum, MultiKrum

from fedopd.models.lora import Named, aggregation_errors_from_gram, aggregation_gram, check_compatible, from_record
from fedtops_strategy.bounds import all_finite, capped_weights, clip_scales, clipped, update_norm
from fedtops_strategy.schema import WEIGHT_KEY, train_metrics_problem


def reply_problem(content, reference: ArrayRecord, num_partitions: int | None = None, max_examples: int | None = None) -> str | None:
    """Why a train reply cannot be averaged with θ_t (``reference``), or None: its arrays, and its
    metrics against the train schema (:func:`fedtops_strategy.schema.train_metrics_problem`)."""
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        return f"expected one ArrayRecord and one MetricRecord, got {len(content.array_records)} and {len(content.metric_records)}"
    arrays = next(iter(content.array_records.values()))
    if list(arrays.keys()) != list(reference.keys()):
        return "its array keys differ from the global adapter's"
    try:
        problem = check_compatible(from_record(reference), from_record(arrays))
    except Exception as err:  # noqa: BLE001 - undecodable arrays are just another bad reply
        return f"its arrays cannot be decoded ({err})"
    if problem:
        return problem
    return train_metrics_problem(dict(next(iter(content.metric_records.values())).items()), num_partitions, max_examples)


def aggregation_view(
    message: Message, arrays: ArrayRecord | None = None, weight: float | None = None, extra: dict[str, Any] | None = None
) -> Message:
    """A screened train reply as Flower's aggregation sees it: its one ArrayRecord (or ``arrays``,
    bounded) in a record of its own (Flower's FedMedian pops from it) and only the weight (or
    ``weight``, capped). A client's other metrics (a newer client's extra key, a list) can then
    never trip Flower's ``validate_message_reply_consistency``; they stay in the round record.
    ``extra``: metrics the aggregation needs besides the weight (Flower's adaptive clipping: the norm bit)."""
    if arrays is None:
        arrays = next(iter(message.content.array_records.values()))
    if weight is None:
        weight = next(iter(message.content.metric_records.values()))[WEIGHT_KEY]
    content = RecordDict({"arrays": ArrayRecord(dict(arrays.items())), "metrics": MetricRecord({WEIGHT_KEY: weight, **(extra or {})})})
    return Message(content=content, metadata=copy.copy(message.metadata))


class NodesNotConnected(RuntimeError):
    """A round waited ``timeout.start`` seconds for the nodes it needs; the message says how many it saw."""


def client_metrics(message: Message) -> dict[str, Any]:
    """The metrics of a train reply as a plain dict, with its node id."""
    metrics = next(iter(message.content.metric_records.values()))
    out: dict[str, Any] = {"node-id": int(message.metadata.src_node_id)}
    out.update({k: (list(v) if isinstance(v, list) else v) for k, v in metrics.items()})
    return out


def reply_nodes(sent: Sequence[Message], replies: Sequence[Message]) -> list[int]:
    """The node each reply answers for: its sender, or, for an error reply that the SuperLink
    wrote for a node it lost (sender: the SuperLink), the node the original message went to."""
    destination = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent}
    return [destination.get(r.metadata.reply_to_message_id, int(r.metadata.src_node_id)) for r in replies]


def missing_replies(sent: Sequence[Message], replies: Sequence[Message], phase: str) -> list[dict[str, Any]]:
    """``excluded`` entries for the messages in ``sent`` that got no reply (in time) in ``phase``."""
    answered = {r.metadata.reply_to_message_id for r in replies}
    out = []
    for m in sent:
        if m.metadata.message_id not in answered:
            node = int(m.metadata.dst_node_id)
            log(WARNING, "%s: node %d did not reply in time; left out of this round", phase, node)
            out.append({"node-id": node, "reason": f"{phase}: no reply before the timeout"})
    return out


class _SortedNodes:
    """A view of a Grid whose ``get_node_ids`` is sorted (Flower samples from that list's order),
    without the ``skipped`` nodes while enough others are connected (``needed``), and that raises
    :class:`NodesNotConnected` once it has been asked for longer than ``deadline`` seconds with
    fewer than ``needed`` nodes (Flower's ``sample_nodes`` asks every second and otherwise waits
    forever)."""

    def __init__(self, grid, needed: int = 0, deadline: float = float("inf"), skipped: frozenset[int] = frozenset(), server_round: int = 0) -> None:
        self._grid = grid
        self.needed, self.deadline, self.skipped, self.server_round = needed, deadline, skipped, server_round
        self.started = time.monotonic()
        self.left_out: list[int] = []  # the skipped nodes this view last left out

    def get_node_ids(self) -> list[int]:
        nodes = sorted(int(n) for n in self._grid.get_node_ids())
        eligible = [n for n in nodes if n not in self.skipped]
        if len(eligible) < self.needed:  # too few without them: a skipped node is better than a stalled round
            eligible = nodes
        self.left_out = sorted(set(nodes) - set(eligible))
        waited = time.monotonic() - self.started
        if len(eligible) < self.needed and waited > self.deadline:
            raise NodesNotConnected(
                f"round {self.server_round} waited {waited:.0f} s (timeout.start = {self.deadline:g}) for {self.needed} connected "
                f"node(s) and saw {len(nodes)}" + (f" ({', '.join(map(str, nodes))})" if nodes else "")
            )
        return eligible

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


class ReplyScreening:
    """Mixin for a Flower ``FedAvg`` subclass: screens train replies, records rounds.

    Must come before the Flower strategy in the bases. Subclasses set :attr:`strategy_name`
    (the round record's ``strategy``), :attr:`learner` and :attr:`builds_scoring_cache` (the
    train config's ``learner`` and ``build-scoring-cache``), and may fill more of
    ``self.records[server_round]``.
    """

    strategy_name = "fedavg"
    learner = "federated"
    builds_scoring_cache = False
    averages_factors = True  # records the aggregation error of averaging the LoRA factors
    sampling_seed = 0  # the run's seed (make_strategy): which nodes round t samples
    num_partitions: int | None = None  # partition ids a reply may carry: [0, n) (make_strategy); None: any >= 0
    max_examples: int | None = None  # the most num-examples a train reply may claim (make_strategy); None: no bound
    # Robustness (make_strategy sets them from strategy.* and timeout.*; these defaults are the paper's)
    clip_norm = 0.0  # 0 = off; c: updates scaled to at most c × the round's median norm
    max_weight = 0.0  # 0 = off; c: weights cut to at most c × the round's median
    aggregator = None  # a Flower strategy whose aggregate_train averages (None: this strategy's own FedAvg)
    privacy = None  # fedtops_strategy.privacy.UpdatePrivacy: Flower's DP wrapper averages instead (privacy.*)
    scoring_cache = "round"  # where clients take the scoring cache's rollouts from (a variant: "untrained")
    start_timeout = float("inf")  # seconds a round waits for the nodes it needs
    skip_after = 0  # consecutive timed-out rounds after which a node sits out as many rounds (0: never)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: dict[int, dict[str, Any]] = {}
        self._theta: ArrayRecord | None = None
        self._sent: list[Message] = []
        self.round_started = 0.0
        self.first_round: int | None = None  # the first round this strategy configured
        self.sampled_node_ids: list[int] = []  # the nodes the current round's train messages went to
        self._aggregation: tuple[np.ndarray, list[float]] | None = None  # the round's aggregation Gram matrix and client weights
        self.client_weights: dict[int, float] = {}  # node -> its weight in the round's average (Ĵ uses the same)
        self.timeouts: dict[int, int] = {}  # node -> consecutive rounds in which it did not answer in time
        self._timed_out_in: dict[int, int] = {}  # node -> the last round it was counted as timed out in
        self.skipped_until: dict[int, int] = {}  # node -> the last round it sits out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self._theta = arrays
        self.round_started = time.perf_counter()
        if self.first_round is None:
            # The first round this server runs (round 1, or the first round of a resumed run)
            # waits for the clients the strategy was made for (``num-clients``).
            self.first_round = server_round
        elif server_round != self.first_round:
            # From then on a round samples from the clients that are connected, so a lost
            # client never stalls the run.
            self.min_available_nodes = self.min_train_nodes
        config["learner"] = self.learner
        config["build-scoring-cache"] = self.builds_scoring_cache
        if self.scoring_cache != "round":  # the paper's messages stay as they were
            config["scoring-cache"] = self.scoring_cache
        if self.privacy is not None:
            self.privacy.train_config(config)  # client side: the clipping norm for Flower's mod
        self.skipped_node_ids: list[int] = []
        sampled = self._sample(server_round, arrays, config, grid)
        messages = self.prepare_messages(sampled, arrays)
        self._sent = messages  # the grid sets their message ids when it pushes them
        self.sampled_node_ids = sorted(int(m.metadata.dst_node_id) for m in sampled)
        return messages

    def _sample(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> list[Message]:
        """Flower's FedAvg sampling with a draw that depends only on ``sampling_seed``, the round
        and the connected node ids (in sorted order), and leaves Python's global ``random`` as it was;
        nodes that sit out this round (``timeout.skip-after``) are not drawn."""
        saved, min_train = random.getstate(), self.min_train_nodes
        random.seed(f"fedtops-sampling:{self.sampling_seed}:{server_round}")
        if server_round == self.first_round:
            # Flower sizes the sample on the nodes connected *before* it waits for
            # min_available_nodes; the first round samples from the num-clients it waits for.
            self.min_train_nodes = max(min_train, int(self.min_available_nodes * self.fraction_train))
        view = _SortedNodes(grid, max(self.min_available_nodes, min_train), self.start_timeout, self.sitting_out(server_round), server_round)
        try:
            return list(super().configure_train(server_round, arrays, config, view))
        finally:
            random.setstate(saved)
            self.min_train_nodes = min_train
            self.skipped_node_ids = view.left_out

    def sitting_out(self, server_round: int) -> frozenset[int]:
        """The nodes that sit out ``server_round`` (``timeout.skip-after``)."""
        return frozenset(n for n, last in self.skipped_until.items() if last >= server_round)

    def note_timeouts(self, server_round: int, sent: Sequence[int], timed_out: Iterable[int]) -> None:
        """Count, per node, the consecutive rounds it did not answer in time (train or score):
        a node that answered is cleared; one at ``skip_after`` sits out the next ``skip_after`` rounds."""
        timed_out = set(timed_out)
        for node in sent:
            if node not in timed_out:
                if self._timed_out_in.get(node) != server_round:  # a train timeout stands for the round
                    self.timeouts[node] = 0
                continue
            if self._timed_out_in.get(node) == server_round:
                continue
            self._timed_out_in[node] = server_round
            self.timeouts[node] = self.timeouts.get(node, 0) + 1
            if self.skip_after and self.timeouts[node] >= self.skip_after:
                self.skipped_until[node] = server_round + self.skip_after
                log(
                    WARNING,
                    "node %d did not answer in time in %d consecutive rounds; it sits out rounds %d-%d (timeout.skip-after)",
                    node,
                    self.timeouts[node],
                    server_round + 1,
                    server_round + self.skip_after,
                )

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        """The train messages as sent (a subclass may replace or drop some); by default unchanged."""
        return messages

    def screen_train_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        kept, clients, excluded = [], [], []
        replies = list(replies)
        excluded.extend(missing_replies(self._sent, replies, "train"))
        self.note_timeouts(server_round, [int(m.metadata.dst_node_id) for m in self._sent], [e["node-id"] for e in excluded])
        theta = self.theta_arrays() if self.privacy is not None else None  # once, for the privacy check of every reply
        for msg, node in zip(replies, reply_nodes(self._sent, replies)):
            problem = (
                f"error reply: {msg.error.reason}"
                if msg.has_error()
                else reply_problem(msg.content, self._theta, self.num_partitions, self.max_examples)
            )
            if not problem and self.privacy is not None:
                problem = self.privacy.reply_problem(
                    next(iter(msg.content.metric_records.values())), theta, from_record(next(iter(msg.content.array_records.values())))
                )
            if problem:
                log(WARNING, "round %d: update of node %d left out of the average: %s", server_round, node, problem)
                excluded.append({"node-id": node, "reason": problem})
                continue
            kept.append(msg)
            clients.append(client_metrics(msg))
        # Flower samples nodes in random order; fix one (by partition, then node id) so that the
        # fp32 average, the score query and the round record do not depend on it.
        order = sorted(range(len(kept)), key=lambda i: (clients[i].get("partition-id", 0), clients[i]["node-id"]))
        kept, clients = [kept[i] for i in order], [clients[i] for i in order]
        self.records[server_round] = {
            "round": server_round,
            "strategy": self.strategy_name,
            "sampled-node-ids": list(self.sampled_node_ids),
            "trained-node-ids": sorted(c["node-id"] for c in clients),
            "candidates": None,
            "teacher_scores": None,
            "change_scores": None,
            "clients": clients,
            "excluded": excluded,
        }
        if self.skipped_node_ids:
            self.records[server_round]["skipped-node-ids"] = list(self.skipped_node_ids)
        return kept

    def bounded_views(self, server_round: int, kept: list[Message]) -> list[Message]:
        """The kept replies as the aggregation sees them (:func:`aggregation_view`), with their
        updates clipped (``clip_norm``) and weights capped (``max_weight``); sets
        :attr:`client_weights`. With both off, the replies' own arrays and weights."""
        weights = [float(c[WEIGHT_KEY]) for c in self.records[server_round]["clients"]]
        nodes = [c["node-id"] for c in self.records[server_round]["clients"]]
        if self.privacy is not None:
            # Equal weights: the noise is calibrated to the plain mean's sensitivity C/m; Ĵ uses the same.
            self.client_weights = dict.fromkeys(nodes, 1.0)
            return [aggregation_view(m, None, 1, self.privacy.view_metrics(next(iter(m.content.metric_records.values())))) for m in kept]
        capped = capped_weights(weights, self.max_weight)
        self.client_weights = dict(zip(nodes, capped))
        if not self.clip_norm and not self.max_weight:
            return [aggregation_view(m) for m in kept]
        theta = self.theta_arrays()
        arrays = [from_record(next(iter(m.content.array_records.values()))) for m in kept]
        norms = [update_norm(theta, a) for a in arrays]
        scales = clip_scales(norms, self.clip_norm)
        views, bounded = [], []
        for msg, node, a, norm, scale, w, cw in zip(kept, nodes, arrays, norms, scales, weights, capped):
            record = ArrayRecord({k: Array(v) for k, v in clipped(theta, a, scale).items()}) if scale < 1.0 else None
            views.append(aggregation_view(msg, record, cw if cw < w else None))
            bounded.append({"node-id": node, "update-norm": norm, "scale": scale, "weight": cw})
            if scale < 1.0 or cw < w:
                log(WARNING, "round %d: node %d's update bounded: norm %.4g scaled by %.4g, weight %g -> %g", server_round, node, norm, scale, w, cw)
        self.records[server_round]["bounded"] = bounded
        return views

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        kept = self.screen_train_replies(server_round, replies)
        views = self.bounded_views(server_round, kept)
        arrays, metrics = self.average(server_round, views)
        record = self.records[server_round]
        if arrays is not None and not all_finite(from_record(arrays)):
            log(WARNING, "round %d holds: the average of the kept updates is not finite (θ_t kept)", server_round)
            record["multiplier"] = 0.0
            record["hold-reason"] = "the averaged adapter is not finite"
            arrays, metrics = None, None
        record.setdefault("multiplier", self.default_multiplier if arrays is not None else 0.0)
        self._aggregation = None
        if arrays is None:
            record.setdefault("hold-reason", "no valid client update")
        elif self.averages_factors:
            # The diagnostic compares the weighted mean of factors with that of products: none for
            # a robust aggregate (docs/robustness.md). Flower's FedMedian emptied the views then.
            if self.aggregator is None:
                clients = [from_record(next(iter(m.content.array_records.values()))) for m in views]
                weights = [float(next(iter(m.content.metric_records.values()))[WEIGHT_KEY]) for m in views]
                try:
                    self._aggregation = (aggregation_gram(self.theta_arrays(), clients, weights), weights)
                except ValueError as err:  # a diagnostic never stops a round: factors without A/B pairs
                    log(WARNING, "round %d: no aggregation error: %s", server_round, err)
                    self._aggregation = None
            self.record_aggregation_error(server_round, record["multiplier"])
        return arrays, metrics

    def average(self, server_round: int, views: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """θ_t + a (aggregate − θ_t) at the strategy's default a (FedAvg, FedTOPS: 1; fixed: its
        own): Flower's FedAvg (FedAvgM) on the views, :attr:`aggregator`'s ``aggregate_train``, or,
        with :attr:`privacy`, Flower's DP wrapper around FedAvg (the noisy mean), then moved by a."""
        if self.privacy is not None:
            arrays, metrics, released = self.privacy.release(server_round, views, self._theta)
            # ε so far, in every round's record: one that released nothing (no views) included
            self.records[server_round]["privacy"] = {**released, **self.privacy.ledger.summary()}
        elif self.aggregator is None:
            return super().aggregate_train(server_round, views)
        else:
            arrays, metrics = self._robust_average(server_round, views)
        if arrays is None or self.default_multiplier == 1.0:
            return arrays, metrics
        theta = self.theta_arrays()
        moved = {k: (theta[k] + self.default_multiplier * (v - theta[k])).astype(v.dtype) for k, v in from_record(arrays).items()}
        return ArrayRecord({k: Array(v) for k, v in moved.items()}), metrics

    def _robust_average(self, server_round: int, views: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if isinstance(self.aggregator, MultiKrum) and not isinstance(self.aggregator, Krum):  # Krum is MultiKrum selecting 1
            self.aggregator.num_nodes_to_select = max(1, len(views) - self.aggregator.num_malicious_nodes)
        return self.aggregator.aggregate_train(server_round, views)

    def record_aggregation_error(self, server_round: int, multiplier: float) -> None:
        """Write the round's ``aggregation-error`` (the factor average against the average of the
        products BA) and ``aggregation-error-applied`` (the same for θ_t + aΔ_t at ``multiplier``)
        to its record, from the Gram matrix built once in ``aggregate_train``
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
        """θ_t of the current round, as named fp32 arrays."""
        return from_record(self._theta)
