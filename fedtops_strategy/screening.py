"""What the three strategies share: screening train replies and recording each round.

A train reply joins the average only if it carries one ArrayRecord with exactly the keys and
shapes of θ_t, finite values, and a positive ``num-examples``. Anything else is left out and
logged, and never reaches the global adapter. Each round leaves a record (``self.records``) that
the ServerApp writes to ``rounds.jsonl``.

What a client does differently for a strategy travels in the train message's config, never as
the strategy's name (``client_app/handlers.py`` reads it):

* ``"learner"``: ``"federated"`` (its own prompts, from the adapter it is sent), ``"local"`` (the
  same, and it keeps its own adapter: a resumed client restores it), ``"centralized"`` (one
  learner on the pooled prompts of every partition, with their combined rollouts per round);
* ``"build-scoring-cache"``: build the scoring cache before the local epoch (FedTOPS scores
  candidates on it).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from fedopd.lora import Named, aggregation_errors_from_gram, aggregation_gram, check_compatible, from_record
from fedtops_strategy.schema import WEIGHT_KEY, train_metrics_problem


def reply_problem(content, reference: ArrayRecord, num_partitions: int | None = None) -> str | None:
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
    return train_metrics_problem(dict(next(iter(content.metric_records.values())).items()), num_partitions)


def aggregation_view(message: Message) -> Message:
    """A screened train reply as Flower's aggregation sees it: its one ArrayRecord and only the
    weight. A client's other metrics (a newer client's extra key, a list) can then never trip
    Flower's ``validate_message_reply_consistency``; they stay in the round record."""
    arrays = next(iter(message.content.array_records.values()))
    weight = next(iter(message.content.metric_records.values()))[WEIGHT_KEY]
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({WEIGHT_KEY: weight})})
    return Message(content=content, metadata=copy.copy(message.metadata))


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
    """A view of a Grid whose ``get_node_ids`` is sorted (Flower samples from that list's order)."""

    def __init__(self, grid) -> None:
        self._grid = grid

    def get_node_ids(self) -> list[int]:
        return sorted(int(n) for n in self._grid.get_node_ids())

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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: dict[int, dict[str, Any]] = {}
        self._theta: ArrayRecord | None = None
        self._sent: list[Message] = []
        self.round_started = 0.0
        self.first_round: int | None = None  # the first round this strategy configured
        self.sampled_node_ids: list[int] = []  # the nodes the current round's train messages went to
        self._aggregation: tuple[np.ndarray, list[float]] | None = None  # the round's aggregation Gram matrix and client weights

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
        sampled = self._sample(server_round, arrays, config, grid)
        messages = self.prepare_messages(sampled, arrays)
        self._sent = messages  # the grid sets their message ids when it pushes them
        self.sampled_node_ids = sorted(int(m.metadata.dst_node_id) for m in sampled)
        return messages

    def _sample(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> list[Message]:
        """Flower's FedAvg sampling with a draw that depends only on ``sampling_seed``, the round
        and the connected node ids (in sorted order), and leaves Python's global ``random`` as it was."""
        saved, min_train = random.getstate(), self.min_train_nodes
        random.seed(f"fedtops-sampling:{self.sampling_seed}:{server_round}")
        if server_round == self.first_round:
            # Flower sizes the sample on the nodes connected *before* it waits for
            # min_available_nodes; the first round samples from the num-clients it waits for.
            self.min_train_nodes = max(min_train, int(self.min_available_nodes * self.fraction_train))
        try:
            return list(super().configure_train(server_round, arrays, config, _SortedNodes(grid)))
        finally:
            random.setstate(saved)
            self.min_train_nodes = min_train

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        """The train messages as sent (a subclass may replace or drop some); by default unchanged."""
        return messages

    def screen_train_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        kept, clients, excluded = [], [], []
        replies = list(replies)
        excluded.extend(missing_replies(self._sent, replies, "train"))
        for msg, node in zip(replies, reply_nodes(self._sent, replies)):
            problem = f"error reply: {msg.error.reason}" if msg.has_error() else reply_problem(msg.content, self._theta, self.num_partitions)
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
        return kept

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        kept = self.screen_train_replies(server_round, replies)
        arrays, metrics = super().aggregate_train(server_round, [aggregation_view(m) for m in kept])
        record = self.records[server_round]
        record.setdefault("multiplier", self.default_multiplier if arrays is not None else 0.0)
        self._aggregation = None
        if arrays is None:
            record["hold-reason"] = "no valid client update"
        elif self.averages_factors:
            clients = [from_record(next(iter(m.content.array_records.values()))) for m in kept]
            weights = [float(c[WEIGHT_KEY]) for c in record["clients"]]
            try:
                self._aggregation = (aggregation_gram(self.theta_arrays(), clients, weights), weights)
            except ValueError as err:  # a diagnostic never stops a round: factors without A/B pairs
                log(WARNING, "round %d: no aggregation error: %s", server_round, err)
                self._aggregation = None
            self.record_aggregation_error(server_round, record["multiplier"])
        return arrays, metrics

    def record_aggregation_error(self, server_round: int, multiplier: float) -> None:
        """Write the round's ``aggregation-error`` (the factor average against the average of the
        products BA) and ``aggregation-error-applied`` (the same for θ_t + aΔ_t at ``multiplier``)
        to its record, from the Gram matrix built once in ``aggregate_train``
        (:func:`fedopd.lora.aggregation_errors`; None where the update is 0)."""
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
