"""FedTOPS: Federated Teacher-guided On-Policy Scaling.

Paper: "Trapped by Their Own Rollouts: Understanding Aggregation–Rollout Feedback in Federated
On-Policy Distillation", Algorithm 1.

FedTOPS trains and averages like FedAvg, then asks the clients that trained how the teacher
agrees with each candidate θ_t + aΔ_t on their own cached prefixes, and moves by the selected
multiplier:

1. ``train`` messages carry θ_t; clients reply with θ_{t,i}^+ and ``num-examples``.
2. Δ_t = Σ_i w_i θ_{t,i}^+ − θ_t, with w_i ∝ ``num-examples`` (Flower's FedAvg aggregation).
3. A ``query.score`` message carries Δ_t and the candidates to the same clients; each answers
   with scalars only: Ĵ_i(a) and K̂_i(a) for every candidate.
4. Ĵ(a) = Σ_i w_i Ĵ_i(a) over the clients that answered; a_t = ``select_multiplier``;
   θ_{t+1} = θ_t + a_t Δ_t.

If no client answers the score query, FedTOPS falls back to a = 1 (FedAvg) and says so in the
round record; if no candidate is feasible it holds (a = 0). If some client whose update is in Δ_t
returned no valid scores, its trust constraint is unknown: a_t = min(selected, 1), and the round
record keeps the uncapped choice (``selected-multiplier``), the cap (``multiplier-cap``) and those
clients (``unscored-node-ids``).
"""

from __future__ import annotations


import math
import time
from logging import INFO, WARNING
from typing import Iterable, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy import FedAvg

from fedopd.lora import Named, apply_increment, from_record, increment
from fedtops_strategy.screening import WEIGHT_KEY, ReplyScreening, missing_replies, reply_nodes
from fedtops_strategy.selection import feasible_indices, select_multiplier

SCORE_MESSAGE_TYPE = "query.score"
DEFAULT_CANDIDATES = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
UNSCORED_CAP = 1.0  # the most a client whose trust constraint is unknown may be moved: FedAvg's step


