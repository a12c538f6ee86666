"""A Grid that waits for replies without Flower's fixed 3-second polls.

Flower 1.41's deployment Grid (``HttpGrid.send_and_receive``) checks for replies every 3 s, so
each phase of a round (train, the FedTOPS score query, evaluation) ends up to 3 s after the
last client answered. :class:`PromptGrid` wraps any Grid and waits with short, growing polls
(50 ms doubling to 250 ms): a reply is taken at most 250 ms after it reaches the SuperLink, at
the cost of four small requests per second to it while a phase runs. Everything else is the
wrapped Grid's.

It also measures each phase's traffic: the bytes of every message it sends (before the push) and
of every reply it returns, per node (:mod:`server_app.traffic`), kept in :attr:`PromptGrid.last_traffic`
until the next ``send_and_receive``.

With ``on_error`` set, an error reply's reason is handed to it (with the round, the node the
message went to and its type) and the reply goes on with its root cause's line only
(:func:`server_app.error_lines.root_cause`): the strategies' exclusions, ``rounds.jsonl``,
``status.json`` and the log lines say what happened in one line, the run folder keeps the full text.
The reason is a client's and may be huge: ``on_error`` gets its first
:data:`server_app.error_lines.KEPT_CHARS` characters as a :class:`server_app.error_lines.ClientText`
(with the whole text's length and root cause's line), and :func:`root_cause` reads a bounded head.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import WARNING

from flwr.app import Error, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedtops_strategy.text import escape
from server_app.error_lines import ClientText, root_cause
from server_app.traffic import phase_traffic, sent_bytes

FIRST_POLL_S = 0.05
MAX_POLL_S = 0.25


class PromptGrid(Grid):
    """``on_reply(reply, message)``, when set, is called for each reply as it is taken, with the
    message it answers (None: not one this grid sent) (progress lines).

    ``on_error(server_round, node_id, message_type, reason)``, when set, is called first for each
    error reply with its full reason, which the reply then carries cut to its root cause's line.

    ``last_traffic``: the last ``send_and_receive``'s bytes per node, sorted by node id
    (``[{"node-id", "sent", "received"}]``, :func:`server_app.traffic.phase_traffic`).
    """

    def __init__(
        self,
        grid: Grid,
        on_reply: Callable[[Message, Message | None], None] | None = None,
        on_error: Callable[[int | None, int, str, str], None] | None = None,
    ) -> None:
        self.grid = grid.grid if isinstance(grid, PromptGrid) else grid
        self.on_reply = on_reply
        self.on_error = on_error
        self.last_traffic: list[dict[str, int]] = []

    def set_run(self, run_id: int) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and return the replies that arrive within ``timeout`` seconds;
        their bytes per node are left in :attr:`last_traffic`. Each message's time to live
        (Flower's TTL, 12 h by default) is ``timeout``: a node that gets it later does not run it."""
        messages = list(messages)
        if timeout is not None:
            for message in messages:
                message.metadata.ttl = float(timeout)
        self.last_traffic = []
        sizes = sent_bytes(messages)  # before the push: what leaves is the content as it is now
        ids = list(self.push_messages(messages))  # in order; None (or none at all) for one not pushed
        pushed = [(m, size) for m, size, i in zip(messages, sizes, ids) if i is not None]
        pending = {i for i in ids if i is not None}
        sent = {i: m for m, i in zip(messages, ids) if i is not None}
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        poll = FIRST_POLL_S
        while pending:
            got = list(self.pull_messages(pending))
            replies.extend(got)
            for msg in got:
                self._hooks(msg, sent.get(msg.metadata.reply_to_message_id))
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending:
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            time.sleep(poll if left is None else min(poll, left))
            poll = min(2 * poll, MAX_POLL_S)
        self.last_traffic = phase_traffic([m for m, _ in pushed], replies, [size for _, size in pushed])
        return replies

    def phase_traffic(self) -> list[dict[str, int]]:
        """The bytes per node of the last :meth:`send_and_receive` (a round's phase)."""
        return self.last_traffic

    def _hooks(self, reply: Message, message: Message | None) -> None:
        """``on_error`` and ``on_reply`` for one reply. They log and record; a reply that makes
        them fail (whatever a client put in it) is logged and left to the phase's screening:
        a hook never stops the run, and one that fails does not keep the other from running."""
        try:
            if self.on_error is not None and reply.has_error():
                self._record_error(reply, message)
        except Exception as err:  # noqa: BLE001 - the reply is untrusted input
            _hook_failed(reply, "error", err)
        try:
            if self.on_reply is not None:
                self.on_reply(reply, message)
        except Exception as err:  # noqa: BLE001
            _hook_failed(reply, "reply", err)

    def _record_error(self, reply: Message, message: Message | None) -> None:
        """Leave ``reply``'s root cause's line in the reply and hand its reason's first
        :data:`~server_app.error_lines.KEPT_CHARS` characters to ``on_error``.

        The node and type are the sent message's (an error reply that the SuperLink writes for a
        node it lost comes from the SuperLink, with a system message type)."""
        reason = reply.error.reason
        reason = "" if reason is None else reason if isinstance(reason, str) else escape(reason, 1 << 16)
        line = root_cause(reason)  # reads a bounded head of the text
        if line != reason:  # first: whatever on_error does, the reply carries one safe line on
            reply.error = Error(code=reply.error.code, reason=line)
        node = int(message.metadata.dst_node_id) if message is not None else int(reply.metadata.src_node_id)
        phase = message.metadata.message_type if message is not None else reply.metadata.message_type
        self.on_error(message_round(message), node, phase, ClientText(reason, line))

    def __getattr__(self, name: str):
        return getattr(self.grid, name)


def _hook_failed(reply: Message, hook: str, err: Exception) -> None:
    """A WARNING for a hook that failed on ``reply``; its text escaped (it may quote the reply)."""
    try:
        node = int(reply.metadata.src_node_id)
    except Exception:  # noqa: BLE001
        node = "?"
    log(WARNING, "a reply from node %s could not be logged (%s hook): %s: %s", node, hook, type(err).__name__, escape(err, 200))


def message_round(message: Message | None) -> int | None:
    """The server round a sent message belongs to: its config's ``server-round`` (train, score
    and evaluate messages carry it), else its numeric group id, else None."""
    if message is None:
        return None
    try:
        return int(message.content["config"]["server-round"])
    except Exception:  # noqa: BLE001 - a message without that config
        group = str(message.metadata.group_id)
        return int(group) if group.isdigit() else None
