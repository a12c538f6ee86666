"""The ClientApp's train handler across rounds: the cosine schedule's position, and persistent
versus reset optimizer state. Messages are built by hand; no Ray, no SuperLink.
"""

import dataclasses

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from client_app.app import handle_train
from client_app.handlers import OPTIMIZER
from conftest import TINY
from fedopd.config import parse_run_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

LR = 1e-2
# 8 rollouts per round, mini-batch 4: 2 local steps per round; 2 rounds: 4 steps in the run.
OVERRIDES = {
    **TINY,
    "num-server-rounds": 2, "data.prompts-per-client": 16, "rollout.per-round": 8, "rollout.max-new-tokens": 8,
    "rollout.backend": "hf", "train.lr": LR, "train.mini-batch": 4, "train.micro-batch": 2,
}




def _context():
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3}, state=RecordDict(), run_config={})


def _train(context, cfg, theta, server_round):
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in theta.items()}),
                          "config": ConfigRecord({"server-round": server_round})})
    meta = Metadata(run_id=1, message_id=f"m{server_round}", src_node_id=0, dst_node_id=7, reply_to_message_id="",
                    group_id=str(server_round), created_at=0.0, ttl=600.0, message_type="train")
    reply = handle_train(Message(content=content, metadata=meta), context, cfg)
    arrays = {k: v.numpy() for k, v in reply.content["arrays"].items()}
    return arrays, dict(reply.content["metrics"])


@pytest.fixture(scope="module")
def theta0():
    from server_app.app import initial_adapter

    return initial_adapter(parse_run_config(OVERRIDES))[0]


def test_round_two_continues_the_cosine_schedule_without_warmup(theta0):
    cfg = parse_run_config(OVERRIDES)
    context = _context()
    theta1, m1 = _train(context, cfg, theta0, 1)
    _, m2 = _train(context, cfg, theta1, 2)
    # lr(step) = LR · ½(1 + cos(π · step / 4)): round 1 takes steps 0, 1; round 2 steps 2, 3.
    assert m1["lr_first"] == pytest.approx(LR)
    assert m1["lr_last"] == pytest.approx(LR * 0.5 * (1 + np.cos(np.pi / 4)))
    assert m2["lr_first"] == pytest.approx(LR * 0.5)
    assert m2["lr_last"] == pytest.approx(LR * 0.5 * (1 + np.cos(3 * np.pi / 4)))


def test_persistent_optimizer_state_is_loaded_in_round_two_and_reset_starts_fresh(theta0):
    persistent = parse_run_config(OVERRIDES)
    reset = dataclasses.replace(persistent, train=dataclasses.replace(persistent.train, optimizer_state="reset"))
    ctx_p, ctx_r, ctx_new = _context(), _context(), _context()
    theta1, _ = _train(ctx_p, persistent, theta0, 1)
    theta1_r, _ = _train(ctx_r, reset, theta0, 1)
    assert all(np.array_equal(theta1[n], theta1_r[n]) for n in theta1)  # round 1: nothing stored yet

    out_p, _ = _train(ctx_p, persistent, theta1, 2)
    out_r, _ = _train(ctx_r, reset, theta1, 2)
    out_new, _ = _train(ctx_new, persistent, theta1, 2)  # a client that never trained: fresh AdamW

    # Persistent: AdamW's step count runs on over both rounds (2 + 2), and the moments change the update.
    assert {float(v.numpy()) for k, v in ctx_p.state[OPTIMIZER].items() if k.endswith(".step")} == {4.0}
    assert any(not np.allclose(out_p[n], out_new[n], atol=1e-7) for n in out_p)
    # Reset: exactly a fresh optimizer, and nothing is kept between rounds.
    assert all(np.array_equal(out_r[n], out_new[n]) for n in out_r)
    assert OPTIMIZER not in ctx_r.state
