"""The client's work for each message type, as functions of the message content and the
client's state: ``train``, ``score`` and ``evaluate``.

They run wherever the models are: in the ClientApp process (simulation, ``worker =
'in-process'``) or in the host's resident worker (``worker = 'resident'``,
:mod:`client_app.resident`). Both call these very functions; the ClientApp shell only wraps
the returned content in a reply :class:`~flwr.app.Message`.

train:     θ_t in → rollouts, teacher, scoring cache (FedTOPS), local OPD → θ_{t,i}^+ and metrics
           out. θ_t, the scoring cache and the optimizer state stay in the client's ``state``.
           What the strategy needs of the client comes with the message's config, never as
           its name (:class:`TrainRequest`): ``learner`` and ``build-scoring-cache``.
score:     Δ_t and the candidates in → Ĵ_i(a), K̂_i(a) out. Only scalars leave the client.
evaluate:  an adapter in → greedy accuracy, Avg@k and Pass@k on the client's held-out prompts out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from client_app import worker
from client_app.client_state import client_state_dir, latest_saved_round, load_round_state, save_round_state
from client_app.limits import NodeLimits
from fedopd.config import RunConfig
from fedopd.core.errors import RequestError
from fedopd.core.procinfo import rss_mb
from fedopd.data.node_data import NodeData, check_server_named_files
from fedopd.distill.cache import ScoringCache
from fedopd.engine.round import CACHE_SOURCES, RoundPlan, derive_seed, evaluate_heldout, score_round, train_round
from fedopd.models.lora import check_compatible, from_record

THETA, CACHE, OPTIMIZER, META = "theta", "scoring-cache", "optimizer", "meta"
LEARNERS = ("federated", "local", "centralized")  # the train config's "learner"
MAX_CANDIDATES = 64  # a score query's candidates: each costs one pass over the scoring cache
SCORED = "scored"  # META's flag: this round's score query was answered (one per round trained)


@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """What a train message's config asks of the client (the strategy's ``configure_train``).

    ``learner``: ``"federated"`` (its own partition's prompts), ``"local"`` (the same, and it
    keeps its own adapter: a client without state restores its saved one), ``"centralized"``
    (one learner on the pooled prompts of every partition, with their combined rollouts per
    round). ``build_scoring_cache``: build the scoring cache for a score query (FedTOPS).
    ``pooled_clients``: the centralized learner takes the rollouts per round of that many clients
    (the round's sampled ones; 0: every partition). A message without these keys (one made by
    hand) asks for a federated learner with a cache.
    """

    server_round: int
    learner: str = "federated"
    build_scoring_cache: bool = True
    pooled_clients: int = 0
    scoring_cache: str = "round"  # where the scoring cache's rollouts come from (fedopd.engine.round.CACHE_SOURCES)

    @classmethod
    def from_config(cls, config, num_partitions: int | None = None, num_rounds: int | None = None) -> TrainRequest:
        """The request, checked before any work: a ``server-round`` in [1, ``num_rounds``] and at
        most ``num_partitions`` pooled clients (what the client's run config and node config say;
        None: unbounded), a known learner and scoring-cache source."""
        learner = str(config.get("learner", cls.learner))
        if learner not in LEARNERS:
            raise RequestError(f"train message: 'learner' = {learner!r}; allowed: {', '.join(map(repr, LEARNERS))}")
        pooled = config.get("pooled-clients", 0)
        if not _integer_in(pooled, 0, num_partitions):
            raise RequestError(f"train message: 'pooled-clients' = {pooled!r}; allowed: an integer in [0, {num_partitions or '∞'}]")
        source = str(config.get("scoring-cache", cls.scoring_cache))
        if source not in CACHE_SOURCES:
            raise RequestError(f"train message: 'scoring-cache' = {source!r}; allowed: {', '.join(map(repr, CACHE_SOURCES))}")
        server_round = config.get("server-round")
        if not _integer_in(server_round, 1, num_rounds):
            raise RequestError(f"train message: 'server-round' = {server_round!r}; allowed: an integer in [1, {num_rounds or '∞'}]")
        return cls(int(server_round), learner, bool(config.get("build-scoring-cache", cls.build_scoring_cache)), int(pooled), source)

    @property
    def pooled(self) -> bool:
        return self.learner == "centralized"


def _integer_in(value: Any, low: int, high: int | None) -> bool:
    """An int (not a bool) in [low, high] (high None: no upper bound)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def learner_seed(seed: int, partition_id: int, num_partitions: int, *, pooled: bool = False) -> int:
    """A client's seed; the Centralized learner, which pools every partition, is one more
    partition (``num_partitions``), whichever node runs it."""
    return derive_seed(seed, num_partitions if pooled else partition_id)


def _part(content: RecordDict, name: str, kind: type, message: str):
    """The message's record ``name``, which must be a ``kind`` (a :class:`RequestError` if not)."""
    record = content.get(name) if hasattr(content, "get") else None
    if not isinstance(record, kind):
        raise RequestError(f"{message}: no {kind.__name__} '{name}' (the message holds {', '.join(map(repr, list(content.keys())[:8]))})")
    return record


