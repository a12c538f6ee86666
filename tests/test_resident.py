"""The resident worker: a detached Ray actor that keeps the models between messages.

A private Ray instance is started in the test process; the ClientApp shell (node config
``worker = 'resident'``) joins it because Ray is already initialised.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from client_messages import train_message
from conftest import TINY
from flwr.app import Context, RecordDict

from client_app.resident import actor_name, worker_identity
from fedopd.config import parse_run_config

OVERRIDES = {**TINY, "rollout.backend": "hf", "rollout.max-new-tokens": 8, "rollout.per-round": 8, "data.prompts-per-client": 16}


def _name(**changes) -> str:
    return actor_name("node-0", worker_identity(parse_run_config({**OVERRIDES, **changes}).to_run_config()))


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.student", "builtin:tiny-teacher"),
        ("model.teacher", "builtin:tiny-student"),
        ("model.dtype", "bfloat16"),
        ("lora.rank", 4),
        ("lora.alpha", 8.0),
        ("rollout.backend", "vllm"),
        ("rollout.max-new-tokens", 512),
        ("data.max-prompt-tokens", 1024),
        ("rollout.gpu-memory-utilization", 0.5),
    ],
)
def test_worker_identity_changes_with_what_the_models_depend_on(key, value):
    assert _name(**{key: value}) != _name()


@pytest.mark.parametrize("key, value", [("train.lr", 1e-4), ("seed", 7), ("strategy.name", "fedavg"), ("num-server-rounds", 9)])
def test_worker_identity_ignores_what_the_models_do_not_depend_on(key, value):
    assert _name(**{key: value}) == _name()


def test_worker_name_separates_supernodes_on_one_host():
    identity = worker_identity(parse_run_config(OVERRIDES).to_run_config())
    assert actor_name("node-0", identity) != actor_name("node-1", identity)


def test_a_worker_name_is_read_back_exactly_even_when_one_name_begins_another():
    from client_app.resident import worker_group

    identity = worker_identity(parse_run_config(OVERRIDES).to_run_config())
    assert worker_group(actor_name("node", identity)) == "node"
    assert worker_group(actor_name("node-0", identity)) == "node-0"  # not "node"'s: stopping "node" spares it
    assert worker_group("fedopd-worker-x") is None and worker_group("other-actor-0123456789ab") is None


def test_an_unknown_worker_mode_is_refused_naming_the_key():
    from client_app.app import worker_mode

    with pytest.raises(ValueError, match="node config 'worker' = 'remote'; allowed: 'in-process', 'resident'"):
        worker_mode({"worker": "remote"})
    assert worker_mode({}) == "in-process"


def test_the_resident_mode_without_ray_names_the_fix():
    ray = pytest.importorskip("ray")
    from client_app.resident import connect

    if ray.is_initialized():
        pytest.skip("a Ray instance is initialised in this process")
    with pytest.raises(RuntimeError, match="ray start --head"):
        connect("127.0.0.1:1")


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from client_app.resident import NAMESPACE, stop_workers

    ray.init(num_cpus=1, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield ray
    stop_workers()
    ray.shutdown()


def _context(cfg, mode):
    # ray-insecure: the Ray instance is this test process's own, started without authentication;
    # the refusal of such an instance is tested in test_ray_auth.py.
    node = {"partition-id": 0, "num-partitions": 3, "worker": mode, "worker-name": "test", "ray-insecure": True}
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=cfg.to_run_config())


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_resident_worker_runs_two_rounds_like_the_in_process_client_with_models_loaded_once(ray_instance):
    from client_app.app import handle
    from client_app.resident import list_workers
    from server_app.app import initial_adapter

    cfg = parse_run_config(OVERRIDES)
    theta0 = initial_adapter(cfg)[0]
    results = {}
    for mode in ("resident", "in-process"):
        context, theta, metrics = _context(cfg, mode), theta0, []
        for server_round in (1, 2):  # round 2 uses the optimizer state kept in context.state
            reply = handle("train", train_message(theta, server_round), context)
            theta = {k: v.numpy() for k, v in reply.content["arrays"].items()}
            metrics.append(dict(reply.content["metrics"]))
        results[mode] = (theta, metrics, set(context.state.keys()))

    theta_r, metrics_r, state_r = results["resident"]
    theta_i, _, state_i = results["in-process"]
    for k in theta_i:  # the worker computes exactly what the client computes in process
        np.testing.assert_array_equal(theta_r[k], theta_i[k])
    assert state_r == state_i == {"theta", "scoring-cache", "optimizer", "meta"}
    pids = {m["worker-pid"] for m in metrics_r}
    assert len(pids) == 1 and os.getpid() not in pids  # one other process, both rounds
    assert [m["worker-model-loads"] for m in metrics_r] == [1, 1]
    assert list_workers() == [actor_name("test", worker_identity(cfg.to_run_config()))]


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_a_run_with_other_models_replaces_the_worker_and_stop_removes_it(ray_instance):
    from client_app.app import handle
    from client_app.resident import list_workers, stop_workers
    from server_app.app import initial_adapter

    for rank in (8, 4):
        cfg = parse_run_config({**OVERRIDES, "lora.rank": rank})
        reply = handle("train", train_message(initial_adapter(cfg)[0], 1), _context(cfg, "resident"))
        assert reply.content["metrics"]["worker-model-loads"] == 1  # a fresh worker for the new models
        assert list_workers() == [actor_name("test", worker_identity(cfg.to_run_config()))]
    assert stop_workers("test") == [actor_name("test", worker_identity(cfg.to_run_config()))]
    assert list_workers() == []
