"""The client's optimizer state across rounds: persistent (kept in ``context.state``) or reset."""

import dataclasses

import numpy as np
import pytest
from client_messages import OVERRIDES, client_context, initial_theta, train

from client_app.handlers import OPTIMIZER
from fedopd.config import parse_run_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]


@pytest.fixture(scope="module")
def runs():
    """Round 1 and 2 of a persistent and a reset client, and round 2 of a client new in round 2."""
    persistent = parse_run_config(OVERRIDES)
    reset = dataclasses.replace(persistent, train=dataclasses.replace(persistent.train, optimizer_state="reset"))
    theta0 = initial_theta(persistent)
    ctx_p, ctx_r, ctx_new = client_context(persistent), client_context(reset), client_context(persistent)
    out = {"p1": train(ctx_p, theta0, 1)[0], "r1": train(ctx_r, theta0, 1)[0]}
    out["p2"] = train(ctx_p, out["p1"], 2)[0]
    out["r2"] = train(ctx_r, out["p1"], 2)[0]
    out["new2"] = train(ctx_new, out["p1"], 2)[0]  # a client that never trained: a fresh AdamW
    return out, ctx_p, ctx_r


def test_round_one_is_the_same_for_persistent_and_reset_state(runs):
    out, _, _ = runs
    assert all(np.array_equal(out["p1"][n], out["r1"][n]) for n in out["p1"])


def test_persistent_state_runs_adamws_step_count_on_over_both_rounds(runs):
    _, ctx_p, _ = runs
    assert {float(v.numpy()) for k, v in ctx_p.state[OPTIMIZER].items() if k.endswith(".step")} == {4.0}  # 2 + 2


def test_persistent_moments_change_the_second_rounds_update(runs):
    out, _, _ = runs
    assert any(not np.array_equal(out["p2"][n], out["new2"][n]) for n in out["p2"])  # deterministic: any difference


def test_reset_is_exactly_a_fresh_optimizer_and_keeps_nothing(runs):
    out, _, ctx_r = runs
    assert all(np.array_equal(out["r2"][n], out["new2"][n]) for n in out["r2"])
    assert OPTIMIZER not in ctx_r.state


def test_a_supernode_keeps_its_newest_run_folders_only(tmp_path):
    """A server that starts run after run (one new run id each) cannot fill the host's disk: the
    node keeps its KEEP_RUNS newest run folders; the simulation's layout is left alone."""
    import os

    from client_app.client_state import KEEP_RUNS, prune_runs, save_round_state

    node = tmp_path / "state" / "node-7"
    for i in range(KEEP_RUNS + 3):
        folder = node / f"run-{100 + i}" / "partition-0"
        save_round_state(folder, 1, None, None)
        os.utime(folder.parent, (1_000_000 + i, 1_000_000 + i))
        prune_runs(folder)
    assert sorted(p.name for p in node.iterdir()) == [f"run-{100 + i}" for i in range(3, KEEP_RUNS + 3)]
    beside = tmp_path / "runs" / "x.clients" / "partition-0"
    save_round_state(beside, 1, None, None)
    assert prune_runs(beside) == [] and beside.is_dir()
