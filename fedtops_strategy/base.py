"""The server side every strategy shares, as phases from values to values (:mod:`fedtops_strategy.round`).

A round's train phase, in order:

1. **sampling** (:mod:`fedtops_strategy.sampling`): a seeded draw over the sorted connected nodes,
   without those that sit out after staying silent (``timeout.skip-after``, every phase counted),
   with a deadline on waiting for them (``timeout.start``, :class:`NodesNotConnected`);
2. **the boundary** (:mod:`fedtops_strategy.replies`): each reply becomes a typed
   :class:`~fedtops_strategy.replies.TrainReply` or a rejection naming the node and the reason;
   two replies that claim one partition are both refused; the averager may refuse more
   (client-side adaptive privacy: a norm bit that the update's norm contradicts);
3. **update bounds** (:mod:`fedtops_strategy.bounds`, ``strategy.clip-norm``, ``strategy.max-weight``);
4. **the average** (:mod:`fedtops_strategy.averaging`): the weighted mean, a Flower robust
   aggregator or the DP mean, behind one interface;
5. **the step** θ_{t+1} = θ_t + a·Δ_t, Δ_t = average − θ_t (:func:`fedtops_strategy.round.apply_step`),
   from θ_t; a non-finite result holds the round (θ_t kept).

A strategy holds its settings and the state its algorithm carries across rounds, declared in its
``__init__``: the silence counts (:class:`~fedtops_strategy.sampling.Silence`), the first round
the sampler waited in, the privacy ledger (inside the averager), and for Local each client's own
adapter. What passes between phases is returned (:mod:`fedtops_strategy.round`).

What a client does differently for a strategy travels in the train message's config, never as
the strategy's name (``client_app/handlers.py`` reads it):

* ``"learner"``: ``"federated"`` (its own prompts, from the adapter it is sent), ``"local"`` (the
  same, and it keeps its own adapter: a resumed client restores it), ``"centralized"`` (one
  learner on the pooled prompts of every partition, with their combined rollouts per round);
* ``"build-scoring-cache"``: build the scoring cache before the local epoch (FedTOPS scores
  candidates on it); ``"scoring-cache"`` (only when not ``"round"``): ``"untrained"`` builds it
  from rollouts of prompts the client does not train on this round (``fedtops-heldout-cache``).

Flower's contract: a strategy is not a Flower ``Strategy`` subclass (Flower's ``start`` would run
FedAvg's aggregation, not this one's). :meth:`ServerStrategy.start` takes the arguments of
Flower's ``Strategy.start`` and returns its ``Result``, so a ServerApp of one's own can call
``FedTOPS(...).start(grid, arrays, num_rounds)`` the way FlowerTune calls ``strategy.start``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from fedopd.core.strategies import clients_per_round
from fedopd.models import lora
from fedopd.models.lora import aggregation_gram, from_record
from fedtops_strategy.averaging import Averager, PrivateMean, RobustMean, Update, WeightedMean
from fedtops_strategy.bounds import UpdateBounds, all_finite
from fedtops_strategy.replies import ERROR_REPLY, Expected, Rejection, TrainReply, parse_train, settle_partition_claims
from fedtops_strategy.round import RoundResult, ScoreRows, Step, TrainAggregate, TrainRound, apply_step, play_round
from fedtops_strategy.sampling import NodeSampler, NodesNotConnected, Silence, missing_replies, reply_nodes

__all__ = ["NodesNotConnected", "ServerStrategy", "parse_replies"]


@contextmanager
def quiet_flower():
    """Flower's logger at ERROR for the duration: a Flower strategy used for one part of the round
    (the draw, a server optimizer's update) logs as if it ran the round."""
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        flwr_logger.setLevel(level)


def parse_replies(sent: list[Message], replies: Iterable[Message], parse, expected: Expected, phase: str):
    """(typed replies, rejections, ``excluded`` entries of the nodes that did not answer in time)
    of one phase: each reply through ``parse`` (the boundary), attributed to the node its message
    went to; a reply from a node that was not asked, or a second one, is a rejection too."""
    replies = list(replies)
    missing = missing_replies(sent, replies, phase)
    asked = {int(m.metadata.dst_node_id) for m in sent}
    typed, rejected, seen = [], [], set()
    for msg, node in zip(replies, reply_nodes(sent, replies)):
        if node not in asked or node in seen:
            rejected.append(Rejection(node, "a second reply" if node in seen else "from a node that was not asked"))
            continue
        seen.add(node)
        result = parse(msg, node, expected)
        (rejected if isinstance(result, Rejection) else typed).append(result)
    return typed, rejected, missing


class ServerStrategy:
    """FedAvg on the LoRA factors (a = 1 every round), and the phases every strategy shares.

    A subclass sets :attr:`strategy_name` (the round record's ``strategy``), :attr:`learner` and
    :attr:`builds_scoring_cache` (the train config's ``learner`` and ``build-scoring-cache``), and
    replaces :meth:`step` (how θ moves) or :meth:`configure_score` / :meth:`aggregate_score`
    (a score phase).

    Parameters (keyword-only)
    ----------
    fraction_train, min_train_nodes, min_available_nodes : float, int
        Flower's FedAvg sampling (its ``configure_train`` draws the nodes).
    sampling_seed : int
        The run's seed: which nodes round t samples.
    num_partitions, max_examples : int | None
        A reply's ``partition-id`` is in [0, num_partitions); its ``num-examples`` at most max_examples (None: no bound).
    clip_norm, max_weight : float
        ``strategy.clip-norm``, ``strategy.max-weight`` (0: off).
    aggregator : Flower strategy | None
        ``strategy.aggregator`` other than ``fedavg``: the robust average (:class:`RobustMean`).
    privacy : :class:`fedtops_strategy.privacy.UpdatePrivacy` | None
        ``privacy.*``: the DP average (:class:`PrivateMean`), which also releases the score rows.
    start_timeout, skip_after : float, int
        ``timeout.start`` and ``timeout.skip-after``.
    """

    strategy_name = "fedavg"
    learner = "federated"
    builds_scoring_cache = False
    averages_factors = True  # records the aggregation error of averaging the LoRA factors
    scoring_cache = "round"  # where clients take the scoring cache's rollouts from (a variant: "untrained")
    score_phase = False  # whether configure_score asks the clients (FedTOPS); privacy accounts its releases

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        sampling_seed: int = 0,
        num_partitions: int | None = None,
        max_examples: int | None = None,
        clip_norm: float = 0.0,
        max_weight: float = 0.0,
        aggregator=None,
        privacy=None,
        start_timeout: float = float("inf"),
        skip_after: int = 0,
    ) -> None:
        # Flower's FedAvg for its seeded draw only: it aggregates and evaluates nothing
        with quiet_flower():  # fraction_evaluate = 0 is the design here: no warning
            self.flower = FedAvg(
                fraction_train=fraction_train, fraction_evaluate=0.0, min_train_nodes=min_train_nodes, min_available_nodes=min_available_nodes
            )
        # the updates (and score rows) a round has when every asked client answers: what the robust rules were checked for
        self.planned = clients_per_round(min_available_nodes, fraction_train, min_train_nodes)
        self.sampler = NodeSampler(sampling_seed, start_timeout)  # cross-round: the first round it waited in
        self.silence = Silence(skip_after)  # cross-round: consecutive silent rounds per node
        self.limits = Expected(num_partitions=num_partitions, max_examples=max_examples)  # θ_t's shapes join each round
        self.bounds = UpdateBounds(float(clip_norm), float(max_weight))
        self.privacy = privacy  # cross-round: the privacy ledger (the ServerApp's journal and budget)
        self.averager: Averager = (
            PrivateMean(privacy) if privacy is not None else (RobustMean(aggregator, self.planned) if aggregator is not None else WeightedMean())
        )

    @property
    def num_partitions(self) -> int | None:
        return self.limits.num_partitions

    # -- silence (every phase) ---------------------------------------------------------------------
    @property
    def skip_after(self) -> int:
        return self.silence.skip_after

    @property
    def skipped_until(self) -> dict[int, int]:
        return self.silence.skipped_until

    @property
    def timeouts(self) -> dict[int, int]:
        return self.silence.counts

    def sitting_out(self, server_round: int) -> frozenset[int]:
        """The nodes that sit out ``server_round`` (``timeout.skip-after``)."""
        return self.silence.sitting_out(server_round)

    def note_timeouts(self, server_round: int, asked: Iterable[int], timed_out: Iterable[int]) -> None:
        """A phase of ``server_round`` asked ``asked``; ``timed_out`` did not answer in time (:class:`Silence`)."""
        self.silence.note(server_round, asked, timed_out)

    def summary(self) -> None:
        log(INFO, "\t├──> %s: fraction-train %g, min train nodes %d", type(self).__name__, self.flower.fraction_train, self.flower.min_train_nodes)

    # -- train: sampling -------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> TrainRound:
        """θ_t (``arrays``) out to the round's sampled nodes, with what the clients do for this strategy."""
        self.silence.close_round(server_round - 1)  # every phase of the last round, evaluation included, is over
        started = time.perf_counter()
        config["learner"] = self.learner
        config["build-scoring-cache"] = self.builds_scoring_cache
        if self.scoring_cache != "round":  # the paper's messages stay as they were
            config["scoring-cache"] = self.scoring_cache
        self.averager.configure_train(config)  # client-side DP: the clipping norm for Flower's mod
        sampled, skipped = self.sampler.sample(self.flower, server_round, arrays, config, grid, self.sitting_out(server_round))
        cap = self.averager.max_updates
        if cap is not None and len(sampled) > cap:  # the DP mean's fixed n: more nodes connected than declared
            log(WARNING, "round %d: %d nodes sampled, %d asked (the private mean's denominator)", server_round, len(sampled), cap)
            sampled = sampled[:cap]  # Flower's draw is in random order: a random subset
        nodes = sorted(int(m.metadata.dst_node_id) for m in sampled)
        return TrainRound(server_round, from_record(arrays), self.prepare_messages(sampled, arrays), nodes, skipped, started)

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        """The train messages as sent (a subclass may replace or drop some); by default unchanged."""
        return messages

    # -- train: the boundary, the bounds and the average ------------------------------------------
    def screen(self, sent: TrainRound, replies: Iterable[Message]) -> tuple[list[TrainReply], list[dict], dict]:
        """The round's train replies through the boundary: (the kept ones in a fixed order, the
        ``excluded`` entries, the record's ``disputed-partitions`` if any)."""
        server_round, theta = sent.server_round, sent.theta
        expected = Expected.for_train(theta, self.limits.num_partitions, self.limits.max_examples)
        typed, rejected, excluded = parse_replies(sent.messages, replies, parse_train, expected, "train")
        self.note_timeouts(server_round, [int(m.metadata.dst_node_id) for m in sent.messages], [e["node-id"] for e in excluded])
        typed, disputes = settle_partition_claims(typed)
        for d in disputes:
            log(WARNING, "round %d: node %d's partition claim refused: %s", server_round, d["node-id"], d["reason"])
        kept = []
        for reply in typed:
            problem = self.averager.refuse(reply, theta)
            if problem:
                rejected.append(Rejection(reply.node_id, problem))
            else:
                kept.append(reply)
        for r in rejected:
            if not r.reason.startswith(ERROR_REPLY):  # an error reply has its line in the stream already (the grid's reply line)
                log(WARNING, "round %d: update of node %d left out of the average: %s", server_round, r.node_id, r.reason)
            excluded.append(r.entry())
        # Flower samples nodes in random order; fix one (by partition, then node id) so that the
        # fp32 average, the score query and the round record do not depend on it.
        kept.sort(key=lambda r: (r.partition_id if r.partition_id is not None else 0, r.node_id))
        return kept, excluded, ({"disputed-partitions": disputes} if disputes else {})

    def bounded_updates(self, sent: TrainRound, kept: list[TrainReply]) -> tuple[list[Update], dict]:
        """The kept replies as the averager sees them: equal weights where it needs them (the DP
        mean), else ``num-examples``; then :attr:`bounds` (clip-norm, max-weight). Returns the
        updates and the record's ``bounds-skipped`` and ``bounded`` where there are any."""
        weights = [1.0 if self.averager.equal_weights else float(r.num_examples) for r in kept]
        arrays, capped, bounded, skipped = self.bounds.apply(sent.theta, [r.arrays for r in kept], weights)
        notes: dict = {}
        if skipped:
            log(WARNING, "round %d: strategy.clip-norm / max-weight not applied: %s", sent.server_round, skipped)
            notes["bounds-skipped"] = skipped
        if bounded:
            notes["bounded"] = [{"node-id": r.node_id, **b} for r, b in zip(kept, bounded)]
            for r, b, w in zip(kept, bounded, weights):
                if b["scale"] < 1.0 or b["weight"] < w:
                    log(
                        WARNING,
                        "round %d: node %d's update bounded: norm %.4g scaled by %.4g, weight %g -> %g",
                        *(sent.server_round, r.node_id, b["update-norm"], b["scale"], w, b["weight"]),
                    )
        # an uncapped weight goes to the average as the client sent it (an int): Flower's mean as before
        updates = [
            Update(r.node_id, a, cw if cw < w or self.averager.equal_weights else r.num_examples, self.averager.update_metrics(r))
            for r, a, w, cw in zip(kept, arrays, weights, capped)
        ]
        return updates, notes

    def aggregate_train(self, sent: TrainRound, replies: Iterable[Message]) -> TrainAggregate:
        """Screen, bound and average the round's train replies: the average and Δ_t = average − θ_t
        (None when nothing was averaged or the average is not finite: the round holds)."""
        kept, excluded, notes = self.screen(sent, replies)
        updates, bounds = self.bounded_updates(sent, kept)
        result = self.averager.average(sent.server_round, updates, sent.theta)
        mean, gram, hold = result.arrays, None, result.hold
        weights = [float(u.weight) for u in updates]
        if mean is not None and self.averages_factors and self.averager.weighted_mean:
            try:
                gram = (aggregation_gram(sent.theta, [u.arrays for u in updates], weights), weights)
            except ValueError as err:  # a diagnostic never stops a round: factors without A/B pairs
                log(WARNING, "round %d: no aggregation error: %s", sent.server_round, err)
        if mean is not None and not all_finite(mean):
            log(WARNING, "round %d holds: the average of the kept updates is not finite (θ_t kept)", sent.server_round)
            mean, hold = None, "the averaged adapter is not finite"
        delta = None if mean is None else lora.increment(mean, sent.theta)
        return TrainAggregate(
            sent, kept, excluded, {u.node_id: w for u, w in zip(updates, weights)}, mean, delta, hold, {**notes, **bounds, **result.record}, gram
        )

    # -- score (none here) and the step -----------------------------------------------------------
    def configure_score(self, train: TrainAggregate) -> list[Message] | None:
        """The round's score query (None: this strategy has no score phase). A strategy whose
        query is not None defines ``aggregate_score(train, sent, replies, started) -> ScoreRows``
        (:class:`fedtops_strategy.fedtops.FedTOPS`); :func:`~fedtops_strategy.round.play_round`
        calls it only then."""
        return None

    @property
    def default_multiplier(self) -> float:
        return 1.0

    def step(self, train: TrainAggregate, scores: ScoreRows | None) -> Step:
        """θ_{t+1} = θ_t + a·Δ_t at the strategy's :attr:`default_multiplier` (FedAvg: 1; fixed: its a)."""
        return apply_step(train, self.default_multiplier, factors=self.averages_factors)

    def evaluated_arrays(self, global_arrays: ArrayRecord) -> ArrayRecord | None:
        """What is evaluated in place of the global adapter θ_{t+1} (saved as ``round-NNN/evaluated``),
        or None: θ_{t+1} itself (FedExP's average of the last two iterates replaces it)."""
        return None

    def evaluation_arrays(self, node_id: int, global_arrays: ArrayRecord) -> ArrayRecord:
        """The adapter that node ``node_id`` evaluates: the global one (Local: its own)."""
        evaluated = self.evaluated_arrays(global_arrays)
        return global_arrays if evaluated is None else evaluated

    def round_metrics(self, result: RoundResult) -> MetricRecord:
        """What Flower's ``Result`` keeps of a round (:meth:`start`): how many updates were kept,
        and the applied a (none for Local, which applies none)."""
        multiplier = result.step.multiplier
        return MetricRecord({"num-trained": len(result.train.kept), **({} if multiplier is None else {"multiplier": multiplier})})

    # -- Flower's contract -------------------------------------------------------------------------
    def start(
        self,
        grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn=None,
        on_round: Callable[[RoundResult], None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` with this strategy's rounds (:func:`fedtops_strategy.round.play_round`,
        the score phase included) and ``evaluate_fn`` (θ_0, then each round's θ) as Flower runs it.
        The ``Result`` holds the last θ, each round's :meth:`round_metrics` as its train metrics
        and ``evaluate_fn``'s values; ``on_round`` gets each round's
        :class:`~fedtops_strategy.round.RoundResult`. With ``privacy``, it stops before a round
        whose releases would exceed ``privacy.max-epsilon`` and returns what was released.

        There is no federated evaluation round here (``evaluate_config`` is logged, not sent):
        Flower's would read the clients' evaluate replies unchecked; this app's held-out evaluation
        is its own phase (``server_app/evaluation.py``). A strategy runs one federation: its
        cross-round state (silence, the sampler's first round, Local's adapters, the privacy
        ledger) belongs to it, so a second ``start`` on the same instance is refused."""
        if self.sampler.first_round is not None:
            raise RuntimeError(f"this {type(self).__name__} already ran a federation (its state carries across rounds): build a new one")
        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        result, arrays = Result(), initial_arrays
        if evaluate_fn is not None and (res := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        for server_round in range(1, num_rounds + 1):
            if (stop := self.averager.budget_stop(server_round, self.score_phase)) is not None:
                log(WARNING, "%s stopped on its privacy budget: %s", type(self).__name__, stop)
                break
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            config = ConfigRecord(dict(train_config or {}))
            played = play_round(self, grid, server_round, arrays, config, train_timeout=timeout, score_timeout=timeout)
            arrays = result.arrays = played.step.arrays()
            result.train_metrics_clientapp[server_round] = self.round_metrics(played)
            if on_round is not None:
                on_round(played)
            evaluated = self.evaluated_arrays(arrays)  # what this strategy evaluates (FedExP: its last two iterates' average)
            if evaluate_fn is not None and (res := evaluate_fn(server_round, arrays if evaluated is None else evaluated)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        return result
