"""The ServerApp's log lines: one per client reply as it arrives, one per round (with the
round's bytes sent to and received from its clients).

Each is a pure function of a reply message or a round record (``rounds.jsonl``), so what a run
shows with ``flwr run --stream`` can be tested on hand-made inputs.

A reply is untrusted: a progress line is written from the reply as the boundary checks it
(:func:`fedtops_strategy.replies.parse_progress`: metric names of a fixed alphabet, finite numbers,
a ``partition-id`` that is an int in ``[0, MAX_PARTITION_ID)``), and an error's reason is one
escaped line (:func:`server_app.error_lines.root_cause`), so neither can break the line or paint
it; the node id is the message metadata's (the SuperLink's).
"""

from __future__ import annotations

from logging import INFO

from flwr.common.logger import log

from fedtops_strategy.replies import MAX_LIST, Expected, Rejection, parse_progress
from fedtops_strategy.text import escape
from server_app.error_lines import root_cause
from server_app.traffic import human_bytes

MAX_SAMPLED = 8  # sampled metrics (avg@k, pass@k) shown per line; more: "…"
KEY_CHARS = 40  # a metric key shown escaped, at most this long


def sampled_summary(metrics) -> str:
    """``avg@8 21.9% pass@8 57.3%``: the sampled accuracies among ``metrics`` (keys escaped, at most
    :data:`MAX_SAMPLED` of them)."""
    keys = [key for key in metrics if isinstance(key, str) and key.startswith(("avg@", "pass@"))]
    shown = " ".join(f"{escape(key, KEY_CHARS)} {metrics[key]:.1f}%" for key in keys[:MAX_SAMPLED])
    return shown + (" …" if len(keys) > MAX_SAMPLED else "")


def evaluation_summary(evaluation: dict | None) -> str:
    if not evaluation or "accuracy" not in evaluation:
        return ""
    sampled = sampled_summary(evaluation)
    label = "Local mean " if evaluation.get("aggregate") == "local-mean" else ""
    return f" | held-out {label}greedy {evaluation['accuracy']:.1f}% {sampled}"


def reply_summary(msg, sent=None) -> str | None:
    """One progress line for a client's reply, as it arrives: what it did, with counts and times,
    from the reply as the boundary checks it (:func:`fedtops_strategy.replies.parse_progress`);
    for an error reply, the root cause's line of its reason (:func:`server_app.error_lines.root_cause`),
    under the node and type of the message it answers (``sent``: an error the SuperLink writes
    for a node it lost comes from the SuperLink). None for a reply the boundary refuses (the
    phase's screening says why it is left out)."""
    try:
        node = int(sent.metadata.dst_node_id if sent is not None else msg.metadata.src_node_id)
    except (TypeError, ValueError, OverflowError):
        return None
    kind = msg.metadata.message_type
    if msg.has_error():
        kind = sent.metadata.message_type if sent is not None else kind
        return f"  node {node}: {escape(kind, KEY_CHARS)} failed: {root_cause(msg.error.reason)}"
    reply = parse_progress(msg, node, Expected(num_candidates=MAX_LIST))
    if isinstance(reply, Rejection):
        return None
    # the node from the metadata (the message it answers, else the sender), the partition as the
    # client claims it: a line cannot pass for another node's, whatever the reply holds
    who, m = f"  node {node} client {reply.partition_id}", reply.metrics
    try:
        if kind == "train":
            line = (
                f"{who} trained: {m['rollout_s']:.1f} s rollouts (mean {m['response_length']:.0f} tokens, "
                f"cap-hit {100 * m['cap_hit_rate']:.0f}%, reward {100 * m['accuracy']:.0f}%) | "
                f"teacher {m['teacher_s']:.1f} s"
            )
            if m.get("cache_s", 0.0) and "cache_teacher_score" in m:
                line += f" | cache {m['cache_s']:.2f} s"
            line += f" | OPD {int(m['steps'])} steps {m['opd_s']:.1f} s, loss {m['loss_first']:.4f} -> {m['loss_last']:.4f}"
            return line + f" | {m['total_s']:.1f} s"
        if kind == "query.score":
            j, k = m["teacher-scores"], m["change-scores"]
            return f"{who} scored {len(j)} candidates in {m.get('score_s', 0.0):.2f} s (max K {max(k):.4f})"
        if kind == "evaluate":
            return f"{who} evaluated: greedy {m['accuracy']:.1f}% {sampled_summary(m)} in {m['eval_s']:.1f} s"
    except (KeyError, TypeError, ValueError):  # a metric missing, or a list where a number belongs
        return None
    return None


def log_reply(msg, sent=None) -> None:
    line = reply_summary(msg, sent)
    if line:
        log(INFO, "%s", line)


