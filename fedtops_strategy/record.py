"""The round record's type: what one line of ``rounds.jsonl`` holds (docs/run-folder.md).

Its JSON keys are the run folder's interface and stay as they are (some hyphenated, some with
underscores, as the SPEC fixed them), so the type is a ``TypedDict`` over those keys: the
strategies write it, the ServerApp adds timings, traffic and the evaluation, and
:mod:`server_app.run_folder` writes it. Every value in it is a number, a string the server wrote
(client text is escaped at the boundary, :mod:`fedtops_strategy.replies`) or a list or dict of
them; non-finite numbers are written as ``null`` or strings, never as NaN.
"""

from __future__ import annotations

from typing import Any, TypedDict

Excluded = TypedDict("Excluded", {"node-id": int, "reason": str})
Bounded = TypedDict("Bounded", {"node-id": int, "update-norm": float, "scale": float, "weight": float})

RoundRecord = TypedDict(
    "RoundRecord",
    {
        # every round (fedtops_strategy/round.py, RoundResult.to_record)
        "round": int,
        "strategy": str,
        "sampled-node-ids": list[int],
        "skipped-node-ids": list[int],
        "trained-node-ids": list[int],
        "clients": list[dict[str, Any]],  # {"node-id" (from metadata), then the reply's checked metrics}
        "excluded": list[Excluded],
        "disputed-partitions": list[dict[str, Any]],  # refused partition claims (replies.settle_partition_claims)
        "multiplier": float | None,  # None: Local (nothing applied)
        "hold-reason": str,
        "bounded": list[Bounded],
        "bounds-skipped": str,  # why clip-norm / max-weight were not applied this round
        "aggregation-error": float | None,
        "aggregation-error-applied": float | None,
        "privacy": dict[str, Any],  # a private run: only what may be published (noise, C, ε; docs/privacy.md)
        "privacy-diagnostics": dict[str, Any],  # a private run: what is not private (norms, counts, who answered)
        # FedTOPS's score phase (fedtops_strategy/fedtops.py, fedtops_se.py)
        "candidates": list[float] | None,
        "teacher_scores": list[float | None] | None,
        "change_scores": list[list[float | None]] | None,
        "client_teacher_scores": list[list[float | None]],
        "scored-node-ids": list[int],
        "unscored-node-ids": list[int],
        "veto-counts": list[int],
        "hold-node-ids": list[int],
        "fallback": bool,
        "num-feasible": int,
        "selected-multiplier": float,
        "multiplier-cap": float | None,
        "score_seconds": float,
        "teacher-score-se": list[float | None],
        "paper-multiplier": float,
        # added by the ServerApp (server_app/recorder.py)
        "seconds": float,
        "server-rss-mb": float,
        "excluded-node-ids": list[int],
        "evaluation": dict[str, Any] | None,
        "eval_seconds": float,
        "communication": dict[str, Any],
    },
    total=False,
)


# What a private run may publish of a round: the released values and what is computed from them
# alone (docs/privacy.md). Everything else in the record (the clients' metrics, who was excluded
# and why, who answered, norms, timings, traffic, the evaluation on the clients' prompts) is the
# curator's and is not private. Under privacy, ``scored-node-ids`` lists every node the round asked
# (one released row each) and ``sampled-node-ids`` is the public schedule.
PUBLISHABLE = (
    "round",
    "strategy",
    "multiplier",
    "sampled-node-ids",
    "candidates",
    "teacher_scores",
    "change_scores",
    "client_teacher_scores",
    "scored-node-ids",
    "veto-counts",
    "num-feasible",
    "selected-multiplier",
    "hold-node-ids",
    "privacy",
)


def publishable(record: RoundRecord) -> dict[str, Any]:
    """The keys of ``record`` that a private run may publish (:data:`PUBLISHABLE`), and ``held``
    (a = 0: a fact about the released multiplier)."""
    out = {k: record[k] for k in PUBLISHABLE if k in record}
    if "multiplier" in out:
        out["held"] = out["multiplier"] == 0.0
    return out
