"""The paper's Local and Centralized references, run through the ServerApp and ClientApp in
process (:class:`server_app.inprocess.InProcessGrid`), with every message recorded."""

import numpy as np
import pytest
from conftest import TINY

from fedopd.config import parse_run_config
from fedopd.models import load_adapter
from fedopd.models.lora import from_record
from server_app.inprocess import InProcessGrid, task_identity
from server_app.run_folder import read_rounds

pytestmark = pytest.mark.slow

SMALL = {
    **TINY,
    "data.name": "sandbox",
    "num-server-rounds": 2,
    "data.prompts-per-client": 16,
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 12,
    "train.mini-batch": 4,
    "train.micro-batch": 4,
    "eval.every": 1,
    "eval.prompts-per-client": 3,
    "eval.samples": 2,
    "eval.max-new-tokens": 8,
}


class RecordingGrid(InProcessGrid):
    """Remembers (type, partition id, round, arrays) of every message the server sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            pid = self.contexts[m.metadata.dst_node_id].node_config["partition-id"]
            arrays = from_record(m.content["arrays"]) if "arrays" in m.content else None
            self.sent.append((m.metadata.message_type, pid, int(m.content["config"]["server-round"]), arrays))
        return super().push_messages(messages)

    def arrays(self, kind, pid, server_round):
        [(_, _, _, a)] = [s for s in self.sent if s[:3] == (kind, pid, server_round)]
        return a


def _run(tmp_path_factory, name):
    from client_app.app import app
    from server_app.app import run_server

    cfg = parse_run_config({**SMALL, "strategy.name": name, "output-dir": str(tmp_path_factory.mktemp(name))})
    grid = RecordingGrid(app, cfg.to_run_config(), 3)
    with task_identity():
        path = run_server(grid, cfg)
    return grid, path, read_rounds(path)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return _run(tmp_path_factory, "local")


@pytest.fixture(scope="module")
def centralized(tmp_path_factory):
    return _run(tmp_path_factory, "centralized")


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_local_trains_each_client_from_its_own_adapter_and_never_averages(local):
    grid, path, rounds = local
    initial = load_adapter(path / "round-000")
    for pid in range(3):
        assert _same(grid.arrays("train", pid, 1), initial)  # the shared initialisation
        own = load_adapter(path / "round-001" / f"client-{pid}")
        assert _same(grid.arrays("train", pid, 2), own)  # round 2 starts from its own round-1 adapter
    finals = [load_adapter(path / "round-002" / f"client-{pid}") for pid in range(3)]
    assert not _same(finals[0], finals[1]) and not _same(finals[1], finals[2])
    assert not (path / "round-002" / "adapter_model.safetensors").exists()  # no global adapter
    assert [r["multiplier"] for r in rounds[1:]] == [None, None]
    assert [r["excluded"] for r in rounds[1:]] == [[], []]  # every client's own-adapter message answered


def test_local_clients_evaluate_their_own_adapters_and_the_run_reports_the_local_mean(local):
    grid, path, rounds = local
    for pid in range(3):
        assert _same(grid.arrays("evaluate", pid, 2), load_adapter(path / "round-002" / f"client-{pid}"))
    ev = rounds[-1]["evaluation"]
    assert ev["aggregate"] == "local-mean"
    assert ev["accuracy"] == pytest.approx(np.mean([c["accuracy"] for c in ev["clients"]]))


def test_centralized_trains_one_learner_on_every_clients_prompts_with_the_combined_budget(centralized):
    grid, path, rounds = centralized
    assert [(s[0], s[2]) for s in grid.sent if s[0] == "train"] == [("train", 1), ("train", 2)]
    for r in rounds[1:]:
        [learner] = r["clients"]
        assert learner["num-examples"] == 3 * 16  # the pooled prompts
        assert learner["steps"] == 3 * 8 / 4  # three clients' rollouts, the same mini-batch
        assert r["multiplier"] == 1.0
        assert r["excluded"] == []  # the other clients were never asked, so nobody is missing
    # 2 rounds x 6 steps: the cosine schedule spans the combined depth (round 2 starts at step 6 of 12)
    assert rounds[2]["clients"][0]["lr_first"] == pytest.approx(2e-3 * 0.5 * (1 + np.cos(np.pi * 6 / 12)))


def test_centralized_is_evaluated_by_every_client_on_the_global_adapter(centralized):
    grid, path, rounds = centralized
    for pid in range(3):
        assert _same(grid.arrays("evaluate", pid, 2), load_adapter(path / "round-002"))
    assert sorted(c["partition-id"] for c in rounds[-1]["evaluation"]["clients"]) == [0, 1, 2]


def test_the_centralized_learner_holds_the_pooled_prompts_of_all_partitions():
    from client_app.worker import setup

    fed = parse_run_config({**SMALL, "strategy.name": "fedavg"})
    pooled = setup(fed, 1, 3, pooled=True)[1]
    parts = [setup(fed, i, 3)[1] for i in range(3)]
    assert pooled == parts[0] + parts[1] + parts[2]
    assert {p.group for p in pooled} == {"addition", "multiplication", "expression"}


def test_the_learner_budget_matches_the_paper():
    paper = {"num-server-rounds": 50, "rollout.per-round": 32, "train.mini-batch": 8}
    assert parse_run_config({**paper, "strategy.name": "centralized"}).learner_budget(3) == (96, 12, 600)  # 3 pooled
    assert parse_run_config({**paper, "strategy.name": "fedavg"}).learner_budget(1) == (32, 4, 200)


def test_the_centralized_learner_draws_the_same_data_whichever_node_runs_it():
    from client_app.handlers import learner_seed

    assert learner_seed(42, 0, 3, pooled=True) == learner_seed(42, 2, 3, pooled=True)
    assert learner_seed(42, 0, 3) != learner_seed(42, 2, 3)