def _adapter(content: RecordDict, name: str, models, message: str) -> dict:
    """The message's adapter ``name``: this student's LoRA factors, by name and shape, all finite."""
    arrays = from_record(_part(content, name, ArrayRecord, message))
    problem = check_compatible(models.student.get_lora_arrays(), arrays)
    if problem:
        raise RequestError(f"{message}: '{name}' does not fit this run's adapter: {problem}")
    return arrays


def own_data(node_config: Mapping[str, Any] | None) -> NodeData | None:
    """The node's own data (node config ``data-path``), or None; without it, a deployment node
    refuses a local file that the run config names (:mod:`fedopd.data.node_data`)."""
    return NodeData.from_node_config(node_config or {})


def _pool(cfg: RunConfig, node: NodeData | None, num: int) -> int:
    """The rows a client reads into its prompt pool: its own file's sample, or the run's pool."""
    return cfg.data.prompts_per_client * (1 if node is not None else num)


def _check_data(cfg: RunConfig, node: NodeData | None, node_config: Mapping[str, Any] | None) -> None:
    if node is None:
        check_server_named_files(cfg.data, deployment=(node_config or {}).get("worker") == "resident")


def train(
    content: RecordDict, state: RecordDict, pid: int, num: int, cfg: RunConfig, node_config: Mapping[str, Any] | None = None, run_id: int = 0
) -> RecordDict:
    config = _part(content, "config", ConfigRecord, "train message")
    request = TrainRequest.from_config(config, num_partitions=num, num_rounds=cfg.num_server_rounds)
    server_round = request.server_round
    node = own_data(node_config)
    if node is not None and request.pooled:
        raise RequestError(
            "train message: 'learner' = 'centralized' pools every partition's prompts; a node with its own data (node config 'data-path') holds only its own"
        )
    _check_data(cfg, node, node_config)
    NodeLimits.from_node_config(node_config or {}).check(
        cfg, "train", partitions=(request.pooled_clients or num) if request.pooled else 1, prompt_pool=_pool(cfg, node, num)
    )
    models, prompts = worker.setup(cfg, pid, num, pooled=request.pooled, node=node)
    plan = RoundPlan.from_config(
        cfg,
        server_round,
        learner_seed(cfg.seed, pid, num, pooled=request.pooled),
        partitions=(request.pooled_clients or num) if request.pooled else 1,
        build_cache=request.build_scoring_cache,
        cache_source=request.scoring_cache,
    )
    theta = _adapter(content, "arrays", models, "train message")
    # Centralized's one learner runs on whichever node has the smallest id, which a resumed run
    # may number differently: its state is the learner's, not a partition's.
    folder = client_state_dir(config, node_config or {}, "central" if request.pooled else pid, run_id)
    persistent = cfg.train.optimizer_state == "persistent"
    local = request.learner == "local"

    if META not in state and server_round > 1 and (persistent or local):
        who = "central" if request.pooled else pid
        theta = restore_saved_state(
            state, folder, config, server_round, pid, persistent=persistent, local=local, theta=theta, node_config=node_config or {}, who=who
        )
    optimizer_state = {k: v.numpy() for k, v in state[OPTIMIZER].items()} if persistent and OPTIMIZER in state else None

    out = train_round(models, theta, prompts, plan, optimizer_state=optimizer_state, progress=lambda text: log(INFO, "client %d %s", pid, text))

    state[THETA] = ArrayRecord({k: Array(a) for k, a in theta.items()})
    if out.cache is not None:
        state[CACHE] = ArrayRecord({k: Array(v) for k, v in out.cache.to_arrays().items()})
    if persistent:
        state[OPTIMIZER] = ArrayRecord({k: Array(v) for k, v in out.optimizer_state.items()})
    state[META] = ConfigRecord({"server-round": server_round})
    if folder is not None:
        save_round_state(folder, server_round, out.optimizer_state if persistent else None, out.arrays if local else None)

    metrics = MetricRecord(
        {
            **{k: float(v) for k, v in out.metrics.items()},
            "partition-id": pid,
            "num-examples": len(prompts),
            # Which process holds the models, and how often it has loaded them: once per host.
            "worker-pid": os.getpid(),
            "worker-model-loads": worker.model_loads(),
            "worker-rss-mb": rss_mb(),
        }
    )
    return RecordDict({"arrays": ArrayRecord({k: Array(a) for k, a in out.arrays.items()}), "metrics": metrics})


