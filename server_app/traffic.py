"""Communication cost: the bytes each round sends to and receives from each client, by phase.

The size of a message is the serialized size of its content, Flower's ``RecordDict`` protobuf
(``recorddict_to_proto(content).ByteSize()``): the arrays' raw bytes plus their names, dtypes,
shapes and the config and metric entries, without the transport's framing and metadata. An
error reply has no content and counts 0. :class:`server_app.grid.PromptGrid` measures every
phase it runs (:func:`phase_traffic`); the ServerApp writes a round's phases to its record
(:func:`round_communication`), and the run's figure and summary add them up (:func:`run_traffic`).

Each count is what one client is sent or sends. Flower 1.41's transport moves the content as
hashed objects with headers of their own: a content sent to several clients (the score query's
Δ_t, the global adapter) is stored once on the SuperLink and pulled by each client, and identical
array chunks (the all-zero ``lora_B`` factors of the initial adapter) are stored once. The counts
are the content's size, within a few percent of the transport's for a trained adapter
(docs/run-folder.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Message, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedtops_strategy.replies import content_bytes as buffer_bytes
from fedtops_strategy.sampling import reply_nodes

PHASES = ("train", "score", "evaluate")  # the keys of a round's "communication", in round order


def content_bytes(content: RecordDict) -> int:
    """Serialized size of a message content (``RecordDict``) in bytes."""
    return recorddict_to_proto(content).ByteSize()


# A reply whose buffers hold more than this is counted from their lengths instead of serialized:
# serializing copies the whole content, and a reply's size is whatever its sender chose.
SERIALIZE_AT_MOST = 1 << 26  # 64 MiB


def message_bytes(message: Message) -> int:
    """Serialized size of ``message``'s content; 0 for an error reply (it has none). A content whose
    buffers hold more than :data:`SERIALIZE_AT_MOST` bytes: the sum of their lengths
    (:func:`fedtops_strategy.replies.content_bytes`, no copy), within the framing of the serialized size."""
    if not message.has_content():
        return 0
    cheap = buffer_bytes(message.content)
    return cheap if cheap > SERIALIZE_AT_MOST else content_bytes(message.content)


def sent_bytes(messages: Sequence[Message]) -> list[int]:
    """:func:`message_bytes` of each message, a content shared by several messages measured once."""
    sizes: dict[int, int] = {}
    out = []
    for m in messages:
        if not m.has_content():
            out.append(0)
            continue
        key = id(m.content)
        if key not in sizes:
            sizes[key] = content_bytes(m.content)
        out.append(sizes[key])
    return out


def phase_traffic(sent: Sequence[Message], replies: Sequence[Message], sizes: Sequence[int] | None = None) -> list[dict[str, int]]:
    """One phase's traffic per node, sorted by node id: ``{"node-id", "sent", "received"}``.

    ``sent`` are the messages pushed (with their message ids, to match the replies), ``sizes``
    their sizes if measured before the push (else measured here); each reply counts for the node
    it answers for (:func:`~fedtops_strategy.sampling.reply_nodes`). A node that was sent a
    message and did not reply has received 0.
    """
    sizes = sent_bytes(sent) if sizes is None else list(sizes)
    if len(sizes) != len(sent):
        raise ValueError(f"{len(sent)} messages but {len(sizes)} sizes")
    nodes: dict[int, dict[str, int]] = {}
    for message, size in zip(sent, sizes):
        nodes.setdefault(int(message.metadata.dst_node_id), {"sent": 0, "received": 0})["sent"] += int(size)
    for reply, node in zip(replies, reply_nodes(sent, replies)):
        nodes.setdefault(int(node), {"sent": 0, "received": 0})["received"] += message_bytes(reply)
    return [{"node-id": node, **nodes[node]} for node in sorted(nodes)]


def totals(traffic: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(bytes sent, bytes received) over a phase's per-node entries."""
    sent = received = 0
    for entry in traffic:
        sent += int(entry["sent"])
        received += int(entry["received"])
    return sent, received


def round_communication(phases: Mapping[str, list[dict[str, int]]]) -> dict[str, Any]:
    """A round record's ``communication``: each phase that ran, and ``sent`` / ``received``, the
    round's bytes over all its phases and clients."""
    out: dict[str, Any] = {phase: list(phases[phase]) for phase in PHASES if phase in phases}
    sent, received = totals(entry for phase in out.values() for entry in phase)
    out.update(sent=sent, received=received)
    return out


def run_traffic(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Bytes sent and received over the run's round records, by phase and in all (``"total"``);
    phases that never ran are absent, and everything is absent for records without
    ``communication`` (runs made before it was recorded)."""
    out: dict[str, dict[str, int]] = {}
    for record in records:
        communication = record.get("communication")
        if not communication:
            continue
        for phase in PHASES:
            if phase in communication:
                sent, received = totals(communication[phase])
                entry = out.setdefault(phase, {"sent": 0, "received": 0})
                entry["sent"] += sent
                entry["received"] += received
        entry = out.setdefault("total", {"sent": 0, "received": 0})
        entry["sent"] += int(communication.get("sent", 0))
        entry["received"] += int(communication.get("received", 0))
    return out


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``812 B``, ``51.2 kB``, ``3.47 MB``, ``1.25 GB``."""
    n = float(n)
    if n < 1e3:
        return f"{n:.0f} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if n < 1e3 * scale or unit == "GB":
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
