"""End to end through Flower's simulation runtime: 3 clients, 2 rounds, each strategy.

``run_simulation`` hands the apps an empty run config, so the test wraps the app's own handlers
with a config of its own (the tiny preset, made smaller). Flower logs a failed ServerApp instead
of raising, so every assertion is on what the run wrote.
"""

import json
import re

import numpy as np
import pytest
from conftest import TINY

pytestmark = pytest.mark.slow

STRATEGIES = {
    "fedavg": {"strategy.name": "fedavg"},
    "fixed": {"strategy.name": "fixed", "strategy.multiplier": 3.0},
    "fedtops": {"strategy.name": "fedtops", "strategy.trust-budget": 0.05},
}


def _apps(overrides):
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from client_app.app import score, train
    from fedopd.config import parse_run_config
    from server_app.app import run_server

    cfg = parse_run_config(overrides)
    server, client = ServerApp(), ClientApp()

    def with_run_config(context):
        """The client's context as Flower's runtime builds it for a FAB with this run config."""
        return Context(
            run_id=context.run_id, node_id=context.node_id, node_config=context.node_config, state=context.state, run_config=cfg.to_run_config()
        )

    @server.main()
    def _main(grid, context):
        run_server(grid, cfg)

    def record_worker_models():
        """Where this Ray worker's models run (its cached ones: no second load), one file per worker
        process in the run's output folder. Nested, so Ray pickles it by value."""
        import os
        from pathlib import Path

        from client_app.worker import _models

        student = _models(cfg).student
        (Path(cfg.output_dir) / f"worker-{os.getpid()}.models").write_text(f"{student.device.type} {student.dtype}")

    @client.train()
    def _train(msg, context):
        reply = train(msg, with_run_config(context))
        record_worker_models()
        return reply

    @client.query("score")
    def _score(msg, context):
        return score(msg, with_run_config(context))

    return server, client


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from flwr.simulation import run_simulation

    from server_app.run_folder import read_rounds

    out = {}
    for name, strategy in STRATEGIES.items():
        root = tmp_path_factory.mktemp(name)
        overrides = {
            **TINY,
            "num-server-rounds": 2,
            "output-dir": str(root),
            "data.prompts-per-client": 16,
            "rollout.per-round": 8,
            "rollout.max-new-tokens": 16,
            **strategy,
        }
        server, client = _apps(overrides)
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=3,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}},
        )
        folders = [p.parent for p in root.glob("*/config.json")]
        assert len(folders) == 1, f"{name}: expected one run folder, found {folders}"
        out[name] = (folders[0], read_rounds(folders[0]))
    return out


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_runs_two_rounds_with_three_clients(runs, name):
    folder, rounds = runs[name]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["strategy"] == name
        assert sorted(c["partition-id"] for c in r["clients"]) == [0, 1, 2]
        assert r["excluded"] == []
    config = json.loads((folder / "config.json").read_text())
    assert config["strategy.name"] == name and config["num-server-rounds"] == 2


def test_the_ray_workers_run_the_models_on_the_cpu_in_fp32(runs):
    """FEDTOPS_DEVICE=cpu (tests/conftest.py) reaches Flower's Ray workers: on a GPU host too."""
    for name, (folder, _) in runs.items():
        seen = {p.read_text() for p in folder.parent.glob("worker-*.models")}
        assert seen == {"cpu torch.float32"}, (name, seen)


def test_multipliers_are_recorded_as_expected(runs):
    assert [r["multiplier"] for r in runs["fedavg"][1]] == [1.0, 1.0]
    assert [r["multiplier"] for r in runs["fixed"][1]] == [3.0, 3.0]
    for r in runs["fedtops"][1]:
        assert r["candidates"] == [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]
        assert len(r["teacher_scores"]) == 6
        assert len(r["change_scores"]) == 3 and all(len(k) == 6 for k in r["change_scores"])
        assert r["multiplier"] in r["candidates"] + [0.0]
        assert r["fallback"] is False


