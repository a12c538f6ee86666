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
round record; if no candidate is feasible it holds (a = 0), logs a WARNING naming the nodes whose
K̂ at a = 1 exceeded δ, and records why (``hold-reason``); every round records how many
candidates each scored node vetoed (``veto-counts``). A score that is not finite makes that
candidate infeasible for that client, which still counts as scored. Ĵ is weighted by the weights
the train replies had in the average, never by what a score reply claims. If some client whose update is in Δ_t
returned no valid scores, its trust constraint is unknown: a_t = min(selected, 1), and the round
record keeps the uncapped choice (``selected-multiplier``), the cap (``multiplier-cap``) and those
clients (``unscored-node-ids``).

Flower's contract: :meth:`FedTOPS.start` takes the arguments of Flower's ``Strategy.start`` and
returns its ``Result``, with the score phase (:meth:`FedTOPS.score_phase`) between train and
evaluate, so a ServerApp of one's own can call ``FedTOPS(...).start(grid, arrays, num_rounds)`` the
way FlowerTune calls ``strategy.start``; the app's loop runs the same phases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from fedtops_strategy.replies import SCORE_NEGATIVE_TOL, Expected, ScoreReply, parse_score
from fedtops_strategy.screening import ReplyScreening, parse_replies
from fedtops_strategy.selection import Selection, select_round, vetoes

