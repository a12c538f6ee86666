"""FedTOPS: Federated Teacher-guided On-Policy Scaling.

Paper: "Trapped by Their Own Rollouts: Understanding Aggregation–Rollout Feedback in Federated
On-Policy Distillation", Algorithm 1.

FedTOPS trains and averages like FedAvg, then asks the clients that trained how the teacher
agrees with each candidate θ_t + aΔ_t on their own cached prefixes, and moves by the selected
multiplier. A round's phases are functions from values to values (:mod:`fedtops_strategy.round`),
run by :func:`fedtops_strategy.round.play_round`:

1. train: ``configure_train`` sends θ_t (the config asks clients to build a scoring cache);
   ``aggregate_train`` screens the replies and averages them (w_i ∝ ``num-examples``):
   a :class:`~fedtops_strategy.round.TrainAggregate` with Δ_t = Σ_i w_i θ_{t,i}^+ − θ_t.
2. score: ``configure_score`` sends Δ_t and the candidates to the clients whose update is in Δ_t
   (``query.score``); each answers with scalars only: Ĵ_i(a) and K̂_i(a) for every candidate.
   ``aggregate_score`` checks them at the boundary: :class:`~fedtops_strategy.round.ScoreRows`.
3. step: ``step`` selects a_t (:func:`fedtops_strategy.selection.select_round`) and returns
   θ_{t+1} = θ_t + a_t Δ_t (:class:`~fedtops_strategy.round.Step`).
4. evaluate: the app's held-out evaluation (``server_app/evaluation.py``).

If no client answers the score query, FedTOPS falls back to a = 1 (FedAvg) and says so in the
round record; if no candidate is feasible it holds (a = 0), logs a WARNING naming the nodes whose
K̂ at a = 1 exceeded δ, and records why (``hold-reason``); every round records how many
candidates each scored node vetoed (``veto-counts``). A score that is not finite makes that
candidate infeasible for that client, which still counts as scored. Ĵ is weighted by the weights
the train replies had in the average, never by what a score reply claims. If some client whose update is in Δ_t
returned no valid scores, its trust constraint is unknown: a_t = min(selected, 1), and the round
record keeps the uncapped choice (``selected-multiplier``), the cap (``multiplier-cap``) and those
clients (``unscored-node-ids``).

Flower's contract: FedTOPS is not a Flower ``Strategy`` subclass; its ``start``
(:meth:`fedtops_strategy.base.ServerStrategy.start`) takes the arguments of Flower's
``Strategy.start`` and returns its ``Result``, with the score phase between train and evaluate,
so a ServerApp of one's own can call ``FedTOPS(...).start(grid, arrays, num_rounds)`` the way
FlowerTune calls ``strategy.start``; the app's loop runs the same phases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from fedtops_strategy.base import ServerStrategy, parse_replies
from fedtops_strategy.replies import SCORE_NEGATIVE_TOL, Expected, ScoreReply, parse_score
from fedtops_strategy.round import RoundResult, ScoreRows, Step, TrainAggregate, apply_step
from fedtops_strategy.selection import UNSCORED_CAP, Selection, select_round, vetoes

__all__ = ["DEFAULT_CANDIDATES", "SCORE_MESSAGE_TYPE", "SCORE_NEGATIVE_TOL", "FedTOPS", "parse_score_reply"]

SCORE_MESSAGE_TYPE = "query.score"
DEFAULT_CANDIDATES = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)


class FedTOPS(ServerStrategy):
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
    max_vetoes : int (default: 0)
        A candidate stays feasible while at most this many clients' K̂ exceed δ (0: the paper's rule).
    score_aggregate : str (default: "mean")
        Ĵ across clients: ``mean`` (num-examples-weighted, the paper's), ``median``, ``trimmed-mean``.
    trim_fraction : float (default: 0.2)
        The share cut at each end by ``score_aggregate = "trimmed-mean"``.
    **kwargs
        Passed to :class:`fedtops_strategy.base.ServerStrategy` (sampling, bounds, averager, ...).
    """

    strategy_name = "fedtops"
    builds_scoring_cache = True
    score_phase = True
    score_config: dict = {}  # what a variant's score query asks for besides the candidates (fedtops_se.py)

    def __init__(
        self,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        trust_budget: float = 0.05,
        score_tol: float = 1e-9,
        feasibility_tol: float = 1e-8,
        max_vetoes: int = 0,
        score_aggregate: str = "mean",
        trim_fraction: float = 0.2,
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
        self.max_vetoes = int(max_vetoes)
        self.score_aggregate = score_aggregate
        self.trim_fraction = float(trim_fraction)

    def summary(self) -> None:
        log(INFO, "\t├──> FedTOPS settings:")
        log(INFO, "\t│\t├── Candidates: %s", list(self.candidates))
        log(INFO, "\t│\t├── Trust budget δ: %s", self.trust_budget)
        log(INFO, "\t│\t├── Tolerances: score %g | feasibility %g", self.score_tol, self.feasibility_tol)
        log(INFO, "\t│\t└── Vetoes allowed: %d | Ĵ across clients: %s", self.max_vetoes, self.score_aggregate)
        super().summary()

    def configure_score(self, train: TrainAggregate) -> list[Message] | None:
        """The ``query.score`` messages: Δ_t and the candidates, to every client whose update is
        in Δ_t (the round's kept train replies); None when the round averaged nothing (it holds)."""
        if train.delta is None:
            return None
        content = RecordDict(
            {
                "increment": ArrayRecord({k: Array(d) for k, d in train.delta.items()}),
                "config": ConfigRecord({"candidates": list(self.candidates), "server-round": train.server_round, **self.score_config}),
            }
        )
        return [Message(content=content, message_type=SCORE_MESSAGE_TYPE, dst_node_id=r.node_id) for r in train.kept]

    def aggregate_score(self, train: TrainAggregate, sent: list[Message], replies: Iterable[Message], started: float) -> ScoreRows:
        """The checked score replies (:func:`fedtops_strategy.replies.parse_score`) of the nodes
        that were asked, in the order of the train replies, as rows (node, Ĵ_i, K̂_i) with the
        weights the train replies had in the average (never what a score reply claims); the
        others, and the clients that did not answer, are refused. The averager releases the rows
        (:meth:`fedtops_strategy.averaging.Averager.release_scores`: under privacy one clipped,
        noised row per node the round asked)."""
        server_round, nodes = train.server_round, [r.node_id for r in train.kept]
        scored, rejected, refused = parse_replies(sent, replies, parse_score, Expected(num_candidates=len(self.candidates)), "score")
        self.note_timeouts(server_round, nodes, [e["node-id"] for e in refused])
        for r in rejected:
            log(WARNING, "round %d: score reply of node %d ignored: %s", server_round, r.node_id, r.reason)
            refused.append(r.entry("score: "))
        order = {n: i for i, n in enumerate(nodes)}
        scored.sort(key=lambda s: order.get(s.node_id, len(order)))
        rows = [(s.node_id, s.teacher_scores, s.change_scores) for s in scored]
        unscored = [n for n in nodes if n not in {s.node_id for s in scored}]
        weights = {node: train.weights[node] for node, _, _ in rows}
        rows, weights, notes, all_scored = self.averager.release_scores(rows, weights, unscored, train.sent.sampled, self.candidates, server_round)
        return ScoreRows(rows, weights, unscored, all_scored, refused, scored, notes, time.perf_counter() - started)

    def step(self, train: TrainAggregate, scores: ScoreRows | None) -> Step:
        """a_t by the paper's rule on the score rows (:meth:`select`), then θ_{t+1} = θ_t + a_t Δ_t;
        a round that averaged nothing holds."""
        if scores is None:
            return apply_step(train, 0.0)
        selection, fields = self.select(scores.rows, scores.weights, scores.unscored, all_scored=scores.all_scored)
        server_round = train.server_round
        if selection.fallback:
            log(WARNING, "round %d: no client answered the score query; falling back to a = 1 (FedAvg)", server_round)
        if selection.too_few_rows is not None:
            log(
                WARNING,
                "round %d: %s, which colluding rows could steer: a = %g capped at %g",
                server_round,
                selection.too_few_rows,
                selection.selected,
                UNSCORED_CAP,
            )
        elif selection.capped:
            log(
                WARNING,
                "round %d: node(s) %s trained but returned no valid scores; a = %g capped at %g",
                *(server_round, ", ".join(map(str, scores.unscored)), selection.selected, selection.cap),
            )
        if "hold-reason" in fields:
            log(WARNING, "round %d holds (a = 0): %s", server_round, fields["hold-reason"])
        multiplier, refined = self.refine(selection, fields, scores, train)
        return apply_step(train, multiplier, {**fields, **refined})

    def round_metrics(self, result: RoundResult) -> MetricRecord:
        """a_t and the number of feasible candidates (0 where the round averaged nothing)."""
        return MetricRecord({**super().round_metrics(result), "num-feasible": int(result.step.details.get("num-feasible", 0))})

    def select(
        self, rows: list[tuple[int, list[float], list[float]]], weights: dict[int, float], unscored: list[int], *, all_scored: bool
    ) -> tuple[Selection, dict]:
        """The paper's rule on one round's score rows (node, Ĵ_i, K̂_i), with each node's weight:
        the selection (:func:`fedtops_strategy.selection.select_round`) and the round record's
        fields of the score phase, in the record's order (a hold names the nodes whose K̂ at
        a = 1, or the smallest candidate, exceeded δ). A function of its arguments and the
        strategy's settings alone."""
        change_scores = [k for _, _, k in rows]
        client_teacher_scores = [j for _, j, _ in rows]
        veto = vetoes(change_scores, self.trust_budget, len(self.candidates), self.feasibility_tol)
        fields = {
            "candidates": list(self.candidates),
            "scored-node-ids": [node for node, _, _ in rows],
            "change_scores": [_finite_or_none(k) for k in change_scores],
            "client_teacher_scores": [_finite_or_none(j) for j in client_teacher_scores],
            "unscored-node-ids": unscored,
            "veto-counts": [sum(row) for row in veto],
        }
        selection = select_round(
            self.candidates,
            client_teacher_scores,
            change_scores,
            [weights[node] for node, _, _ in rows],
            self.trust_budget,
            all_scored=all_scored,
            score_tol=self.score_tol,
            feasibility_tol=self.feasibility_tol,
            max_vetoes=self.max_vetoes,
            score_aggregate=self.score_aggregate,
            trim_fraction=self.trim_fraction,
            planned=self.planned,
        )
        if selection.multiplier == 0.0 and not selection.fallback:
            reference = self.candidates.index(1.0) if 1.0 in self.candidates else min(range(len(self.candidates)), key=self.candidates.__getitem__)
            blocking = [node for node, row in zip(fields["scored-node-ids"], veto) if row[reference]]
            fields["hold-reason"] = (
                f"no feasible candidate (δ = {self.trust_budget:g}, {self.max_vetoes} veto(es) allowed); "
                f"K̂ at a = {self.candidates[reference]:g} exceeded δ at node(s) {', '.join(map(str, blocking)) or 'none'}"
            )
            fields["hold-node-ids"] = blocking
        fields.update(
            {
                "teacher_scores": _finite_or_none(selection.teacher_scores),
                "fallback": selection.fallback,
                "num-feasible": selection.num_feasible,
                "selected-multiplier": selection.selected,
                "multiplier-cap": selection.cap,
            }
        )
        return selection, fields

    def refine(self, selection: Selection, fields: dict, scores: ScoreRows, train: TrainAggregate) -> tuple[float, dict]:
        """The round's a from the rule's ``selection`` and the record's fields it adds (a variant
        may change a); the paper: as selected, nothing added."""
        return selection.multiplier, {}


def parse_score_reply(msg: Message, num_candidates: int):
    """(problem, (teacher_scores, change_scores)) of one score reply, through the boundary
    (:func:`fedtops_strategy.replies.parse_score`, which says what is checked)."""
    result = parse_score(msg, int(msg.metadata.src_node_id), Expected(num_candidates=num_candidates))
    if isinstance(result, ScoreReply):
        return None, (result.teacher_scores, result.change_scores)
    return result.reason, None


def _finite_or_none(values: Sequence[float] | None) -> list[float | None] | None:
    """``values`` for the round record (JSON): a non-finite one as None."""
    return None if values is None else [float(v) if math.isfinite(v) else None for v in values]
