"""The client's work for each message type, as functions of the message content and the
client's state: ``train``, ``score`` and ``evaluate``.

They run wherever the models are: in the ClientApp process (simulation, ``worker =
'in-process'``) or in the host's resident worker (``worker = 'resident'``,
:mod:`client_app.resident`). Both call these very functions; the ClientApp shell only wraps
the returned content in a reply :class:`~flwr.app.Message`.

train:     θ_t in → rollouts, teacher, scoring cache (FedTOPS), local OPD → θ_{t,i}^+ and metrics
           out. θ_t, the scoring cache and the optimizer state stay in the client's ``state``.
           What the strategy needs of the client comes with the message's config, never as
           its name (:class:`client_app.requests.TrainRequest`): ``learner`` and ``build-scoring-cache``.
score:     Δ_t and the candidates in → Ĵ_i(a), K̂_i(a) out. Only scalars leave the client.
evaluate:  an adapter in → greedy accuracy, Avg@k and Pass@k on the client's held-out prompts out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from client_app import worker
from client_app.client_state import client_state_dir, latest_saved_round, load_round_state, prune_runs, save_round_state
from client_app.requests import CACHE, META, OPTIMIZER, SCORED, THETA, check_message
from fedopd.config import RunConfig
from fedopd.core.errors import RequestError
from fedopd.core.procinfo import rss_mb
from fedopd.distill.cache import ScoringCache
from fedopd.engine.round import RoundPlan, derive_seed, evaluate_heldout, score_round, train_round
from fedopd.models.lora import check_compatible, from_record


def learner_seed(seed: int, partition_id: int, num_partitions: int, *, pooled: bool = False) -> int:
    """A client's seed; the Centralized learner, which pools every partition, is one more
    partition (``num_partitions``), whichever node runs it."""
    return derive_seed(seed, num_partitions if pooled else partition_id)


def _adapter(content: RecordDict, name: str, models, message: str) -> dict:
    """The message's adapter ``name``: this student's LoRA factors, by name and shape, all finite."""
    arrays = from_record(content[name])  # an ArrayRecord: check_message saw it
    problem = check_compatible(models.student.factor_parameters(), arrays)  # the student's factors, by name and shape: no copies
    if problem:
        raise RequestError(f"{message}: '{name}' does not fit this run's adapter: {problem}")
    return arrays


def train(
    content: RecordDict,
    state: RecordDict,
    pid: int,
    num: int,
    cfg: RunConfig,
    node_config: Mapping[str, Any] | None = None,
    run_id: int = 0,
    node_id: int = 0,
) -> RecordDict:
    checked = check_message("train", content, state, num, cfg, node_config)
    config, request, node = content["config"], checked.request, checked.node
    server_round = request.server_round
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
    who = "central" if request.pooled else pid
    folder = client_state_dir(config, node_config or {}, who, run_id, node_id=node_id)
    persistent = cfg.train.optimizer_state == "persistent"
    local = request.learner == "local"

    if META not in state and server_round > 1 and (persistent or local):
        theta = restore_saved_state(
            state,
            folder,
            config,
            server_round,
            pid,
            persistent=persistent,
            local=local,
            theta=theta,
            node_config=node_config or {},
            who=who,
            node_id=node_id,
        )
    optimizer_state = {k: v.numpy() for k, v in state[OPTIMIZER].items()} if persistent and OPTIMIZER in state else None

    out = train_round(models, theta, prompts, plan, optimizer_state=optimizer_state, progress=lambda text: log(INFO, "client %d %s", pid, text))

    state[THETA] = ArrayRecord({k: Array(a) for k, a in theta.items()})
    if out.cache is not None:
        state[CACHE] = ArrayRecord({k: Array(v) for k, v in out.cache.to_arrays().items()})
    elif CACHE in state:  # no cache this round: an older round's must not answer this round's score query
        del state[CACHE]
    if persistent:
        state[OPTIMIZER] = ArrayRecord({k: Array(v) for k, v in out.optimizer_state.items()})
    state[META] = ConfigRecord({"server-round": server_round})
    if folder is not None:
        save_round_state(folder, server_round, out.optimizer_state if persistent else None, out.arrays if local else None)
        prune_runs(folder)

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
    node_id: int = 0,
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
        folder = client_state_dir(config, node_config, who, node_id=node_id, resume=True)
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


def score(
    content: RecordDict,
    state: RecordDict,
    pid: int,
    num: int,
    cfg: RunConfig,
    node_config: Mapping[str, Any] | None = None,
    run_id: int = 0,
    node_id: int = 0,
) -> RecordDict:
    """Ĵ_i(a) and K̂_i(a) for the candidates on this round's scoring cache: at most one score
    query per round trained (a second could make the client score any number of increments)."""
    checked = check_message("score", content, state, num, cfg, node_config)
    request, node = checked.request, checked.node
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
    content: RecordDict,
    state: RecordDict,
    pid: int,
    num: int,
    cfg: RunConfig,
    node_config: Mapping[str, Any] | None = None,
    run_id: int = 0,
    node_id: int = 0,
) -> RecordDict:
    checked = check_message("evaluate", content, state, num, cfg, node_config)
    server_round, node = checked.request, checked.node
    models, prompts = worker.setup_heldout(cfg, pid, num, node=node)
    theta = _adapter(content, "arrays", models, "evaluate message")
    metrics = evaluate_heldout(models, theta, prompts, cfg.eval, derive_seed(cfg.seed, pid, server_round, 3))
    return RecordDict({"metrics": MetricRecord({**metrics, "num-examples": len(prompts), "partition-id": pid})})


HANDLERS = {"train": train, "score": score, "evaluate": evaluate}
