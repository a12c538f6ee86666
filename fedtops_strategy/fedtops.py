"""FedTOPS: Federated Teacher-guided On-Policy Scaling.

Paper: "Trapped by Their Own Rollouts: Understanding Aggregation–Rollout Feedback in Federated
On-Policy Distillation", Algorithm 1.

FedTOPS trains and averages like FedAvg, then asks the clients that trained how the teacher
agrees with each candidate θ_t + aΔ_t on their own cached prefixes, and moves by the selected
multiplier. A round is three phases, each a configure/aggregate pair as Flower names them, run
by the ServerApp's loop (``server_app/app.py``):

1. train: ``configure_train`` sends θ_t (the config asks clients to build a scoring cache);
   ``aggregate_train`` screens the replies, averages them (Flower's FedAvg, w_i ∝
   ``num-examples``) and keeps Δ_t = Σ_i w_i θ_{t,i}^+ − θ_t as :attr:`FedTOPS.increment`.
2. score: ``configure_score`` sends Δ_t and the candidates to the clients whose update is in Δ_t
   (``query.score``); each answers with scalars only: Ĵ_i(a) and K̂_i(a) for every candidate.
   ``aggregate_score`` selects a_t (:func:`fedtops_strategy.selection.select_round`) and
   returns θ_{t+1} = θ_t + a_t Δ_t.
3. evaluate: the app's held-out evaluation (``server_app/evaluation.py``).

If no client answers the score query, FedTOPS falls back to a = 1 (FedAvg) and says so in the
round record; if no candidate is feasible it holds (a = 0). If some client whose update is in Δ_t
returned no valid scores, its trust constraint is unknown: a_t = min(selected, 1), and the round
record keeps the uncapped choice (``selected-multiplier``), the cap (``multiplier-cap``) and those
clients (``unscored-node-ids``). Driven by Flower's own ``Strategy.start``, which has no score
phase, FedTOPS is FedAvg.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedopd import lora
from fedtops_strategy.screening import WEIGHT_KEY, ReplyScreening, missing_replies, reply_nodes
from fedtops_strategy.selection import select_round

SCORE_MESSAGE_TYPE = "query.score"
DEFAULT_CANDIDATES = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)


class FedTOPS(ReplyScreening, FedAvg):
    """FedAvg in LoRA-factor coordinates with teacher-guided selection of the update multiplier.

    Parameters
    ----------
    candidates : Sequence[float] (default: (0.5, 1, 2, 3, 5, 10))
        Multipliers a, in the order that breaks ties.
    trust_budget : float (default: 0.05)
        δ: a candidate is feasible when every client's K̂_i(a) <= δ (+1e-8). ``inf``: every
        candidate with finite scores is feasible, and the lowest Ĵ wins.
    score_tol, feasibility_tol : float (default: 1e-9, 1e-8)
        Tolerances of the selection rule.
    **kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (sampling, record keys, ...).
    """

    strategy_name = "fedtops"
    builds_scoring_cache = True

    def __init__(
        self,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        trust_budget: float = 0.05,
        score_tol: float = 1e-9,
        feasibility_tol: float = 1e-8,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not candidates:
            raise ValueError("FedTOPS needs at least one candidate multiplier")
        if not trust_budget >= 0:  # NaN fails too; inf is no constraint
            raise ValueError(f"trust_budget must be a number >= 0 or inf, got {trust_budget}")
        self.candidates = tuple(float(a) for a in candidates)
        self.trust_budget = float(trust_budget)
        self.score_tol = score_tol
        self.feasibility_tol = feasibility_tol
        self.increment: ArrayRecord | None = None  # Δ_t of the round last aggregated (None: no update)
        self._scored_increment: ArrayRecord | None = None  # the Δ_t the score query carried
        self._score_sent: list[Message] = []
        self._score_started = 0.0

    def summary(self) -> None:
        log(INFO, "\t├──> FedTOPS settings:")
        log(INFO, "\t│\t├── Candidates: %s", list(self.candidates))
        log(INFO, "\t│\t├── Trust budget δ: %s", self.trust_budget)
        log(INFO, "\t│\t└── Tolerances: score %g | feasibility %g", self.score_tol, self.feasibility_tol)
        super().summary()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg on the screened replies; keeps Δ_t (:attr:`increment`) for the score phase.

        Returns FedAvg's θ_t + Δ_t, which :meth:`aggregate_score` replaces by θ_t + a_t Δ_t.
        """
        mean, metrics = super().aggregate_train(server_round, replies)
        self.increment = None
        if mean is not None:
            delta = lora.increment(lora.from_record(mean), self.theta_arrays())
            self.increment = ArrayRecord({k: Array(d) for k, d in delta.items()})
        return mean, metrics

    def configure_score(self, server_round: int, increment: ArrayRecord, grid: Grid) -> Iterable[Message]:
        """The ``query.score`` messages: Δ_t and the candidates, to every client whose update is
        in Δ_t (the round's kept train replies; ``grid`` samples nothing here)."""
        self._score_started = time.perf_counter()
        self._scored_increment = increment
        content = RecordDict(
            {
                "increment": increment,
                "config": ConfigRecord({"candidates": list(self.candidates), "server-round": server_round}),
            }
        )
        nodes = [c["node-id"] for c in self.records[server_round]["clients"]]
        self._score_sent = [Message(content=content, message_type=SCORE_MESSAGE_TYPE, dst_node_id=n) for n in nodes]
        return self._score_sent

    def aggregate_score(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Select a_t from the valid score replies; return θ_{t+1} = θ_t + a_t Δ_t and (a_t, Ĵ)."""
        record = self.records[server_round]
        nodes = [c["node-id"] for c in record["clients"]]
        scores = self._valid_scores(server_round, list(replies), nodes)
        record["score_seconds"] = time.perf_counter() - self._score_started
        record["candidates"] = list(self.candidates)
        record["scored-node-ids"] = [node for node, _, _, _ in scores]
        record["change_scores"] = [k for _, _, k, _ in scores]
        record["client_teacher_scores"] = [j for _, j, _, _ in scores]
        scored = set(record["scored-node-ids"])
        record["unscored-node-ids"] = [n for n in nodes if n not in scored]

        selection = select_round(
            self.candidates,
            record["client_teacher_scores"],
            record["change_scores"],
            [w for _, _, _, w in scores],
            self.trust_budget,
            all_scored=not record["unscored-node-ids"],
            score_tol=self.score_tol,
            feasibility_tol=self.feasibility_tol,
        )
        if selection.fallback:
            log(WARNING, "round %d: no client answered the score query; falling back to a = 1 (FedAvg)", server_round)
        if selection.capped:
            log(
                WARNING,
                "round %d: node(s) %s trained but returned no valid scores; a = %g capped at %g",
                server_round,
                ", ".join(map(str, record["unscored-node-ids"])),
                selection.selected,
                selection.cap,
            )
        record["teacher_scores"] = selection.teacher_scores
        record["fallback"] = selection.fallback
        record["num-feasible"] = selection.num_feasible
        record["selected-multiplier"] = selection.selected
        record["multiplier-cap"] = selection.cap
        record["multiplier"] = selection.multiplier

        new = lora.apply_increment(self.theta_arrays(), lora.from_record(self._scored_increment), selection.multiplier)
        self.record_aggregation_error(server_round, selection.multiplier)
        metrics = MetricRecord({"multiplier": selection.multiplier, "num-feasible": selection.num_feasible})
        if selection.teacher_scores is not None:
            metrics["teacher-scores"] = selection.teacher_scores
        return ArrayRecord({k: Array(a) for k, a in new.items()}), metrics

    def _valid_scores(self, server_round: int, replies: list[Message], nodes: list[int]) -> list[tuple[int, list[float], list[float], float]]:
        """(node, Ĵ_i, K̂_i, weight) of every valid score reply, in the order of ``nodes``; the
        others, and the clients that did not answer, go to the round's ``excluded``."""
        excluded = self.records[server_round]["excluded"]
        excluded.extend(missing_replies(self._score_sent, replies, "score"))
        answers = []
        for msg, node in zip(replies, reply_nodes(self._score_sent, replies)):
            problem, parsed = parse_score_reply(msg, len(self.candidates))
            if problem:
                log(WARNING, "round %d: score reply of node %d ignored: %s", server_round, node, problem)
                excluded.append({"node-id": node, "reason": f"score: {problem}"})
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