def communication_summary(record: dict) -> str:
    """`` | 2.47 MB sent, 1.24 MB received``: the round's bytes to and from its clients, all phases."""
    communication = record.get("communication")
    if not communication:
        return ""
    return f" | {human_bytes(communication['sent'])} sent, {human_bytes(communication['received'])} received"


def aggregation_error_summary(record: dict) -> str:
    """`` | factor-average error 6.70% (applied 2.54%)``: what averaging the LoRA factors
    separately cost this round, relative to the update (absent for Local and Centralized)."""
    mean, applied = record.get("aggregation-error"), record.get("aggregation-error-applied")
    if mean is None:
        return ""
    line = f" | factor-average error {100 * mean:.2f}%"
    if applied is not None and record.get("multiplier") != 1.0:
        line += f" (applied {100 * applied:.2f}%)"
    return line


def eta_seconds(records: list[dict], num_rounds: int) -> float | None:
    """Seconds left after the last of ``records``: the rounds left times the mean seconds a
    recorded round took (training, and its evaluation where there was one: every ``eval.every``-th
    round's cost spread over all); None when no round is left or none was timed."""
    timed = [r for r in records if r.get("round", 0) > 0 and isinstance(r.get("seconds"), int | float)]
    left = num_rounds - records[-1]["round"] if records else 0
    if not timed or left <= 0:
        return None
    return left * sum(r["seconds"] + (r.get("eval_seconds") or 0.0) for r in timed) / len(timed)


def duration_text(seconds: float) -> str:
    """``45 s``, ``3 min 20 s``, ``2 h 05 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def round_summary(record: dict, num_rounds: int, eta: float | None = None) -> str:
    """One readable line per round for ``flwr run --stream``; ``eta``: the run's seconds left
    (:func:`eta_seconds`), shown after the round's own."""
    if record["round"] == 0:
        return (
            f"round 0/{num_rounds} [{record['strategy']}] initial adapter{evaluation_summary(record.get('evaluation'))}"
            f"{communication_summary(record)}"
        )
    a = record.get("multiplier")
    j = "-"
    if record.get("teacher_scores") and a in (record.get("candidates") or []):
        value = record["teacher_scores"][record["candidates"].index(a)]
        j = "-" if value is None else f"{value:.4f}"  # None: not finite (docs/run-folder.md)
    feasible = f"{record['num-feasible']}/{len(record['candidates'])}" if "num-feasible" in record else "-"
    clients = record.get("clients", [])
    kl = "-"
    # The exact KL over all rollouts when train.exact-kl asks for it, else the OPD loss of the
    # round's first (at θ_t) and last mini-batch, which the epoch computes anyway.
    first, last, what = ("kl_before", "kl_after", "KL") if clients and "kl_before" in clients[0] else ("loss_first", "loss_last", "loss")
    if clients and all(first in c and last in c for c in clients):
        before = sum(c[first] for c in clients) / len(clients)
        after = sum(c[last] for c in clients) / len(clients)
        kl = f"{before:.4f} -> {after:.4f}"
    capped = ""
    if record.get("multiplier-cap") is not None:
        unscored = ", ".join(str(n) for n in record.get("unscored-node-ids", []))
        capped = f" (capped at {record['multiplier-cap']:g}, selected {record['selected-multiplier']:g}: no valid scores from node {unscored})"
    flags = "".join(
        [
            " (fallback: no score replies)" if record.get("fallback") else "",
            capped,
            f" ({len(record['excluded'])} excluded)" if record.get("excluded") else "",
            f" ({len(record['skipped-node-ids'])} skipped)" if record.get("skipped-node-ids") else "",
            " (held: see the WARNING above)" if record.get("clients") and record.get("hold-reason") else "",
        ]
    )
    cosine = record.get("step-cosine")  # a server optimizer's step is not along Δ_t: its a is the effective one
    a = "-" if a is None else f"{a:g}" + (f" (effective, cos {cosine:.2f})" if cosine is not None and cosine < 0.9999 else "")
    return (
        f"round {record['round']}/{num_rounds} [{record['strategy']}] a = {a} | J(a) = {j} | "
        f"feasible {feasible} | client {what} {kl}{aggregation_error_summary(record)}{evaluation_summary(record.get('evaluation'))}"
        f"{communication_summary(record)}{privacy_summary(record)} | {record.get('seconds', 0.0):.1f} s"
        f"{'' if eta is None else f' | ETA {duration_text(eta)}'}{flags}"
    )


def privacy_summary(record: dict) -> str:
    """`` | ε = 4.21 (δ = 1e-05)`` after a private round (∞: a release without noise); else ''."""
    privacy = record.get("privacy")
    if not privacy or "delta" not in privacy:
        return ""
    eps = privacy.get("epsilon")
    return f" | ε = {'∞' if eps is None else f'{eps:.3g}'} (δ = {privacy['delta']:g})"
