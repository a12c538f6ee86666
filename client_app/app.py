"""ClientApp: the ``train``, ``query.score`` and ``evaluate`` handlers.

train:     θ_t in → rollouts, teacher, scoring cache (FedTOPS), local OPD → θ_{t,i}^+ and metrics
           out. θ_t, the scoring cache and the optimizer state stay in ``context.state``.
score:     Δ_t and the candidates in → Ĵ_i(a), K̂_i(a) out. Only scalars leave the client.
evaluate:  an adapter in → greedy accuracy, Avg@k and Pass@k on the client's held-out prompts out.

Local (``strategy.name = 'local'``) needs nothing special here: the server sends each client its
own adapter. Centralized: the one learner the server trains holds every partition's prompts and
learns from the clients' combined rollouts per round (:meth:`RunConfig.learner_budget`).
"""

from __future__ import annotations

import dataclasses

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.worker import setup, setup_heldout
from fedopd.cache import ScoringCache
from fedopd.config import RunConfig
from fedopd.lora import check_compatible, from_record
from fedopd.round import derive_seed, evaluate_heldout, score_round, train_round

app = ClientApp()

THETA, CACHE, OPTIMIZER, META = "theta", "scoring-cache", "optimizer", "meta"


def _partition(context: Context) -> tuple[int, int]:
    try:
        pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except (KeyError, ValueError) as err:
        raise ValueError(
            "node config needs integer 'partition-id' and 'num-partitions' "
            "(e.g. flower-supernode --node-config \"partition-id=0 num-partitions=3\")"
        ) from err
    if not 0 <= pid < num:
        raise ValueError(f"node config 'partition-id' = {pid} is not in [0, 'num-partitions' = {num})")
    return pid, num


@app.train()
def train(msg: Message, context: Context) -> Message:
    return handle_train(msg, context, RunConfig.from_run_config(context.run_config))


@app.query("score")
def score(msg: Message, context: Context) -> Message:
    return handle_score(msg, context, RunConfig.from_run_config(context.run_config))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return handle_evaluate(msg, context, RunConfig.from_run_config(context.run_config))


def learner_seed(cfg: RunConfig, partition_id: int, num_partitions: int) -> int:
    """A client's seed; the Centralized learner, which pools every partition, is one more
    partition (``num_partitions``), whichever node runs it."""
    return derive_seed(cfg.seed, num_partitions if cfg.strategy.name == "centralized" else partition_id)


def handle_train(msg: Message, context: Context, cfg: RunConfig) -> Message:
    pid, num = _partition(context)
    models, prompts = setup(cfg, pid, num)
    per_round, steps_per_round, total_steps = cfg.learner_budget(num)
    server_round = int(msg.content["config"]["server-round"])
    theta = from_record(msg.content["arrays"])

    state = context.state
    persistent = cfg.train.optimizer_state == "persistent" and OPTIMIZER in state
    optimizer_state = {k: v.numpy() for k, v in state[OPTIMIZER].items()} if persistent else None

    out = train_round(
        models,
        theta,
        prompts,
        rollout=dataclasses.replace(cfg.rollout, per_round=per_round),
        cache=cfg.cache,
        train=cfg.train,
        server_round=server_round,
        seed=learner_seed(cfg, pid, num),
        step_offset=(server_round - 1) * steps_per_round,
        total_steps=total_steps,
        optimizer_state=optimizer_state,
        teacher_batch=cfg.model.teacher_batch,
        build_cache=cfg.strategy.name == "fedtops",
    )

    state[THETA] = ArrayRecord({k: Array(a) for k, a in theta.items()})
    if out.cache is not None:
        state[CACHE] = ArrayRecord({k: Array(v) for k, v in out.cache.to_arrays().items()})
    if cfg.train.optimizer_state == "persistent":
        state[OPTIMIZER] = ArrayRecord({k: Array(v) for k, v in out.optimizer_state.items()})
    state[META] = ConfigRecord({"server-round": server_round})

    metrics = MetricRecord({**{k: float(v) for k, v in out.metrics.items()}, "partition-id": pid, "num-examples": len(prompts)})
    reply = RecordDict({"arrays": ArrayRecord({k: Array(a) for k, a in out.arrays.items()}), "metrics": metrics})
    return Message(content=reply, reply_to=msg)


def handle_score(msg: Message, context: Context, cfg: RunConfig) -> Message:
    pid, num = _partition(context)
    models, prompts = setup(cfg, pid, num)
    state = context.state
    server_round = int(msg.content["config"]["server-round"])
    if CACHE not in state or int(state[META]["server-round"]) != server_round:
        raise RuntimeError(f"score query for round {server_round}, but this client has no scoring cache of that round")

    theta = from_record(state[THETA])
    delta = from_record(msg.content["increment"])
    problem = check_compatible(theta, delta)
    if problem:
        raise ValueError(f"score query: the increment does not fit the adapter: {problem}")
    cache = ScoringCache.from_arrays({k: v.numpy() for k, v in state[CACHE].items()})
    candidates = [float(a) for a in msg.content["config"]["candidates"]]
    teacher_scores, change_scores = score_round(models, theta, delta, cache, candidates)

    metrics = MetricRecord(
        {"teacher-scores": teacher_scores, "change-scores": change_scores, "num-examples": len(prompts), "partition-id": pid}
    )
    return Message(content=RecordDict({"scores": metrics}), reply_to=msg)


def handle_evaluate(msg: Message, context: Context, cfg: RunConfig) -> Message:
    pid, num = _partition(context)
    models, prompts = setup_heldout(cfg, pid, num)
    server_round = int(msg.content["config"]["server-round"])
    theta = from_record(msg.content["arrays"])
    metrics = evaluate_heldout(models, theta, prompts, cfg.eval, derive_seed(cfg.seed, pid, server_round, 3))
    reply = MetricRecord({**metrics, "num-examples": len(prompts), "partition-id": pid})
    return Message(content=RecordDict({"metrics": reply}), reply_to=msg)
