"""How to run several variants on one machine: one after another or at once, in process or through
the local SuperLink. Prints the wall time of each way and its ratio to the first.

    python benchmarks/variants.py [--reps 2] [--rounds 4] [--out /tmp/variants-bench]

The same three variants (FedAvg, fixed a = 3, FedTOPS; seed 0; the sandbox preset with
``--rounds`` rounds, evaluated at the last) are run, fresh every time (no reuse), by

- ``in-process, 1 job``: ``python -m eval.variants --jobs 1``;
- ``in-process, 2 jobs``: ``python -m eval.variants --jobs 2`` (two single-threaded runs at once);
- ``flwr run, one after another``: ``python -m server_app.run_status run .`` per variant on the
  local SuperLink (started, untimed, before the first repetition), each waiting for the last.

The ways alternate in order between repetitions (A B C, then C B A), so drift in the machine's
speed falls on all of them. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "fedavg": "strategy.name='fedavg'",
    "fixed3": "strategy.name='fixed' strategy.multiplier=3.0",
    "fedtops": "strategy.name='fedtops'",
}
ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}


def in_process(out: Path, rounds: int, jobs: int) -> None:
    args = [sys.executable, "-m", "eval.variants", "-c", f"num-server-rounds={rounds} eval.every={rounds}", "--jobs", str(jobs), "--out", str(out)]
    for name, keys in VARIANTS.items():
        args += ["--variant", f"{name}: {keys}"]
    subprocess.run(args, cwd=ROOT, env=_env(), check=True, capture_output=True)


def through_superlink(out: Path, rounds: int) -> None:
    for keys in VARIANTS.values():
        rc = f"num-server-rounds={rounds} eval.every={rounds} output-dir='{out}' {keys}"
        cmd = [sys.executable, "-m", "server_app.run_status", "run", ".", "--federation-config", "num-supernodes=3", "--run-config", rc]
        subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("/tmp/variants-bench"))
    args = p.parse_args(argv)
    ways = {
        "in-process, 1 job": lambda out: in_process(out, args.rounds, 1),
        "in-process, 2 jobs": lambda out: in_process(out, args.rounds, 2),
        "flwr run, one after another": lambda out: through_superlink(out, args.rounds),
    }
    through_superlink(args.out / "warm-up", 1)  # the local SuperLink is up before anything is timed
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.reps):
        order = list(ways) if rep % 2 == 0 else list(reversed(ways))
        for name in order:
            out = args.out / f"rep{rep}" / name.replace(" ", "-").replace(",", "")
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            ways[name](out)
            seconds[name].append(time.perf_counter() - t0)
            print(f"rep {rep}: {name}: {seconds[name][-1]:.0f} s", flush=True)
    first = list(ways)[0]
    base = sum(seconds[first]) / len(seconds[first])
    print(f"\n{len(VARIANTS)} variants × 1 seed, {args.rounds} rounds each, {args.reps} repetitions (mean wall time, ratio to '{first}'):")
    for name, values in seconds.items():
        mean = sum(values) / len(values)
        print(f"  {name:30s} {mean:6.0f} s  ({', '.join(f'{v:.0f}' for v in values)})  × {mean / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
