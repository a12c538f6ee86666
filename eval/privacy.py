"""What differential privacy costs in the sandbox: FedAvg and FedTOPS at several noise levels.

    python -m eval.privacy --out docs/sandbox/privacy --runs sandbox-runs

Each cell is the sandbox preset (:mod:`eval.sandbox`'s grid cell: 10 rounds, 3 clients, the
final adapter graded on every client's held-out problems) with ``privacy.clipping = 'fixed'``
(server side) at clipping norm C and noise multiplier z, the same z on FedTOPS's score channel,
or without privacy (``none``), or with clipping and no noise (z = 0: the cost of clipping alone).
Every method gets the same rounds, rollouts and problems. Writes ``results.json`` (one row per
run: final scores, ε at δ_DP, FedTOPS's mean a and held rounds), ``intervals.json`` and
``table.md`` (paired bootstrap intervals by seed and by problem: FedTOPS − FedAvg at each level,
and each level − no privacy), and ``privacy.png`` (accuracy against ε).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from eval.sandbox import GRADES, finished_run, grid_setting, mean_sd, paired_grade_intervals, result_row, run_cells, run_config

# Fixed before the runs (2026-11-25, docs/privacy.md "What DP costs in the sandbox"): C from a
# non-private pilot (seed 42, median update norm 1.6 / 0.9 / 0.4 / 0.07 in rounds 1-4), the noise
# levels a decade apart, 3 seeds, the preset's learning rate, 64 held-out problems per client.
DEFAULT_CLIP = 1.0
DEFAULT_NOISE = ("none", "0", "0.01", "0.1", "1")
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_LR = 3e-3
METHODS = ("fedavg", "fedtops")


def level_label(level: str) -> str:
    return "no DP" if level == "none" else f"z = {float(level):g}"


def cell_config(method: str, level: str, seed: int, clip: float, lr: float, rounds: int, folder: Path, setting: dict[str, Any]) -> dict[str, Any]:
    """The sandbox grid cell of ``method`` with privacy at noise ``level`` ('none': off)."""
    privacy = {}
    if level != "none":
        privacy = {"privacy.clipping": "fixed", "privacy.clip-norm": clip, "privacy.noise-multiplier": float(level)}
        privacy["num-clients"] = int(setting.get("num-clients") or 3)  # the private mean's n needs the declared size
        if method == "fedtops":
            privacy["privacy.score-noise"] = float(level)
    return run_config(method, lr, seed, rounds, 0, folder, {**setting, **privacy})


def privacy_row(method: str, level: str, lr: float, seed: int, run: Path) -> dict[str, Any]:
    """:func:`eval.sandbox.result_row` plus ε, the mean a and the held rounds."""
    from server_app.run_folder import read_rounds

    row = result_row(method, lr, seed, run)
    trained = [r for r in read_rounds(run) if r["round"] > 0]
    last = trained[-1].get("privacy") or {}
    multipliers = [float(r["multiplier"]) for r in trained]
    row.update(
        level=level,
        epsilon=(last.get("epsilon") if "delta" in last else None),
        epsilon_infinite=("delta" in last and last.get("epsilon") is None),
        delta=last.get("delta"),
        mean_multiplier=float(np.mean(multipliers)),
        held_rounds=sum(1 for r in trained if r.get("clients") and r.get("hold-reason")),
        rounds=len(trained),
    )
    return row


def paired_intervals(rows: list[dict[str, Any]], draws: int) -> list[dict[str, Any]]:
    """Paired bootstrap intervals (by seed, by problem) of FedTOPS − FedAvg at each level and of
    each level − no privacy for each method, greedy accuracy and Avg@k."""
    grades = {}
    for r in rows:
        with np.load(Path(r["run"]) / GRADES) as z:
            grades[r["method"], r["level"], r["seed"]] = {"greedy": z["greedy"], "sampled": z["sampled"]}
    levels = list(dict.fromkeys(r["level"] for r in rows))
    pairs = [((("fedavg", lv), ("fedtops", lv))) for lv in levels]
    pairs += [((m, "none"), (m, lv)) for m in METHODS for lv in levels if lv != "none"]
    out = []
    for a, b in pairs:
        seeds = sorted({s for (m, lv, s) in grades if (m, lv) == a} & {s for (m, lv, s) in grades if (m, lv) == b})
        if not seeds:
            continue
        found = paired_grade_intervals([grades[(*a, s)] for s in seeds], [grades[(*b, s)] for s in seeds], seeds, draws)
        out += [{"a": list(a), "b": list(b), **d} for d in found]
    return out


def _mean_sd(values: list[float]) -> str:
    return "{:.1f} ± {:.1f}".format(*mean_sd(values))


def _epsilon_text(rows: list[dict[str, Any]]) -> str:
    if any(r["epsilon_infinite"] for r in rows) or all(r["epsilon"] is None for r in rows):
        return "∞"
    return f"{np.mean([r['epsilon'] for r in rows]):.3g}"


def tables(rows: list[dict[str, Any]], found: list[dict[str, Any]], k: int) -> str:
    out = [
        f"**Final held-out accuracy (%), mean ± sd over seeds; ε at δ_DP = {next((r['delta'] for r in rows if r['delta']), 1e-5):g}**",
        "",
        f"| method | privacy | ε | greedy | Avg@{k} | mean a | held rounds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        for lv in dict.fromkeys(r["level"] for r in rows):
            cell = [r for r in rows if r["method"] == m and r["level"] == lv]
            if not cell:
                continue
            eps = "–" if lv == "none" else _epsilon_text(cell)
            held = sum(r["held_rounds"] for r in cell)
            out.append(
                f"| {m} | {level_label(lv)} | {eps} | {_mean_sd([r['accuracy'] for r in cell])} | {_mean_sd([r[f'avg@{k}'] for r in cell])} | "
                f"{np.mean([r['mean_multiplier'] for r in cell]):.2f} | {held} / {sum(r['rounds'] for r in cell)} |"
            )
    out += [
        "",
        "**Paired bootstrap, 95 % intervals (pp): by seed and by problem**",
        "",
        "| difference | metric | mean | by seed | by problem | per seed |",
        "|---|---|---:|---|---|---|",
    ]
    for d in found:
        (ma, la), (mb, lb) = d["a"], d["b"]
        what = f"FedTOPS − FedAvg, {level_label(la)}" if ma != mb else f"{mb}: {level_label(lb)} − no DP"
        metric = "greedy" if d["metric"] == "accuracy" else f"Avg@{k}"
        out.append(
            f"| {what} | {metric} | {d['difference']:+.1f} | [{d['by_seed'][0]:+.1f}, {d['by_seed'][1]:+.1f}] | "
            f"[{d['by_problem'][0]:+.1f}, {d['by_problem'][1]:+.1f}] | " + " ".join(f"{x:+.1f}" for x in d["per_seed"]) + " |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """Greedy accuracy (mean ± sd over seeds) against ε (log axis); no DP and z = 0 (ε = ∞) at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    finite = [r["epsilon"] for r in rows if r["epsilon"] is not None and not r["epsilon_infinite"]]
    right = 10 ** (np.ceil(np.log10(max(finite))) + 1) if finite else 1e3
    spots = {"0": right, "none": right * 10}
    for m, color, dx in (("fedavg", "tab:blue", 0.94), ("fedtops", "tab:orange", 1.06)):
        pts = []
        for lv in dict.fromkeys(r["level"] for r in rows):
            cell = [r for r in rows if r["method"] == m and r["level"] == lv]
            if not cell:
                continue
            x = spots.get(lv) or float(np.mean([r["epsilon"] for r in cell]))
            pts.append((x * dx, *mean_sd([r["accuracy"] for r in cell]), lv))
        pts.sort()
        xs, ys, es, lvs = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=color, label="FedTOPS" if m == "fedtops" else "FedAvg")
        for x, y, lv in zip(xs, ys, lvs):
            if lv not in spots:
                ax.annotate(level_label(lv), (x, y), textcoords="offset points", xytext=(-30 if m == "fedavg" else 5, 6), fontsize=7, color=color)
    ax.set_xscale("log")
    ticks = [t for t in ax.get_xticks() if t < right]
    ax.set_xticks([*ticks, right, right * 10], [*(f"$10^{{{int(np.log10(t))}}}$" for t in ticks), "z = 0\n(ε = ∞)", "no DP"])
    ax.set_xlim(min(finite) / 3 if finite else 1, right * 30)
    ax.set_xlabel(f"ε at δ_DP = {next((r['delta'] for r in rows if r['delta']), 1e-5):g} after the run (log)")
    ax.set_ylabel("final held-out greedy accuracy (%)")
    ax.set_title("Sandbox, 3 clients, 10 rounds, lr 3e-3: what central DP costs (mean ± sd, 3 seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "privacy.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from fedopd.config import ConfigError, parse_run_config
    from fedopd.config.presets import add_run_config_option

    p = argparse.ArgumentParser(prog="python -m eval.privacy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--noise", default=",".join(DEFAULT_NOISE), help="comma-separated noise multipliers z, 'none' = no privacy")
    p.add_argument("--clip", type=float, default=DEFAULT_CLIP, help="privacy.clip-norm C")
    p.add_argument("--seeds", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_SEEDS)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("privacy-results"))
    p.add_argument("--runs", type=Path, default=None, help="where the run folders live (default OUT/runs); finished runs are reused")
    p.add_argument("--bootstrap", type=int, default=5000)
    add_run_config_option(p, help="the setting of every cell (default: eval.prompts-per-client=64, as the sandbox grid)")
    args = p.parse_args(argv)
    levels = [x.strip() for x in args.noise.split(",") if x.strip()]
    for lv in levels:
        if lv != "none" and not (lv.replace(".", "", 1).isdigit() and float(lv) >= 0):
            p.error(f"--noise: {lv!r} is not a number >= 0 or 'none'")
    runs_root = args.runs or args.out / "runs"
    cells = [(m, lv, s) for m in METHODS for lv in levels for s in args.seeds]
    configs = {}
    try:
        setting = grid_setting(args.run_config or ["eval.prompts-per-client=64"])
        for m, lv, s in cells:
            folder = runs_root / f"privacy-{m}-{lv}-seed{s}"
            configs[m, lv, s] = cell_config(m, lv, s, args.clip, args.lr, args.rounds, folder, setting)
            parse_run_config(configs[m, lv, s])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    runs = {c: finished_run(runs_root, configs[c]) for c in cells}
    todo = [c for c in cells if runs[c] is None or not (runs[c] / GRADES).is_file()]
    print(f"{len(cells) - len(todo)} of {len(cells)} runs reused; running {len(todo)} with {args.jobs} job(s)", flush=True)
    run_cells(configs, runs, todo, args.jobs, lambda c, run: f"{c[0]} {level_label(c[1])} seed {c[2]}")
    rows = [privacy_row(m, lv, args.lr, s, runs[m, lv, s]) for m, lv, s in cells]
    k = next(int(key[4:]) for key in rows[0] if key.startswith("avg@"))
    found = paired_intervals(rows, args.bootstrap)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "intervals.json").write_text(json.dumps(found, indent=2) + "\n")
    text = tables(rows, found, k)
    (args.out / "table.md").write_text(text)
    figure = plot(rows, args.out)
    print(text)
    print(figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
