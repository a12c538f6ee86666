"""Held-out evaluation inside the round: ask every client, aggregate, record.

The server sends each connected client the adapter it should evaluate (the global one; Local:
the client's own) in an ``evaluate`` message; clients answer with greedy accuracy, Avg@k and
Pass@k on their held-out prompts. The aggregate is the num-examples-weighted mean over clients,
for Local the plain mean over clients ("Local mean"). Per-client values are kept.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log

from fedtops_strategy.base import parse_replies
from fedtops_strategy.replies import WEIGHT_KEY, Expected, parse_evaluate, settle_partition_claims

EVALUATE = "evaluate"


def is_evaluation_round(server_round: int, every: int, num_rounds: int) -> bool:
    """Rounds 0, every, 2·every, ... and the last round; never when ``every`` is 0."""
    return every > 0 and (server_round % every == 0 or server_round == num_rounds)


def evaluation_nodes(node_ids, fraction: float, seed: int, server_round: int) -> list[int]:
    """The nodes that evaluate in ``server_round``, sorted: all of them when ``fraction`` is 1,
    else ``max(1, int(fraction × connected))`` drawn without replacement, the draw depending only
    on ``seed``, the round and the node ids."""
    nodes = sorted(int(n) for n in node_ids)
    if fraction >= 1.0 or not nodes:
        return nodes
    count = max(1, int(len(nodes) * fraction))
    return sorted(random.Random(f"fedtops-eval:{seed}:{server_round}").sample(nodes, count))


def aggregate_evaluation(clients: list[dict[str, Any]], *, weighted: bool) -> dict[str, float]:
    """Mean of every metric the clients share, weighted by ``num-examples`` (or not: Local mean)."""
    keys = [k for k in clients[0] if k not in (WEIGHT_KEY, "partition-id", "node-id") and all(k in c for c in clients)]
    weights = [float(c[WEIGHT_KEY]) if weighted else 1.0 for c in clients]
    total = sum(weights)
    return {k: sum(w * float(c[k]) for w, c in zip(weights, clients)) / total for k in keys}


def evaluate_round(
    grid,
    server_round: int,
    arrays_for: Callable[[int], ArrayRecord],
    *,
    local_mean: bool,
    timeout: float,
    fraction: float = 1.0,
    seed: int = 0,
    num_partitions: int | None = None,
    max_examples: int | None = None,
    skip: frozenset[int] = frozenset(),
    on_silence: Callable[[list[int], list[int]], None] | None = None,
    required: tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """Evaluate on the connected nodes; the round record's ``evaluation`` (None if no reply).

    All of them by default; with ``fraction`` < 1 (``eval.fraction``), :func:`evaluation_nodes`.
    Nodes in ``skip`` (sitting out after timeouts, ``timeout.skip-after``) are not asked; replies
    pass the boundary (:func:`fedtops_strategy.replies.parse_evaluate`: partition ids below
    ``num_partitions``, at most ``max_examples`` examples). Two claims of one partition are both
    refused (:func:`~fedtops_strategy.replies.settle_partition_claims`); the replies count without it.
    ``required``: the metrics every reply must hold besides ``accuracy`` (the aggregate keeps the
    metrics all clients share, so one client could otherwise drop a metric from it).
    ``on_silence(asked, silent)``: the nodes asked and those that did not answer in time
    (the strategy counts silence in every phase, ``timeout.skip-after``).
    """
    nodes = evaluation_nodes([n for n in grid.get_node_ids() if int(n) not in skip], fraction, seed, server_round)
    messages = [
        Message(
            content=RecordDict({"arrays": arrays_for(n), "config": ConfigRecord({"server-round": server_round})}),
            message_type=EVALUATE,
            dst_node_id=n,
        )
        for n in nodes
    ]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    expected = Expected(num_partitions=num_partitions, max_examples=max_examples, required=required)
    typed, rejected, excluded = parse_replies(messages, replies, parse_evaluate, expected, "evaluate")
    if on_silence is not None:
        on_silence(nodes, [e["node-id"] for e in excluded])
    typed, disputes = settle_partition_claims(typed)
    for r in rejected:
        log(WARNING, "round %d: evaluation reply of node %d ignored: %s", server_round, r.node_id, r.reason)
        excluded.append(r.entry())
    clients = [r.client_entry() for r in typed]
    if not clients:
        return {"clients": [], "excluded": excluded} if excluded else None
    clients.sort(key=lambda c: (c.get("partition-id", 0), c["node-id"]))
    out: dict[str, Any] = aggregate_evaluation(clients, weighted=not local_mean)
    out.update(aggregate="local-mean" if local_mean else "weighted", clients=clients, excluded=excluded)
    if disputes:
        out["disputed-partitions"] = disputes
    return out
