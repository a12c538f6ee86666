"""The held-out oracle of FedTOPS's selection: which multiplier would held-out accuracy have chosen?

    python -m eval.oracle RUN_FOLDER [RUN_FOLDER ...] --out DIR

For every scored round t of a FedTOPS run, Δ_t is recovered from the saved adapters,
Δ_t = (θ_{t+1} − θ_t) / a_t (a held round, a_t = 0, cannot be recovered: it is counted and
skipped), and every candidate θ_t + aΔ_t is graded greedily on the run's held-out problems of
every client (``eval.prompts-per-client`` each). The oracle's a is the most accurate candidate
(ties: the smaller a), over all candidates and over the feasible ones (every scored client's
K̂ ≤ δ). Each run's grades go to ``oracle.json`` in its folder (reused when there); ``DIR`` gets
``oracle.json`` (all rounds) and ``oracle.md`` (per learning rate: how often Ĵ chose more, the
same, or less than the oracle, the mean log2(a_Ĵ / a_oracle) with a sign test, and the accuracy
lost against the oracle). Diagnostic only: the oracle reads the test problems
(docs/sandbox.md, "Why FedTOPS trails FedAvg at the large learning rate").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ORACLE = "oracle.json"


def recover_increment(theta: Mapping[str, np.ndarray], theta_next: Mapping[str, np.ndarray], multiplier: float) -> dict[str, np.ndarray]:
    """Δ_t from θ_t and θ_{t+1} = θ_t + aΔ_t (a ≠ 0), in float64."""
    if multiplier == 0:
        raise ValueError("a held round (a = 0) does not determine Δ_t")
    return {k: (np.asarray(theta_next[k], np.float64) - np.asarray(theta[k], np.float64)) / multiplier for k in theta}


def oracle_choice(candidates: Sequence[float], accuracy: Sequence[float], allowed: Sequence[bool] | None = None) -> float | None:
    """The candidate with the highest accuracy among the ``allowed`` ones (default: all); ties go
    to the smaller a. None when none is allowed."""
    best = None
    for a, acc, ok in zip(candidates, accuracy, allowed if allowed is not None else [True] * len(candidates)):
        if ok and (best is None or acc > best[1] or (acc == best[1] and a < best[0])):
            best = (a, acc)
    return None if best is None else best[0]


def sign_test(more: int, less: int) -> float:
    """Two-sided exact binomial p-value of ``more`` against ``less`` (ties left out), p = 1/2."""
    n = more + less
    if n == 0:
        return 1.0
    k = min(more, less)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def allowed_candidates(change_scores: Sequence[Sequence[float | None]], trust_budget: float, num_candidates: int) -> list[bool]:
    """Which candidates the round's K̂ rows allow (every scored client's K̂ <= δ); a score the record
    holds as null (non-finite when the client computed it) makes that candidate infeasible."""
    from fedtops_strategy.selection import feasible_indices

    rows = [[math.inf if v is None else float(v) for v in row] for row in change_scores]
    feasible = set(feasible_indices(rows, trust_budget, num_candidates))
    return [j in feasible for j in range(num_candidates)]


def summarize(rounds: Sequence[Mapping[str, Any]], key: str = "oracle") -> dict[str, Any]:
    """How Ĵ's choices compare with ``key`` (``oracle`` or ``oracle_feasible``) over the scored
    ``rounds``: counts of a_Ĵ above, equal to and below the oracle's a, the mean log2(a_Ĵ / a_oracle),
    the sign test, and the mean accuracy (pp) of the oracle's candidate minus that of Ĵ's."""
    more = same = less = 0
    logs, lost = [], []
    for r in rounds:
        a, o = r["selected"], r.get(key)
        if o is None or a <= 0:
            continue
        more, same, less = more + (a > o), same + (a == o), less + (a < o)
        if o > 0:
            logs.append(math.log2(a / o))
        acc = r["accuracy"]
        # A capped or fallback a (1.0) need not be a candidate: grade_run grades it apart.
        chosen = r["selected_accuracy"] if "selected_accuracy" in r else acc[r["candidates"].index(a)]
        lost.append(100 * (acc[r["candidates"].index(o)] - chosen))
    return {
        "rounds": more + same + less,
        "more": more,
        "same": same,
        "less": less,
        "mean_log2_ratio": float(np.mean(logs)) if logs else None,
        "sign_test_p": sign_test(more, less),
        "mean_accuracy_lost_pp": float(np.mean(lost)) if lost else None,
    }


def grade_run(run: Path, num_partitions: int | None = None) -> dict[str, Any]:
    """Every candidate of every scored round of ``run``, graded (cached in ``run/oracle.json``) on
    the held-out problems of ``num_partitions`` clients (default: the run's ``num-clients``)."""
    from client_app.worker import setup_heldout
    from fedopd.config import parse_run_config
    from fedopd.engine.heldout import greedy_correctness
    from fedopd.models.lora import apply_increment, load_adapter
    from server_app.run_folder import read_rounds, read_run_config

    cached = run / ORACLE
    if cached.is_file():
        return json.loads(cached.read_text())
    cfg = parse_run_config(read_run_config(run))
    num = int(num_partitions or cfg.num_clients)
    if num < 1:
        raise ValueError(f"{run}: the run's num-clients is 0 (every node connected): give the number of partitions with --num-partitions")
    setups = [setup_heldout(cfg, i, num) for i in range(num)]
    rounds = []
    for record in read_rounds(run):
        t = record["round"]
        if t == 0 or not record.get("change_scores"):
            continue
        a_t = float(record["multiplier"])
        entry: dict[str, Any] = {"round": t, "selected": a_t, "candidates": record["candidates"]}
        if a_t == 0:
            entry["held"] = True
            rounds.append(entry)
            continue
        theta = load_adapter(run / f"round-{t - 1:03d}")
        delta = recover_increment(theta, load_adapter(run / f"round-{t:03d}"), a_t)

        def accuracy_at(a: float) -> float:
            candidate = {k: v.astype(np.float32) for k, v in apply_increment(theta, delta, a).items()}
            grades = np.concatenate([greedy_correctness(models, candidate, prompts, cfg.eval.max_new_tokens)[0] for models, prompts in setups])
            return float(np.mean(grades))

        accuracy = [accuracy_at(a) for a in record["candidates"]]
        if a_t not in record["candidates"]:
            entry["selected_accuracy"] = accuracy_at(a_t)
        allowed = allowed_candidates(record["change_scores"], cfg.strategy.trust_budget, len(record["candidates"]))
        entry.update(
            accuracy=accuracy,
            feasible=allowed,
            oracle=oracle_choice(record["candidates"], accuracy),
            oracle_feasible=oracle_choice(record["candidates"], accuracy, allowed),
            lr=cfg.train.lr,
        )
        rounds.append(entry)
    out = {"run": str(run), "lr": cfg.train.lr, "seed": cfg.seed, "cache": [cfg.cache.rollouts, cfg.cache.positions], "rounds": rounds}
    cached.write_text(json.dumps(out, indent=2) + "\n")
    return out


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| lr | cache | oracle over | rounds | Ĵ chose more | same | less | mean log2(a_Ĵ / a_oracle) | sign test p | accuracy lost (pp) | held |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[float, tuple[int, int]], list] = {}
    for r in runs:
        groups.setdefault((r["lr"], tuple(r["cache"])), []).append(r)
    for (lr, cache), rs in sorted(groups.items()):
        scored = [x for r in rs for x in r["rounds"] if not x.get("held")]
        held = sum(1 for r in rs for x in r["rounds"] if x.get("held"))
        for key, title in (("oracle", "all"), ("oracle_feasible", "feasible")):
            s = summarize(scored, key)
            mean_log = "–" if s["mean_log2_ratio"] is None else f"{s['mean_log2_ratio']:+.2f}"
            lost = "–" if s["mean_accuracy_lost_pp"] is None else f"{s['mean_accuracy_lost_pp']:.1f}"
            lines.append(
                f"| {lr:g} | {cache[0]} × {cache[1]} | {title} | {s['rounds']} | {s['more']} | {s['same']} | {s['less']} | {mean_log} | {s['sign_test_p']:.3g} | {lost} | {held} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.oracle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="FedTOPS run folders")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-partitions", type=int, default=None, help="clients whose held-out problems grade (default: the run's num-clients)")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "rounds.jsonl").is_file()]
    if missing:
        print(f"error: not run folders (no rounds.jsonl): {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.num_partitions is not None and args.num_partitions < 1:
        print(f"error: --num-partitions = {args.num_partitions}: allowed: an integer >= 1", file=sys.stderr)
        return 2
    try:
        runs = [grade_run(r, args.num_partitions) for r in args.runs]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ORACLE).write_text(json.dumps(runs, indent=2) + "\n")
    text = table(runs)
    (args.out / "oracle.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