def restore_saved_state(
    state: RecordDict,
    folder,
    config,
    server_round: int,
    pid: int,
    *,
    persistent: bool,
    local: bool,
    theta,
    node_config: Mapping[str, Any],
    who: int | str,
):
    """A client with no state of its own in round ``server_round`` > 1 (the first round of a
    resumed run, a client that joins later, or one back with an empty ``context.state``):
    continue from its own latest saved round before this one (its optimizer, and for Local its
    adapter, which a resumed server does not have). Returns the adapter to train from.

    With nothing saved: an error in the first round of a resumed run (its state is missing),
    else a client new to the run, which starts fresh.
    """
    restored = latest_saved_round(folder, server_round - 1)
    if restored is None and "resume-run" in config:  # a SuperNode: the resumed run's state is under its own run id
        folder = client_state_dir(config, node_config, who, resume=True)
        restored = latest_saved_round(folder, server_round - 1)
    if restored is None:
        if "resume-round" in config:
            load_round_state(folder, server_round - 1)  # raises: no client state of the round the run resumes after
        log(INFO, "client %d: no saved state before round %d; a client new to this run starts fresh", pid, server_round)
        return theta
    saved_optimizer, own_adapter = load_round_state(folder, restored)
    if persistent and saved_optimizer is not None:
        state[OPTIMIZER] = ArrayRecord({k: Array(v) for k, v in saved_optimizer.items()})
    if local and own_adapter is not None:
        theta = own_adapter
    log(INFO, "client %d: round %d without state of its own; restored its saved state of round %d from %s", pid, server_round, restored, folder)
    return theta


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """What a score query asks of the client, checked before any work: the round (the one whose
    scoring cache the client holds), 1 to :data:`MAX_CANDIDATES` finite candidates a >= 0, and
    whether to add Ĵ_i(a)'s standard errors (``fedtops-se``)."""

    server_round: int
    candidates: tuple[float, ...]
    with_se: bool = False

    @classmethod
    def from_config(cls, config) -> ScoreRequest:
        raw = config.get("candidates")
        if not isinstance(raw, (list, tuple)) or not 1 <= len(raw) <= MAX_CANDIDATES:
            size = len(raw) if isinstance(raw, (list, tuple)) else type(raw).__name__
            raise RequestError(f"score query: 'candidates' holds {size}; allowed: a list of 1 to {MAX_CANDIDATES} numbers")
        if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a >= 0 for a in raw):
            raise RequestError("score query: 'candidates' holds a value that is not a finite number >= 0")
        server_round = config.get("server-round")
        if not _integer_in(server_round, 1, None):
            raise RequestError(f"score query: 'server-round' = {server_round!r}; allowed: an integer >= 1")
        return cls(server_round, tuple(float(a) for a in raw), bool(config.get("score-se", False)))


def score(
    content: RecordDict, state: RecordDict, pid: int, num: int, cfg: RunConfig, node_config: Mapping[str, Any] | None = None, run_id: int = 0
) -> RecordDict:
    """Ĵ_i(a) and K̂_i(a) for the candidates on this round's scoring cache: at most one score
    query per round trained (a second could make the client score any number of increments)."""
    request = ScoreRequest.from_config(_part(content, "config", ConfigRecord, "score query"))
    server_round = request.server_round
    if CACHE not in state or int(state[META]["server-round"]) != server_round:
        raise RequestError(f"score query for round {server_round}, but this client has no scoring cache of that round")
    if state[META].get(SCORED, False):
        raise RequestError(f"score query for round {server_round}, which this client has already answered")
    node = own_data(node_config)
    NodeLimits.from_node_config(node_config or {}).check(cfg, "score", candidates=len(request.candidates))
    models, prompts = worker.setup(cfg, pid, num, node=node)

    theta = from_record(state[THETA])
    delta = _adapter(content, "increment", models, "score query")
    cache = ScoringCache.from_arrays({k: v.numpy() for k, v in state[CACHE].items()})
    started = time.perf_counter()
    scores = score_round(models, theta, delta, cache, list(request.candidates), with_se=request.with_se)
    state[META] = ConfigRecord({**dict(state[META]), SCORED: True})

    metrics = MetricRecord(
        {
            "teacher-scores": scores[0],
            "change-scores": scores[1],
            "num-examples": len(prompts),
            "partition-id": pid,
            "score_s": time.perf_counter() - started,
        }
    )
    if request.with_se:
        metrics["teacher-score-se"] = scores[2]
    return RecordDict({"scores": metrics})


def evaluate(
    content: RecordDict, state: RecordDict, pid: int, num: int, cfg: RunConfig, node_config: Mapping[str, Any] | None = None, run_id: int = 0
) -> RecordDict:
    config = _part(content, "config", ConfigRecord, "evaluate message")
    server_round = config.get("server-round")
    if not _integer_in(server_round, 0, cfg.num_server_rounds):
        raise RequestError(f"evaluate message: 'server-round' = {server_round!r}; allowed: an integer in [0, {cfg.num_server_rounds}]")
    node = own_data(node_config)
    _check_data(cfg, node, node_config)
    NodeLimits.from_node_config(node_config or {}).check(cfg, "evaluate", prompt_pool=_pool(cfg, node, num))
    models, prompts = worker.setup_heldout(cfg, pid, num, node=node)
    theta = _adapter(content, "arrays", models, "evaluate message")
    metrics = evaluate_heldout(models, theta, prompts, cfg.eval, derive_seed(cfg.seed, pid, server_round, 3))
    return RecordDict({"metrics": MetricRecord({**metrics, "num-examples": len(prompts), "partition-id": pid})})


HANDLERS = {"train": train, "score": score, "evaluate": evaluate}