class FedTOPS(ReplyScreening, FedAvg):
    """FedAvg in LoRA-factor coordinates with teacher-guided selection of the update multiplier.

    Parameters
    ----------
    candidates : Sequence[float] (default: (0.5, 1, 2, 3, 5, 10))
        Multipliers a, in the order that breaks ties.
    trust_budget : float (default: 0.05)
        δ: a candidate is feasible when every client's K̂_i(a) <= δ (+1e-8).
    score_timeout : float (default: 3600)
        Seconds to wait for the clients' score replies.
    score_tol, feasibility_tol : float (default: 1e-9, 1e-8)
        Tolerances of the selection rule.
    **kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (sampling, record keys, ...).
    """

    strategy_name = "fedtops"

    def __init__(
        self,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        trust_budget: float = 0.05,
        score_timeout: float = 3600.0,
        score_tol: float = 1e-9,
        feasibility_tol: float = 1e-8,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not candidates:
            raise ValueError("FedTOPS needs at least one candidate multiplier")
        if not math.isfinite(trust_budget) or trust_budget < 0:
            raise ValueError(f"trust_budget must be a finite number >= 0, got {trust_budget}")
        self.candidates = tuple(float(a) for a in candidates)
        self.trust_budget = float(trust_budget)
        self.score_timeout = score_timeout
        self.score_tol = score_tol
        self.feasibility_tol = feasibility_tol

    def summary(self) -> None:
        log(INFO, "\t├──> FedTOPS settings:")
        log(INFO, "\t│\t├── Candidates: %s", list(self.candidates))
        log(INFO, "\t│\t├── Trust budget δ: %s", self.trust_budget)
        log(INFO, "\t│\t└── Tolerances: score %g | feasibility %g", self.score_tol, self.feasibility_tol)
        super().summary()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        mean, metrics = super().aggregate_train(server_round, replies)  # screened FedAvg
        if mean is None:
            return None, metrics
        record = self.records[server_round]
        theta = self.theta_arrays()
        delta = increment(from_record(mean), theta)
        nodes = [c["node-id"] for c in record["clients"]]
        started = time.perf_counter()
        scores = self.query_scores(server_round, delta, nodes)
        record["score_seconds"] = time.perf_counter() - started

        record["candidates"] = list(self.candidates)
        record["scored-node-ids"] = [node for node, _, _, _ in scores]
        record["change_scores"] = [k for _, _, k, _ in scores]
        record["client_teacher_scores"] = [j for _, j, _, _ in scores]
        if scores:
            weights = np.asarray([w for _, _, _, w in scores], dtype=np.float64)
            client_j = np.asarray([j for _, j, _, _ in scores], dtype=np.float64)
            teacher_scores = (weights[:, None] * client_j).sum(0) / weights.sum()
            record["teacher_scores"] = teacher_scores.tolist()
            multiplier = select_multiplier(
                self.candidates,
                record["teacher_scores"],
                record["change_scores"],
                self.trust_budget,
                score_tol=self.score_tol,
                feasibility_tol=self.feasibility_tol,
            )
            record["fallback"] = False
            record["num-feasible"] = len(
                feasible_indices(record["change_scores"], self.trust_budget, len(self.candidates), self.feasibility_tol)
            )
        else:
            log(WARNING, "round %d: no client answered the score query; falling back to a = 1 (FedAvg)", server_round)
            record["teacher_scores"] = None
            record["fallback"] = True
            record["num-feasible"] = 0
            multiplier = 1.0
        # A client whose update is in Δ but whose K̂ is unknown (no valid score reply) could be
        # moved by any selected a: cap it at FedAvg's step, which needs no trust check.
        scored = set(record["scored-node-ids"])
        record["unscored-node-ids"] = [n for n in nodes if n not in scored]
        record["selected-multiplier"] = multiplier
        record["multiplier-cap"] = None
        if scores and record["unscored-node-ids"]:
            record["multiplier-cap"] = UNSCORED_CAP
            if multiplier > UNSCORED_CAP:
                log(WARNING, "round %d: node(s) %s trained but returned no valid scores; a = %g capped at %g",
                    server_round, ", ".join(map(str, record["unscored-node-ids"])), multiplier, UNSCORED_CAP)
            multiplier = min(multiplier, UNSCORED_CAP)
        record["multiplier"] = multiplier
        new = apply_increment(theta, delta, multiplier)
        return ArrayRecord({k: Array(a) for k, a in new.items()}), metrics

    def query_scores(
        self, server_round: int, delta: Named, nodes: list[int]
    ) -> list[tuple[int, list[float], list[float], float]]:
        """Send Δ and the candidates; return (node, Ĵ_i, K̂_i, weight) of every valid answer."""
        content = RecordDict(
            {
                "increment": ArrayRecord({k: Array(d) for k, d in delta.items()}),
                "config": ConfigRecord({"candidates": list(self.candidates), "server-round": server_round}),
            }
        )
        messages = [Message(content=content, message_type=SCORE_MESSAGE_TYPE, dst_node_id=n) for n in nodes]
        replies = list(self._grid.send_and_receive(messages, timeout=self.score_timeout))
        self.records[server_round]["excluded"].extend(missing_replies(messages, replies, "score"))
        answers = []
        for msg, node in zip(replies, reply_nodes(messages, replies)):
            problem, parsed = parse_score_reply(msg, len(self.candidates))
            if problem:
                log(WARNING, "round %d: score reply of node %d ignored: %s", server_round, node, problem)
                self.records[server_round]["excluded"].append({"node-id": node, "reason": f"score: {problem}"})
                continue
            answers.append((node, *parsed))
        order = {n: i for i, n in enumerate(nodes)}
        return sorted(answers, key=lambda a: order.get(a[0], len(order)))


# A KL is never negative, but two numerically identical distributions can give -1e-9 in fp32.
# Values down to -SCORE_NEGATIVE_TOL are rounding and are clamped to 0; below that a reply is wrong.
SCORE_NEGATIVE_TOL = 1e-6


def clamp_scores(values: Sequence[float]) -> tuple[list[float] | None, str | None]:
    """(values clamped at 0, None), or (None, the problem) for NaN, ±inf or a clearly negative value."""
    out = []
    for x in values:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
            return None, f"score {x!r} is not a finite number"
        if x < -SCORE_NEGATIVE_TOL:
            return None, f"score {x!r} is negative beyond rounding (tolerance {SCORE_NEGATIVE_TOL:g}); a KL is >= 0"
        out.append(max(float(x), 0.0))
    return out, None


def parse_score_reply(msg: Message, num_candidates: int):
    """(problem, (teacher_scores, change_scores, weight)) of one score reply.

    Scores are KL divergences: rounding-level negatives (>= -1e-6) are clamped to 0, so that a
    client whose candidate equals its starting student is never dropped; NaN, ±inf and clearly
    negative values make the reply invalid.
    """
    if msg.has_error():
        return f"error reply: {msg.error.reason}", None
    records = list(msg.content.metric_records.values())
    if len(records) != 1:
        return "expected one MetricRecord", None
    m: MetricRecord = records[0]
    j, k, w = m.get("teacher-scores"), m.get("change-scores"), m.get(WEIGHT_KEY)
    if not isinstance(j, list) or not isinstance(k, list) or len(j) != num_candidates or len(k) != num_candidates:
        return f"expected {num_candidates} teacher and change scores", None
    j, problem = clamp_scores(list(j))
    if problem:
        return f"teacher scores: {problem}", None
    k, problem = clamp_scores(list(k))
    if problem:
        return f"change scores: {problem}", None
    if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        return f"'{WEIGHT_KEY}' is {w!r}, expected a positive number", None
    return None, (j, k, float(w))
