"""Benchmark: round time in Flower's simulation versus a local deployment with resident workers.

    python benchmarks/deployment_overhead.py                       # tiny preset, 2 clients, 4 rounds, 2 repeats
    python benchmarks/deployment_overhead.py --nodes 3 --rounds 5 --repeats 3 --preset sandbox

Runs the same run config (the tiny preset by default) ``--repeats`` times each way, alternating:
``flwr run .`` on Flower's simulation runtime (``num-supernodes = --nodes``) and
``scripts/local-deployment.sh --nodes N`` (SuperLink, SuperNodes, TLS, authentication, one
resident Ray worker per SuperNode). Round time is the round record's ``seconds`` (train, score
query and aggregation, as the ServerApp sees them) for every round after the first, whose time is
dominated by model loading in either mode. Prints the mean round time of each mode, their ratio,
and the mean time the clients spent in their own work (``total_s``), so that what the runtime
adds per round is visible. Asserts nothing; timings are for the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

PRESETS = {
    "tiny": REPO / "configs" / "tiny.toml",
    "sandbox": None,  # the app's defaults
}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _overrides(preset: str, rounds: int, out: Path) -> str:
    from fedopd.config.presets import app_defaults, load_preset

    values = {**app_defaults(), **(load_preset(PRESETS[preset]) if PRESETS[preset] else {})}
    values.update({"num-server-rounds": rounds, "eval.every": 0, "output-dir": str(out)})
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def _round_times(output: str) -> tuple[list[float], list[float]]:
    """(round seconds, mean client total_s) of rounds >= 2 of the run named in ``output``."""
    found = re.findall(r"FedTOPS run finished: (\S+)", output)
    if not found:
        raise RuntimeError("the run did not finish:\n" + output[-3000:])
    rounds = [json.loads(line) for line in (Path(found[-1]) / "rounds.jsonl").read_text().splitlines()]
    later = [r for r in rounds if r["round"] >= 2]
    return [r["seconds"] for r in later], [statistics.mean(c["total_s"] for c in r["clients"]) for r in later]


def simulation(run_config: str, nodes: int, home: Path) -> tuple[list[float], list[float]]:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # A local SuperLink of our own: on its default port flwr run would join one already running.
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
    }
    cmd = ["flwr", "run", ".", "--stream", "--federation-config", f"num-supernodes={nodes}", "--run-config", run_config]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    return _round_times(done.stdout + done.stderr)


def deployment(run_config: str, nodes: int, work: Path) -> tuple[list[float], list[float]]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = ["bash", str(REPO / "scripts" / "local-deployment.sh"), "--nodes", str(nodes), "--workdir", str(work), "--", "--run-config", run_config]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    return _round_times(done.stdout + done.stderr)


def _stop_simulation_superlink(home: Path) -> None:
    subprocess.run(["pkill", "-f", str(home)], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is left out)")

    times: dict[str, list[float]] = {"simulation": [], "deployment": []}
    work: dict[str, list[float]] = {"simulation": [], "deployment": []}
    with tempfile.TemporaryDirectory(prefix="fedtops-bench-") as tmp:
        tmp = Path(tmp)
        home = tmp / "flwr-home"
        try:
            for rep in range(args.repeats):
                for mode in ("simulation", "deployment"):  # alternated, so drift hits both
                    out = tmp / f"{mode}-{rep}"
                    rc = _overrides(args.preset, args.rounds, out / "runs")
                    seconds, client = simulation(rc, args.nodes, home) if mode == "simulation" else deployment(rc, args.nodes, out / "work")
                    times[mode] += seconds
                    work[mode] += client
                    print(f"repeat {rep} {mode:10s}: rounds 2..{args.rounds} " + " ".join(f"{s:.2f}" for s in seconds) + " s", flush=True)
        finally:
            _stop_simulation_superlink(home)

    sim, dep = statistics.mean(times["simulation"]), statistics.mean(times["deployment"])
    print(f"\npreset {args.preset}, {args.nodes} clients, rounds 2..{args.rounds}, {args.repeats} repeats each")
    for mode, mean in (("simulation", sim), ("deployment", dep)):
        print(
            f"{mode:10s}: round {mean:6.2f} s (sd {statistics.stdev(times[mode]) if len(times[mode]) > 1 else 0:.2f}), "
            f"client work {statistics.mean(work[mode]):.2f} s per client"
        )
    print(f"ratio deployment / simulation: {dep / sim:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
