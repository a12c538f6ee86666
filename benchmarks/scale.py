"""Scale on one machine: 3, 10 and 30 sandbox clients through ``flwr run``.

    python benchmarks/scale.py                          # 3, 10 (all train) and 30 (fraction 0.2)
    python benchmarks/scale.py --cases 3:1.0 30:0.2 --rounds 3 --prompts-per-client 48

Each case is one ``flwr run .`` of the sandbox preset in Flower's simulation runtime (a private
``$FLWR_HOME``, a local SuperLink of its own) with ``num-supernodes`` clients, the given
``strategy.fraction-train``, ``--rounds`` rounds and no held-out evaluation. The sandbox's
multiplication group holds about 576 training problems (8 × 90 operand pairs, one in five held
out); with the ``groups`` partitioner a third of the clients share it, so the default
``--prompts-per-client 48`` fits 30 clients (10 × 48 = 480).

Printed per case, from the run's ``rounds.jsonl``: seconds per round (the first round includes
model loading), the clients trained per round, the ServerApp's resident memory
(``server-rss-mb``), and for each process that held client models (``worker-pid``) its resident
memory (``worker-rss-mb``) and how often it loaded the models (``worker-model-loads``). A
simulation keeps one student and one teacher per worker process however many clients there are;
what grows with the clients is their ``context.state`` (θ_t, the scoring cache, the optimizer
moments), which the worker's memory shows. Asserts nothing; figures are for the machine it runs on.
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

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEFAULT_CASES = ("3:1.0", "10:1.0", "30:0.2")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(clients: int, fraction: float, rounds: int, prompts_per_client: int, work: Path) -> tuple[float, list[dict], str]:
    """(wall seconds, the round records, the log tail) of one flwr run."""
    home = work / f"flwr-home-{clients}"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
    }
    overrides = (
        f"num-server-rounds={rounds} eval.every=0 data.prompts-per-client={prompts_per_client} "
        f'strategy.fraction-train={fraction} output-dir="{work / f"runs-{clients}"}"'
    )
    cmd = ["flwr", "run", ".", "--stream", "--federation-config", f"num-supernodes={clients}", "--run-config", overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    subprocess.run(["pkill", "-f", str(home)], check=False)  # the local SuperLink flwr run started
    time.sleep(3)
    log = done.stdout + done.stderr
    found = re.findall(r"FedTOPS run finished: (\S+)", log)
    if not found:
        return wall, [], log[-3000:]
    records = [json.loads(line) for line in (Path(found[-1]) / "rounds.jsonl").read_text().splitlines()]
    return wall, [r for r in records if r["round"] > 0], ""


def report(clients: int, fraction: float, wall: float, rounds: list[dict]) -> list[str]:
    lines = [f"\n{clients} clients, fraction-train {fraction:g}: {len(rounds)} rounds in {wall:.0f} s (flwr run, start to end)"]
    workers: dict[int, dict] = {}
    for r in rounds:
        trained = len(r.get("trained-node-ids") or r["clients"])
        lines.append(f"  round {r['round']}: {r['seconds']:6.1f} s, {trained:2d} trained, ServerApp {r['server-rss-mb']:6.0f} MiB")
        for c in r["clients"]:
            workers[int(c["worker-pid"])] = c
    for pid, c in sorted(workers.items()):
        lines.append(
            f"  model-holding process {pid}: {c['worker-rss-mb']:.0f} MiB after its last round, models loaded {int(c['worker-model-loads'])} time(s)"
        )
    steady = [r["seconds"] for r in rounds[1:]] or [rounds[0]["seconds"]]
    lines.append(f"  mean round after the first: {sum(steady) / len(steady):.1f} s; {len(workers)} model-holding process(es) for {clients} clients")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="clients:fraction-train")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-client", type=int, default=48)
    args = parser.parse_args(argv)
    cases = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in args.cases]
    print(f"{os.cpu_count()} CPU cores; sandbox preset, {args.rounds} rounds, data.prompts-per-client={args.prompts_per_client}")
    status = 0
    with tempfile.TemporaryDirectory(prefix="fedtops-scale-") as work:
        for clients, fraction in cases:
            wall, rounds, tail = run_case(clients, fraction, args.rounds, args.prompts_per_client, Path(work))
            if not rounds:
                print(f"\n{clients} clients: the run did not finish\n{tail}")
                status = 1
                continue
            print("\n".join(report(clients, fraction, wall, rounds)), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
