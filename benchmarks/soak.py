"""Soak: a long ``flwr run .`` keeps memory flat and leaves nothing behind.

    python benchmarks/soak.py                  # the sandbox preset, 30 rounds, 3 simulated clients
    python benchmarks/soak.py --rounds 10 --nodes 2

Runs the app through Flower's simulation runtime in a private ``$FLWR_HOME`` and prints, per
round, the resident memory of the ServerApp process (``server-rss-mb`` in the round record) and of
each process holding client models (``worker-rss-mb`` in the clients' train metrics), then the
growth of each over the run's second half (least-squares slope, MiB per round). Afterwards it stops
the local SuperLink that ``flwr run`` leaves running by design, and lists what is left: processes
whose command line names the private Flower home or the run's Ray session, and new entries in the
temp folder. Asserts nothing; figures are for the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slope(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), np.asarray(values), 1)[0])


def processes_naming(text: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)

    tmp_root = Path(tempfile.gettempdir())
    before = set(os.listdir(tmp_root))
    with tempfile.TemporaryDirectory(prefix="fedtops-soak-") as work:
        work = Path(work)
        home = work / "flwr-home"
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            # A local SuperLink of our own: on its default port flwr run would join one already running.
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        }
        overrides = f'num-server-rounds={args.rounds} eval.every=0 output-dir="{work / "runs"}"'
        cmd = ["flwr", "run", ".", "--stream", "--federation-config", f"num-supernodes={args.nodes}"]
        cmd += ["--run-config", overrides]
        started = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        found = re.findall(r"FedTOPS run finished: (\S+)", done.stdout + done.stderr)
        subprocess.run(["pkill", "-f", str(home)], check=False)  # the local SuperLink flwr run started
        time.sleep(3)
        if not found:
            print((done.stdout + done.stderr)[-3000:])
            print("the run did not finish")
            return 1
        rounds = [json.loads(line) for line in (Path(found[-1]) / "rounds.jsonl").read_text().splitlines()]
        rounds = [r for r in rounds if r["round"] > 0]
        server = [r["server-rss-mb"] for r in rounds]
        workers: dict[int, list[float]] = {}
        for r in rounds:
            for c in r["clients"]:
                workers.setdefault(int(c["worker-pid"]), []).append(c["worker-rss-mb"])
        print(f"{len(rounds)} rounds in {wall:.0f} s; RSS in MiB per round (server | model-holding processes by pid)")
        for i, r in enumerate(rounds):
            per_worker = " ".join(f"{pid}:{c['worker-rss-mb']:.0f}" for pid, c in ((int(c["worker-pid"]), c) for c in r["clients"]))
            print(f"round {r['round']:3d}  server {r['server-rss-mb']:7.1f} | {per_worker}")
        half = len(rounds) // 2
        print(
            f"\nserver: {server[0]:.1f} -> {server[-1]:.1f} MiB, slope over rounds {rounds[half]['round']}..{rounds[-1]['round']}: "
            f"{slope(server[half:]):+.2f} MiB/round"
        )
        for pid, values in workers.items():
            print(
                f"worker {pid}: {values[0]:.1f} -> {values[-1]:.1f} MiB, slope over its second half: {slope(values[len(values) // 2 :]):+.2f} MiB/round"
            )
        print(f"\nprocesses left naming the run's Flower home: {len(processes_naming(str(home)))}")
        alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
        print(f"model-holding processes still alive: {alive or 'none'}")
    left = sorted(set(os.listdir(tmp_root)) - before)
    print(f"new entries in {tmp_root}: {left or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
