"""The whole app on vLLM: ``flwr run .`` of the sandbox preset with ``rollout.backend = 'vllm'``
(its CPU build in CI's second environment, scripts/install.sh cpu-vllm), three clients, two rounds,
a held-out evaluation. Skipped where vLLM cannot run."""

import json

import pytest
import torch
from test_flwr_run import flwr_runner

from fedopd.models import resolve_dtype
from fedopd.rollout.vllm_engine import torch_dtype_name, vllm_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_platform() is None, reason="vLLM is not importable here (scripts/install.sh cpu-vllm installs its CPU build)"),
]


@pytest.fixture(scope="module")
def flwr(tmp_path_factory):
    """flwr run as a user runs it on this host: without the suite's FEDTOPS_DEVICE=cpu, so on a GPU
    host the models run on CUDA in bf16 and vLLM with them, one ClientApp actor holding the GPU
    (client-resources-num-gpus=1.0, as in docs/reproducing-the-paper.md; Ray hides the GPU from an
    actor that asks for none)."""
    federation = "num-supernodes=3" + (" client-resources-num-gpus=1.0" if torch.cuda.is_available() else "")
    with flwr_runner(tmp_path_factory, federation, unset=("FEDTOPS_DEVICE",)) as run:
        yield run


def test_flwr_run_of_the_sandbox_preset_on_vllm_completes_with_a_held_out_evaluation(flwr, tmp_path):
    memory = "0.1" if vllm_platform() == "cpu" else "0.3"  # the CPU build: a share of the host's memory
    done = flwr(
        f"output-dir='{tmp_path}' num-server-rounds=2 rollout.backend='vllm' rollout.gpu-memory-utilization={memory} "
        "eval.every=2 eval.prompts-per-client=8 eval.samples=2"
    )
    log = done.stdout + done.stderr
    folders = [p.parent for p in tmp_path.glob("*/config.json")]
    assert len(folders) == 1 and done.returncode == 0, log[-4000:]
    config = json.loads((folders[0] / "config.json").read_text())
    # model.dtype auto as this host resolves it: bf16 with a CUDA device, fp32 on vLLM's CPU build
    host = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert config["resolved"]["rollout.backend"] == "vllm" and config["resolved"]["model.dtype"] == torch_dtype_name(resolve_dtype("auto", host))
    assert json.loads((folders[0] / "status.json").read_text())["status"] == "completed"
    rounds = [json.loads(line) for line in (folders[0] / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(len(r["clients"]) == 3 and len(r["change_scores"]) == 3 for r in rounds[1:])
    for r in (rounds[0], rounds[2]):
        assert sorted(c["partition-id"] for c in r["evaluation"]["clients"]) == [0, 1, 2]
    assert rounds[0]["evaluation"]["accuracy"] > 0  # the trained sandbox student solves some problems
    assert "round 2/2 [fedtops] a = " in log