__all__ = ["DEFAULT_CANDIDATES", "SCORE_MESSAGE_TYPE", "SCORE_NEGATIVE_TOL", "FedTOPS", "parse_score_reply"]

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
    max_vetoes : int (default: 0)
        A candidate stays feasible while at most this many clients' K̂ exceed δ (0: the paper's rule).
    score_aggregate : str (default: "mean")
        Ĵ across clients: ``mean`` (num-examples-weighted, the paper's), ``median``, ``trimmed-mean``.
    trim_fraction : float (default: 0.2)
        The share cut at each end by ``score_aggregate = "trimmed-mean"``.
    **kwargs
        Passed to :class:`flwr.serverapp.strategy.FedAvg` (sampling, record keys, ...).
    """

    strategy_name = "fedtops"
    builds_scoring_cache = True
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
        self.increment: ArrayRecord | None = None  # Δ_t of the round last aggregated (None: no update)
        self._scored_increment: ArrayRecord | None = None  # the Δ_t the score query carried
        self._score_sent: list[Message] = []
        self._score_started = 0.0

    def summary(self) -> None:
        log(INFO, "\t├──> FedTOPS settings:")
        log(INFO, "\t│\t├── Candidates: %s", list(self.candidates))
        log(INFO, "\t│\t├── Trust budget δ: %s", self.trust_budget)
        log(INFO, "\t│\t├── Tolerances: score %g | feasibility %g", self.score_tol, self.feasibility_tol)
        log(INFO, "\t│\t└── Vetoes allowed: %d | Ĵ across clients: %s", self.max_vetoes, self.score_aggregate)
        super().summary()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's average (:meth:`average_round`); keeps Δ_t = average − θ_t as :attr:`increment`
        for the score phase. Returns the average (θ_t + Δ_t), which :meth:`aggregate_score`
        replaces by θ_t + a_t Δ_t; None (the round holds) when nothing was averaged.
        """
        mean = self.average_round(server_round, replies)
        self.increment = None
        if mean is None:
            self.apply_multiplier(server_round, 0.0)
            return None, None
        self.increment = ArrayRecord({k: Array(d) for k, d in self.delta.items()})
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in mean.items()}), None

    def configure_score(self, server_round: int, increment: ArrayRecord, grid: Grid) -> Iterable[Message]:
        """The ``query.score`` messages: Δ_t and the candidates, to every client whose update is
        in Δ_t (the round's kept train replies; ``grid`` samples nothing here)."""
        self._score_started = time.perf_counter()
        self._scored_increment = increment
        content = RecordDict(
            {
                "increment": increment,
                "config": ConfigRecord({"candidates": list(self.candidates), "server-round": server_round, **self.score_config}),
            }
        )
        nodes = [r.node_id for r in self.kept]
        self._score_sent = [Message(content=content, message_type=SCORE_MESSAGE_TYPE, dst_node_id=n) for n in nodes]
        return self._score_sent

    def score_phase(self, server_round: int, grid: Grid, timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Algorithm 1's score phase, after :meth:`aggregate_train`: Δ_t and the candidates out
        (:meth:`configure_score`), Ĵ_i(a) and K̂_i(a) back within ``timeout`` seconds, θ_{t+1} =
        θ_t + a_t Δ_t and (a_t, the feasible count) (:meth:`aggregate_score`). (None, None) when
        the round averaged nothing (it holds with θ_t)."""
        if self.increment is None:
            return None, None
        replies = grid.send_and_receive(self.configure_score(server_round, self.increment, grid), timeout=timeout)
        return self.aggregate_score(server_round, replies)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
    ) -> Result:
        """Flower's ``Strategy.start`` with FedTOPS's score phase: each round trains, scores the
        candidates on the clients that trained and moves θ by the selected a_t, then runs Flower's
        federated evaluation (``fraction_evaluate``) and ``evaluate_fn`` as Flower does. The
        ``Result`` holds the last θ, each round's (a_t, feasible count) as its train metrics, and
        the evaluations; each round's full record is in :attr:`records`. With ``privacy``, it
        stops before a round whose releases would exceed ``privacy.max-epsilon`` and returns what
        was released; the journal of releases is the app's (its run folder), so none is kept here
        unless ``privacy.ledger.journal`` names a file."""
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        if evaluate_fn is not None and (res := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        arrays = initial_arrays
        for server_round in range(1, num_rounds + 1):
            stop = self.privacy.budget_stop(server_round, True) if self.privacy is not None else None
            if stop is not None:  # the round's releases would exceed privacy.max-epsilon: end with what was released
                log(WARNING, "FedTOPS stopped on its privacy budget: %s", stop)
                break
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            replies = grid.send_and_receive(self.configure_train(server_round, arrays, train_config, grid), timeout=timeout)
            self.aggregate_train(server_round, replies)
            new, metrics = self.score_phase(server_round, grid, timeout)
            if new is not None:
                arrays = result.arrays = new
            if metrics is not None:
                result.train_metrics_clientapp[server_round] = metrics
            replies = grid.send_and_receive(self.configure_evaluate(server_round, arrays, evaluate_config, grid), timeout=timeout)
            if (metrics := self.aggregate_evaluate(server_round, replies)) is not None:
                result.evaluate_metrics_clientapp[server_round] = metrics
            if evaluate_fn is not None and (res := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        return result

    def aggregate_score(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Select a_t from the valid score replies; return θ_{t+1} = θ_t + a_t Δ_t and (a_t, Ĵ)."""
        record = self.records[server_round]
        nodes = [r.node_id for r in self.kept]
        scored = self._valid_scores(server_round, replies, nodes)
        rows = [(s.node_id, s.teacher_scores, s.change_scores) for s in scored]
        weights = {node: self.client_weights[node] for node, _, _ in rows}  # the weights of the train replies
        if self.privacy is not None:
            # One released row per node the round asked (a public row for each that gave no valid
            # scores), clipped and noised: docs/privacy.md. The selection is post-processing of them.
            asked = list(self.sampled_node_ids)
            rows, released, filled = self.privacy.release_scores({node: (j, k) for node, j, k in rows}, asked, self.candidates, server_round)
            weights = dict.fromkeys(asked, 1.0)
            record.setdefault("privacy", {}).update({**released, **self.privacy.ledger.summary()})
            record.setdefault("privacy-diagnostics", {})["public-score-rows"] = filled
        record["score_seconds"] = time.perf_counter() - self._score_started
        unscored = [n for n in nodes if n not in {s.node_id for s in scored}]
        # Under privacy an unscored node's public row already caps a at 1 (feasible up to 1): the
        # cap must not read who answered, which is not private.
        selection, fields = self.select(rows, weights, unscored, all_scored=self.privacy is not None or not unscored)
        record.update(fields)
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
        if "hold-reason" in fields:
            log(WARNING, "round %d holds (a = 0): %s", server_round, fields["hold-reason"])
        new = self.apply_multiplier(server_round, self.refine(server_round, selection, scored))
        metrics = MetricRecord({"multiplier": record["multiplier"], "num-feasible": selection.num_feasible})
        return new, metrics

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

    def refine(self, server_round: int, selection, scored: list[ScoreReply]) -> float:
        """The round's a from the rule's ``selection`` (a variant may change it); the paper: as selected."""
        return selection.multiplier

    def _valid_scores(self, server_round: int, replies: Iterable[Message], nodes: list[int]) -> list[ScoreReply]:
        """The checked score replies (:func:`fedtops_strategy.replies.parse_score`) of the nodes
        that were asked, in the order of ``nodes``; the others, and the clients that did not
        answer, go to the round's ``excluded``."""
        excluded = self.records[server_round]["excluded"]
        expected = Expected(num_candidates=len(self.candidates))
        scored, rejected, missing = parse_replies(self._score_sent, replies, parse_score, expected, "score")
        excluded.extend(missing)
        self.note_timeouts(server_round, nodes, [e["node-id"] for e in missing])
        for r in rejected:
            log(WARNING, "round %d: score reply of node %d ignored: %s", server_round, r.node_id, r.reason)
            excluded.append(r.entry("score: "))
        order = {n: i for i, n in enumerate(nodes)}
        return sorted(scored, key=lambda s: order.get(s.node_id, len(order)))


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
