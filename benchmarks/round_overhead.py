"""Benchmark: what FedTOPS costs on top of FedAvg, per round and per phase, measured in one run.

    python benchmarks/round_overhead.py                      # sandbox preset, 3 repeats x 4 rounds
    python benchmarks/round_overhead.py --repeats 5 --rounds 6 --run-config "rollout.per-round=16"

Runs the sandbox preset (held-out evaluation off) with ``strategy.name = 'fedavg'`` and
``'fedtops'`` alternately (A B B A ...), each run through the app's own ServerApp, strategies and
ClientApp delivered in this process (``server_app.inprocess``: the clients run one after another,
as a simulation with one worker does), with the base models loaded once for the whole benchmark.
Round 1 of every run is left out (it warms up caches). Prints, per method, the mean per round of
each phase summed over the clients (rollouts, grading, teacher pass, scoring cache, local OPD),
the server's score query, and the round time; then the FedTOPS/FedAvg round-time ratio and
FedTOPS's own cost (scoring cache + score query) as a share of its round. Last, the peak memory of
the chunked reverse-KL loss against the unchunked one at 1,024-4,096 positions and Qwen's
151,936-token vocabulary (``benchmarks/client_round.py --part loss``; minutes on a CPU).

The two methods' rollouts differ after round 1 (their adapters differ), so their rollout and
training phases differ by chance; the share of the FedTOPS-only phases is the sharper figure.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("rollout_s", "grade_s", "teacher_s", "cache_s", "opd_s")


def run_once(strategy: str, rounds: int, overrides: dict, out: Path, tag: str) -> list[dict]:
    from server_app.inprocess import run_in_process

    config = {**overrides, "strategy.name": strategy, "num-server-rounds": rounds, "eval.every": 0, "output-dir": str(out / tag)}
    folder = run_in_process(config)
    return [json.loads(line) for line in (Path(folder) / "rounds.jsonl").read_text().splitlines() if line.strip()]


def per_round(records: list[dict]) -> list[dict[str, float]]:
    """Phase seconds per round (summed over clients), rounds 2.. only."""
    rows = []
    for rec in records:
        if rec["round"] < 2:
            continue
        row = {p: sum(c.get(p, 0.0) for c in rec["clients"]) for p in PHASES}
        row["score_s"] = rec.get("score_seconds", 0.0)
        row["round_s"] = rec["seconds"]
        rows.append(row)
    return rows


def parse_overrides(text: str) -> dict:
    import tomllib

    out = {}
    for item in text.split():
        key, _, value = item.partition("=")
        out[key] = tomllib.loads(f"v = {value}")["v"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--run-config", default="", help='overrides as for flwr run, e.g. "rollout.per-round=16"')
    p.add_argument("--no-loss", action="store_true", help="skip the loss's peak memory at 1,024-4,096 positions, V = 151,936")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is left out)")
    overrides = parse_overrides(args.run_config)

    from fedopd.config import parse_run_config
    from fedopd.config.presets import app_defaults

    parse_run_config({**app_defaults(), **overrides})  # a bad override fails before any run
    rows: dict[str, list[dict]] = {"fedavg": [], "fedtops": []}
    round_means: dict[str, list[float]] = {"fedavg": [], "fedtops": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedtops-overhead-") as tmp:
        for rep in range(args.repeats):
            order = ("fedavg", "fedtops") if rep % 2 == 0 else ("fedtops", "fedavg")
            for strategy in order:
                got = per_round(run_once(strategy, args.rounds, overrides, Path(tmp), f"{strategy}-{rep}"))
                rows[strategy].extend(got)
                round_means[strategy].append(statistics.mean(r["round_s"] for r in got))
                print(f"  repeat {rep + 1}/{args.repeats} {strategy:<7s} mean round {round_means[strategy][-1]:.3f} s", flush=True)

    def mean(strategy: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows[strategy])

    print(
        f"\n== FedAvg vs FedTOPS, sandbox preset{' + ' + args.run_config if args.run_config else ''}, "
        f"{args.repeats} repeats x rounds 2-{args.rounds}, seconds per round (clients summed) =="
    )
    print(f"  {'phase':<28s} {'FedAvg':>9s} {'FedTOPS':>9s}")
    names = {
        "rollout_s": "rollouts",
        "grade_s": "grading",
        "teacher_s": "teacher pass",
        "cache_s": "scoring cache (FedTOPS)",
        "opd_s": "local OPD",
        "score_s": "score query (FedTOPS)",
        "round_s": "round",
    }
    for key, name in names.items():
        print(f"  {name:<28s} {mean('fedavg', key):9.3f} {mean('fedtops', key):9.3f}")
    ratios = [t / a for t, a in zip(round_means["fedtops"], round_means["fedavg"])]
    ratio = mean("fedtops", "round_s") / mean("fedavg", "round_s")
    spread = f" (per repeat {min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else ""
    own = (mean("fedtops", "cache_s") + mean("fedtops", "score_s")) / mean("fedtops", "round_s")
    print(f"  FedTOPS / FedAvg round time: {ratio:.3f}{spread}")
    print(f"  FedTOPS's own phases (scoring cache + score query): {100 * own:.1f} % of its round")
    print(f"  ({time.perf_counter() - t0:.0f} s in all)")
    if not args.no_loss:
        from benchmarks.client_round import bench_loss

        bench_loss(argparse.Namespace(positions=[1024, 2048, 4096], vocab=151936, hidden=1024, chunk=1024, liger=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
