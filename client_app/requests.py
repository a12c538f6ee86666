"""What a message asks of a client, checked before any work, without the models (no torch).

The ClientApp shell runs :func:`check_message` before it hands a message to the resident worker,
so that a message the node refuses neither starts nor stops a worker; the handlers
(:mod:`client_app.handlers`) run it again where the work happens and use what it returns. Every
error here is a :class:`~fedopd.core.errors.RequestError` (its text quotes the message and the run
config, never the node's own settings or files) or a node config error
(:class:`~fedopd.core.errors.LocalError`: its key and kind leave the node).

Per message kind:

- every kind: the node's own data (:mod:`fedopd.data.node_data`) or, on a deployment node, no
  data source the run config names; the node's bounds (:mod:`client_app.limits`);
- ``train``: :class:`TrainRequest`; a round after the last one this client trained (a repeated
  or older round could rebuild a scoring cache and answer its score query again);
- ``score``: :class:`ScoreRequest`; the client holds the scoring cache of that round and has not
  answered it yet (one score query per round trained);
- ``evaluate``: a ``server-round`` in [0, ``num-server-rounds``].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from client_app.limits import NodeLimits
from fedopd.core.errors import RequestError
from fedopd.core.settings import CACHE_SOURCES, RunConfig
from fedopd.data.node_data import NodeData, check_server_named_files, deployment_node

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
            raise RequestError(f"train message: 'pooled-clients' = {pooled!r}; allowed: an integer from 0 to the number of partitions")
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


def _part(content: RecordDict, name: str, kind: type, message: str):
    """The message's record ``name``, which must be a ``kind`` (a :class:`RequestError` if not)."""
    record = content.get(name) if hasattr(content, "get") else None
    if not isinstance(record, kind):
        raise RequestError(f"{message}: no {kind.__name__} '{name}' (the message holds {', '.join(map(repr, list(content.keys())[:8]))})")
    return record


def own_data(node_config: Mapping[str, Any] | None) -> NodeData | None:
    """The node's own data (node config ``data-path``), or None; without it, a deployment node
    refuses a local file that the run config names (:mod:`fedopd.data.node_data`)."""
    return NodeData.from_node_config(node_config or {})


def _pool(cfg: RunConfig, node: NodeData | None, num: int) -> int:
    """The rows a client reads into its prompt pool: its own file's sample, or the run's pool."""
    return cfg.data.prompts_per_client * (1 if node is not None else num)


def _check_data(cfg: RunConfig, node: NodeData | None, deployment: bool) -> None:
    if node is None:
        check_server_named_files(cfg.data, deployment=deployment)


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


@dataclasses.dataclass(frozen=True)
class Checked:
    """A message that passed :func:`check_message`: its request and the node's own data."""

    request: Any  # TrainRequest, ScoreRequest, or the evaluate round (int)
    node: NodeData | None


def check_message(kind: str, content: RecordDict, state: RecordDict, num: int, cfg: RunConfig, node_config: Mapping[str, Any] | None) -> Checked:
    """Everything the node checks of a ``kind`` message before any work (module docstring)."""
    node_config = node_config or {}
    node = own_data(node_config)
    limits = NodeLimits.from_node_config(node_config)
    deployment = deployment_node(node_config)
    if kind == "train":
        request = TrainRequest.from_config(
            _part(content, "config", ConfigRecord, "train message"), num_partitions=num, num_rounds=cfg.num_server_rounds
        )
        _part(content, "arrays", ArrayRecord, "train message")
        if META in state and request.server_round <= int(state[META]["server-round"]):
            raise RequestError(
                f"train message for round {request.server_round}, but this client already trained round {int(state[META]['server-round'])}"
            )
        if node is not None and request.pooled:
            raise RequestError(
                "train message: 'learner' = 'centralized' pools every partition's prompts; a node with its own data (node config 'data-path') holds only its own"
            )
        _check_data(cfg, node, deployment)
        limits.check(
            cfg,
            "train",
            partitions=(request.pooled_clients or num) if request.pooled else 1,
            prompt_pool=_pool(cfg, node, num),
            deployment=deployment,
        )
        return Checked(request, node)
    if kind == "score":
        request = ScoreRequest.from_config(_part(content, "config", ConfigRecord, "score query"))
        _part(content, "increment", ArrayRecord, "score query")
        if CACHE not in state or META not in state or int(state[META]["server-round"]) != request.server_round:
            raise RequestError(f"score query for round {request.server_round}, but this client has no scoring cache of that round")
        if state[META].get(SCORED, False):
            raise RequestError(f"score query for round {request.server_round}, which this client has already answered")
        limits.check(cfg, "score", candidates=len(request.candidates), deployment=deployment)
        return Checked(request, node)
    config = _part(content, "config", ConfigRecord, "evaluate message")
    _part(content, "arrays", ArrayRecord, "evaluate message")
    server_round = config.get("server-round")
    if not _integer_in(server_round, 0, cfg.num_server_rounds):
        raise RequestError(f"evaluate message: 'server-round' = {server_round!r}; allowed: an integer in [0, {cfg.num_server_rounds}]")
    _check_data(cfg, node, deployment)
    limits.check(cfg, "evaluate", prompt_pool=_pool(cfg, node, num), deployment=deployment)
    return Checked(server_round, node)
