"""Train messages built by hand for the ClientApp's real entry point (no Ray, no SuperLink)."""

import numpy as np
from conftest import TINY
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

LR = 1e-2
# 8 rollouts per round, mini-batch 4: 2 local steps per round; 2 rounds: 4 steps in the run.
OVERRIDES = {
    **TINY,
    "num-server-rounds": 2,
    "data.prompts-per-client": 16,
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 8,
    "rollout.backend": "hf",
    "train.lr": LR,
    "train.mini-batch": 4,
    "train.micro-batch": 2,
}


def client_context(cfg) -> Context:
    """Client 0 of 3 with a fresh state, running ``cfg`` (a validated RunConfig)."""
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3}, state=RecordDict(), run_config=cfg.to_run_config())


def train_message(theta: dict[str, np.ndarray], server_round: int) -> Message:
    """The train message a ServerApp sends node 7 in ``server_round`` with θ."""
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in theta.items()}), "config": ConfigRecord({"server-round": server_round})})
    meta = Metadata(
        run_id=1,
        message_id=f"m{server_round}",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id=str(server_round),
        created_at=0.0,
        ttl=600.0,
        message_type="train",
    )
    return Message(content=content, metadata=meta)


def train(context: Context, theta: dict[str, np.ndarray], server_round: int) -> tuple[dict[str, np.ndarray], dict]:
    """Send θ to the ClientApp's train entry point; (θ⁺, metrics) of its reply."""
    from client_app.app import train as train_entry

    reply = train_entry(train_message(theta, server_round), context)
    return {k: v.numpy() for k, v in reply.content["arrays"].items()}, dict(reply.content["metrics"])


def initial_theta(cfg) -> dict[str, np.ndarray]:
    from server_app.app import initial_adapter

    return initial_adapter(cfg)[0]


def fake_models(**factors: tuple[int, ...]):
    """Stand-in client models for handler tests that replace the work: a student whose LoRA
    factors (the shapes a message's adapter must have) are ``factors`` (default ``a``: (2,))."""
    from types import SimpleNamespace

    shapes = factors or {"a": (2,)}
    return SimpleNamespace(student=SimpleNamespace(factor_parameters=lambda: {k: np.zeros(s, np.float32) for k, s in shapes.items()}))
