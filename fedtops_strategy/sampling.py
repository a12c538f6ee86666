"""Which nodes a round asks, and what happens to nodes that stay silent.

* :class:`NodeSampler`: which nodes round t trains: Flower's FedAvg draw, seeded by the run's seed
  and the round, over :class:`SortedNodes`; the first round waits for ``num-clients``, later ones
  sample from the nodes that are connected.
* :class:`SortedNodes`: a view of a Grid whose node list is sorted (Flower samples from that list's
  order, so a seeded draw depends only on the seed, the round and the node ids), without the nodes
  that sit out, and with a deadline on waiting for enough nodes to connect (Flower's
  ``sample_nodes`` would otherwise wait forever).
* :class:`Silence`: per node, the rounds in which it did not answer in time in some phase it was
  asked in (train, score *or* evaluate). A node silent in ``skip_after`` (k) of the last 2k rounds
  it was asked in, consecutive or not, sits out the next k rounds of sampling and evaluation, twice
  as many each time it is set out again before 2k answered rounds clear its history.
* :func:`reply_nodes` and :func:`missing_replies`: which node each reply answers for (from the
  messages the server sent, never from a reply's content), and which sent messages got none.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.common.logger import log

MAX_DOUBLINGS = 5  # a node sits out at most 32 × timeout.skip-after rounds at a time


class NodesNotConnected(RuntimeError):
    """A round waited ``timeout.start`` seconds for the nodes it needs; the message says how many it saw."""


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


class SortedNodes:
    """A Grid whose ``get_node_ids`` is sorted, without the ``skipped`` nodes while enough others are
    connected (``needed``), and that raises :class:`NodesNotConnected` once it has been asked for
    longer than ``deadline`` seconds with fewer than ``needed`` nodes."""

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


class Silence:
    """Per node, how often it stayed silent in the rounds it was asked (module docstring).

    A round counts as silent for a node when it did not answer in time in some phase it was asked
    in (train, score *or* evaluate; once per round). A node sits out when it was silent in at least
    ``skip_after`` (k) of the last 2k rounds it was asked in, consecutive or not, so a node silent
    every other round is set out too. It sits out k rounds the first time, and twice as many each
    time it is set out again before its last 2k rounds asked hold no silence (at most
    :data:`MAX_DOUBLINGS` doublings): a node that keeps failing costs a deadline ever more rarely,
    and one that answers 2k rounds in a row starts afresh.

    Each phase reports whom it asked and who did not answer in time (:meth:`note`); a silence
    counts as soon as it is noted (so that the nodes that sit out are known before the round's
    evaluation), an answer when the round closes (:meth:`close_round`)."""

    def __init__(self, skip_after: int = 0) -> None:
        self.skip_after = int(skip_after)
        self.history: dict[int, list[bool]] = {}  # node -> silent?, for the last 2k rounds it was asked in
        self.times_out: dict[int, int] = {}  # node -> times set out since its history was last clean
        self.skipped_until: dict[int, int] = {}  # node -> the last round it sits out
        self._silent_in: dict[int, int] = {}  # node -> the last round it was counted silent in
        self._asked: dict[int, set[int]] = {}  # round -> the nodes asked in it

    @property
    def counts(self) -> dict[int, int]:
        """Node -> the silent rounds among the last 2k it was asked in."""
        return {node: sum(h) for node, h in self.history.items()}

    def _push(self, node: int, silent: bool) -> None:
        window = max(2 * self.skip_after, 1)
        self.history[node] = (self.history.get(node, []) + [silent])[-window:]
        if not any(self.history[node]):
            self.times_out[node] = 0

    def note(self, server_round: int, asked: Iterable[int], silent: Iterable[int]) -> None:
        """A phase of ``server_round`` asked ``asked``; ``silent`` did not answer in time."""
        self._asked.setdefault(server_round, set()).update(int(n) for n in asked)
        for node in sorted({int(n) for n in silent}):
            if self._silent_in.get(node) == server_round:
                continue  # one round counts once, whatever its phases
            self._silent_in[node] = server_round
            self._push(node, True)
            if self.skip_after and sum(self.history[node]) >= self.skip_after:
                rounds = self.skip_after * 2 ** min(self.times_out.get(node, 0), MAX_DOUBLINGS)
                self.times_out[node] = self.times_out.get(node, 0) + 1
                self.skipped_until[node] = server_round + rounds
                log(
                    WARNING,
                    "node %d did not answer in time in %d of the last %d rounds it was asked in; it sits out rounds %d-%d (timeout.skip-after)",
                    node,
                    sum(self.history[node]),
                    len(self.history[node]),
                    server_round + 1,
                    server_round + rounds,
                )

    def close_round(self, server_round: int) -> None:
        """Count an answer for every node that answered every phase it was asked in ``server_round``."""
        for node in sorted(self._asked.pop(server_round, set())):
            if self._silent_in.get(node) != server_round:
                self._push(node, False)

    def sitting_out(self, server_round: int) -> frozenset[int]:
        """The nodes that sit out ``server_round``."""
        return frozenset(n for n, last in self.skipped_until.items() if last >= server_round)


class NodeSampler:
    """Which nodes a round's train messages go to (Flower's FedAvg sampling, seeded).

    ``sample`` runs Flower's FedAvg ``configure_train`` (``flower``) over a
    :class:`SortedNodes` view, with Python's ``random`` seeded from ``seed`` and the round and put
    back afterwards, so that the draw of round t depends only on the seed, t and the connected node
    ids. The first round this server runs (round 1, or the first round of a resumed run) waits for
    the clients the strategy was made for (``min_available_nodes``, ``num-clients``) and samples
    from them; from then on a round samples from the nodes that are connected, so a lost client
    never stalls the run. Nodes in ``sitting_out`` are not drawn while enough others are connected.
    """

    def __init__(self, seed: int = 0, start_timeout: float = float("inf")) -> None:
        self.seed, self.start_timeout = seed, start_timeout
        self.first_round: int | None = None  # the first round this server ran (it waited for num-clients)

    def sample(self, flower, server_round: int, arrays, config, grid, sitting_out: frozenset[int]) -> tuple[list[Message], list[int]]:
        """(the train messages to the round's sampled nodes, in Flower's random order; the nodes
        left out because they sit out)."""
        if self.first_round is None:
            self.first_round = server_round
        saved, min_train, min_available = random.getstate(), flower.min_train_nodes, flower.min_available_nodes
        random.seed(f"fedtops-sampling:{self.seed}:{server_round}")
        if server_round == self.first_round:
            # Flower sizes the sample on the nodes connected *before* it waits for
            # min_available_nodes; the first round samples from the num-clients it waits for.
            flower.min_train_nodes = max(min_train, int(min_available * flower.fraction_train))
        else:  # later rounds sample from the nodes connected, waiting only for min_train_nodes
            flower.min_available_nodes = min_train
        view = SortedNodes(grid, max(flower.min_available_nodes, min_train), self.start_timeout, sitting_out, server_round)
        try:
            sampled = list(flower.configure_train(server_round, arrays, config, view))
        finally:
            random.setstate(saved)
            flower.min_train_nodes, flower.min_available_nodes = min_train, min_available
        return sampled, view.left_out
