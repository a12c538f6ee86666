"""The whole app on vLLM: ``flwr run .`` of the sandbox preset with ``rollout.backend = 'vllm'``
(its CPU build in CI's second environment, scripts/install_vllm.sh), three clients, two rounds,
a held-out evaluation. Skipped where vLLM cannot run."""

import json

import pytest
from test_flwr_run import flwr  # noqa: F401 - the fixture: flwr run in an isolated Flower home

from fedopd.rollout.vllm_engine import vllm_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_platform() is None, reason="vLLM is not importable here (scripts/install_vllm.sh cpu installs its CPU build)"),
]


def test_flwr_run_of_the_sandbox_preset_on_vllm_completes_with_a_held_out_evaluation(flwr, tmp_path):  # noqa: F811
    memory = "0.1" if vllm_platform() == "cpu" else "0.3"  # the CPU build: a share of the host's memory
    done = flwr(
        f"output-dir='{tmp_path}' num-server-rounds=2 rollout.backend='vllm' rollout.gpu-memory-utilization={memory} "
        "eval.every=2 eval.prompts-per-client=8 eval.samples=2"
    )
    log = done.stdout + done.stderr
    folders = [p.parent for p in tmp_path.glob("*/config.json")]
    assert len(folders) == 1 and done.returncode == 0, log[-4000:]
    config = json.loads((folders[0] / "config.json").read_text())
    assert config["resolved"]["rollout.backend"] == "vllm" and config["resolved"]["model.dtype"] == "float32"
    assert json.loads((folders[0] / "status.json").read_text())["status"] == "completed"
    rounds = [json.loads(line) for line in (folders[0] / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(len(r["clients"]) == 3 and len(r["change_scores"]) == 3 for r in rounds[1:])
    for r in (rounds[0], rounds[2]):
        assert sorted(c["partition-id"] for c in r["evaluation"]["clients"]) == [0, 1, 2]
    assert rounds[0]["evaluation"]["accuracy"] > 0  # the trained sandbox student solves some problems
    assert "round 2/2 [fedtops] a = " in log