def test_adapters_of_every_round_load_with_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedopd.models import load_adapter, resolve_model_path

    folder, _ = runs["fedtops"]
    assert sorted(p.name for p in folder.glob("round-*")) == ["round-000", "round-001", "round-002"]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-student"))
    model = PeftModel.from_pretrained(base, str(folder / "round-002"))
    arrays = load_adapter(folder / "round-002")
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == len(arrays)
    first = load_adapter(folder / "round-000")
    assert any(not np.array_equal(first[n], arrays[n]) for n in arrays)  # training moved the adapter


def test_saved_global_adapters_are_theta_plus_the_applied_multiplier_times_the_fedavg_increment(runs):
    """Round 1 starts every run from the same θ_0 with the same seeds, so the clients' updates and
    Δ_1 = (FedAvg's round-001) − θ_0 are the same in all three runs; the saved adapters must be
    θ_0 + aΔ_1 with a = 3 (fixed) and a = the recorded a_1 (FedTOPS)."""
    from fedopd.models import load_adapter

    theta0 = load_adapter(runs["fedavg"][0] / "round-000")
    fedavg1 = load_adapter(runs["fedavg"][0] / "round-001")
    delta = {n: fedavg1[n] - theta0[n] for n in theta0}
    assert max(np.abs(d).max() for d in delta.values()) > 1e-4
    a_fedtops = runs["fedtops"][1][0]["multiplier"]
    assert a_fedtops not in (0.0, 1.0)  # otherwise this test could not tell "applied" from "ignored"
    for name, a in (("fixed", 3.0), ("fedtops", a_fedtops)):
        assert all(np.array_equal(theta0[n], a0) for n, a0 in load_adapter(runs[name][0] / "round-000").items())
        saved = load_adapter(runs[name][0] / "round-001")
        for n in theta0:
            np.testing.assert_allclose(saved[n], theta0[n] + a * delta[n], rtol=1e-4, atol=1e-6, err_msg=f"{name}: {n}")


def test_each_round_records_the_bytes_of_each_phase_per_client(runs):
    """Through Flower's own Grid: replies are matched to their nodes, the adapter travels both ways."""
    for name, (_, rounds) in runs.items():
        for r in rounds:
            communication = r["communication"]
            assert set(communication) == {"train", "sent", "received"} | ({"score"} if name == "fedtops" else set())
            nodes = sorted(c["node-id"] for c in r["clients"])
            for phase in set(communication) - {"sent", "received"}:
                assert [e["node-id"] for e in communication[phase]] == nodes
                assert all(e["sent"] > 10_000 and e["received"] > 0 for e in communication[phase])
            assert all(e["received"] > 10_000 for e in communication["train"])  # θ_{t,i}^+ back


def _documented_fields() -> set[str]:
    """The names in backticks in docs/run-folder.md's rounds.jsonl row and sections."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "run-folder.md").read_text()
    fenced = re.findall(r"```\w*\n(.*?)```", page, flags=re.S)  # examples: their quoted JSON keys count
    prose = re.sub(r"```\w*\n.*?```", "", page, flags=re.S)
    return set(re.findall(r"`([^`]+)`", prose)) | {k for block in fenced for k in re.findall(r'"([\w@-]+)":', block)}


def test_every_field_a_real_round_record_has_is_documented_in_run_folder_md(runs):
    documented = _documented_fields()
    seen = set()
    for _, rounds in runs.values():
        for r in rounds:
            seen |= set(r)
            for c in r.get("clients", []):
                seen |= set(c)
            for phase in ("train", "score", "evaluate"):
                for entry in (r.get("communication") or {}).get(phase, []):
                    seen |= set(entry)
            seen |= set(r.get("communication") or {})
    import json
    from pathlib import Path

    [saved, *_] = sorted((Path(__file__).resolve().parent / "golden" / "sandbox").glob("*.json"))  # any platform: the same fields
    golden = json.loads(saved.read_text())["records"]
    for r in golden:  # the default run: held-out evaluation in rounds 0, 4, 8
        seen |= set(r.get("evaluation") or {})
        for c in (r.get("evaluation") or {}).get("clients", []):
            seen |= set(c)
    undocumented = sorted(k for k in seen if k not in documented and not re.fullmatch(r"(avg|pass)@\d+", k))
    assert undocumented == [], f"rounds.jsonl fields missing from docs/run-folder.md: {undocumented}"
