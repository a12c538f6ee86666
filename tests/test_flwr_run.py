"""``flwr run .`` as a user runs it: a local SuperLink in an isolated Flower home, 3 SuperNodes.

``flwr run --stream`` exits 0 even when the run fails; the runs here go through
``python -m server_app.run_status run``, whose exit status says whether the run completed.
The local SuperLink that ``flwr run`` starts in the background is stopped afterwards.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# What Ray raises when its raylet does not register in time (a loaded host, not this app).
RAY_START_TIMEOUT = "The current node timed out during startup"


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_local_superlink(flwr_home: Path, port: int) -> None:
    out = subprocess.run(["pgrep", "-f", str(flwr_home)], capture_output=True, text=True, check=False).stdout
    for pid in (int(p) for p in out.split()):
        try:
            os.killpg(os.getpgid(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    while _port_in_use(port) and time.monotonic() < deadline:
        time.sleep(0.5)


@contextlib.contextmanager
def flwr_runner(tmp_path_factory, federation: str = "num-supernodes=3", unset: tuple[str, ...] = ()):
    """``run(*run_config)``: flwr run of this app in an isolated Flower home with ``federation`` as
    its federation config, in this environment less the variables ``unset``."""
    if shutil.which("flwr") is None and not (Path(sys.executable).parent / "flwr").exists():
        pytest.skip("the flwr command is not installed")
    # flwr run starts a local SuperLink on FLWR_LOCAL_SUPERLINK_HTTP_API_PORT (Flower 1.41: one
    # HTTP port for all its APIs), or joins the one already answering there. A free port of its
    # own keeps this test off any SuperLink that is already running (a user's, another test's).
    # The SuperLink it starts, and the runs' processes under it, inherit this environment, with
    # FEDTOPS_DEVICE=cpu (tests/conftest.py) unless it is unset here.
    port = _free_port()
    home = tmp_path_factory.mktemp("flwr-home")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env |= {"FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}

    def run(*run_config: str) -> subprocess.CompletedProcess:
        # Through the project's checked runner: flwr run's output, and an exit status that says
        # whether the run completed (flwr run --stream itself exits 0 either way).
        cmd = [sys.executable, "-m", "server_app.run_status", "run", ".", "--federation-config", federation]
        for item in run_config:
            cmd += ["--run-config", item]
        outs = [Path(m) for item in run_config for m in re.findall(r"output-dir='([^']+)'", item)]
        before = {p for out in outs if out.is_dir() for p in out.iterdir()}

        def once() -> subprocess.CompletedProcess:
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)

        done = once()
        if done.returncode != 0 and RAY_START_TIMEOUT in done.stdout + done.stderr:
            # Ray gives its raylet a fixed 30 s to register (ray/_private/node.py); on CI's 2 cores,
            # beside a deployment test starting its own processes, it took longer (stop 44). That is
            # the host, not this app: run once more, without what the failed run wrote.
            for child in {p for out in outs if out.is_dir() for p in out.iterdir()} - before:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            print(f"flwr run: Ray's node did not start within its 30 s; running again\n{done.stdout[-2000:]}", file=sys.stderr)
            done = once()
        return done

    run.port = port
    try:
        yield run
    finally:
        _stop_local_superlink(home, port)


@pytest.fixture(scope="module")
def flwr(tmp_path_factory):
    with flwr_runner(tmp_path_factory) as run:
        yield run


def test_flwr_run_on_the_default_sandbox_preset_records_held_out_evaluation_from_round_zero(flwr, tmp_path):
    done = flwr(f"output-dir='{tmp_path}' num-server-rounds=2 rollout.per-round=8 eval.every=1 eval.prompts-per-client=8 eval.samples=2")
    log = done.stdout + done.stderr
    folders = [p.parent for p in tmp_path.glob("*/config.json")]  # (beside it: the clients' state)
    assert len(folders) == 1, log[-3000:]
    assert done.returncode == 0, log[-3000:]
    assert json.loads((folders[0] / "status.json").read_text())["status"] == "completed"
    # FEDTOPS_DEVICE=cpu (tests/conftest.py) reached the run's processes: fp32 and HF on any host
    resolved = json.loads((folders[0] / "config.json").read_text())["resolved"]
    assert resolved["model.dtype"] == "float32" and resolved["rollout.backend"] == "hf"
    assert (folders[0] / "progress.png").read_bytes()[:4] == b"\x89PNG"
    for pid in range(3):  # progress: each client's reply, as it arrives, with its phases
        assert f"client {pid} trained: " in log and f"client {pid} scored 6 candidates" in log
    assert "Run summary: 2 rounds of fedtops" in log
    assert "Loading weights" not in log  # no transformers loading bar from the server or the clients
    rounds = [json.loads(line) for line in (folders[0] / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]  # round 0: the initial adapter, evaluated
    assert all(len(r["change_scores"]) == 3 for r in rounds[1:])
    for r in rounds:
        ev = r["evaluation"]
        assert sorted(c["partition-id"] for c in ev["clients"]) == [0, 1, 2]
        assert all(c["num-examples"] == 8 for c in ev["clients"])
        assert ev["accuracy"] == pytest.approx(sum(c["accuracy"] for c in ev["clients"]) / 3)
    assert rounds[0]["evaluation"]["accuracy"] > 0  # the trained sandbox student solves some problems
    assert (folders[0] / "round-002" / "adapter_model.safetensors").is_file()
    assert "round 0/2 [fedtops] initial adapter | held-out greedy" in log
    assert "round 2/2 [fedtops] a = " in log
    assert f"127.0.0.1:{flwr.port}" in log  # its own local SuperLink, not one that was already running


def test_a_bad_run_config_value_stops_the_run_before_round_one(flwr, tmp_path):
    done = flwr(f"output-dir='{tmp_path / 'runs'}' strategy.candidates='1,two,3'")
    log = done.stdout + done.stderr
    assert "run config 'strategy.candidates' = '1,two,3' is invalid" in log
    assert not (tmp_path / "runs").exists()
    assert done.returncode == 1  # the checked runner tells a script; flwr run alone exits 0
    assert "failed before it created a run folder" in log
