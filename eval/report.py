"""Paper-style tables from evaluation summaries, and selection figures from a run folder.

    python -m eval.report --summary FedAvg=eval-results/fedavg/summary.json \\
                          --summary FedTOPS=eval-results/fedtops/summary.json \\
                          --run runs/20261121-101500-fedtops --out report

Tables (rows = methods, columns = benchmarks in the paper's order and Macro), one per metric
(Avg@k, Pass@k, cap-hit rate), each as Markdown, CSV and LaTeX with the best value of every
column in bold (highest, or lowest for cap-hit). Macro is the equal-weight mean of the unrounded
benchmark values; rounding to two decimals happens last.

Figures per run folder: the selected multiplier per round, and Ĵ(a) − Ĵ(1) per candidate and
round (symmetric-log colour scale; infeasible candidates crossed, the selected one circled).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from eval.benchmarks import BENCHMARKS, PAPER_ORDER
from eval.metrics import macro_average
from fedtops_strategy.selection import feasible_indices

METRIC_TITLES = {"avg_at_k": "Avg@{k}", "pass_at_k": "Pass@{k}", "cap_hit": "Cap-hit rate"}
LOWER_IS_BETTER = {"cap_hit"}


def build_table(summaries: dict[str, dict], metric: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(column titles, row labels, values) for one metric; Macro needs every benchmark present."""
    names = [n for n in PAPER_ORDER if any(n in s["benchmarks"] for s in summaries.values())]
    names += sorted({n for s in summaries.values() for n in s["benchmarks"]} - set(names))
    columns = [BENCHMARKS[n].title if n in BENCHMARKS else n for n in names] + ["Macro"]
    rows = []
    for summary in summaries.values():
        values = [summary["benchmarks"].get(n, {}).get(metric) for n in names]
        present = {n: v for n, v in zip(names, values) if v is not None}
        values.append(macro_average(present) if len(present) == len(names) else None)
        rows.append(values)
    return columns, list(summaries), rows


def _best(rows: list[list[float | None]], metric: str) -> list[float | None]:
    best = []
    for col in zip(*rows):
        vals = [round(v, 2) for v in col if v is not None]
        best.append((min(vals) if metric in LOWER_IS_BETTER else max(vals)) if vals else None)
    return best


def render(columns, labels, rows, metric: str, fmt: str, title: str) -> str:
    best = _best(rows, metric)

    def cell(v, b, bold):
        if v is None:
            return "–" if fmt != "csv" else ""
        text = f"{v:.2f}"
        return bold(text) if fmt != "csv" and b is not None and round(v, 2) == b and len(rows) > 1 else text

    if fmt == "md":
        out = [f"**{title}**", "", "| Method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for label, vals in zip(labels, rows):
            out.append(f"| {label} | " + " | ".join(cell(v, b, lambda t: f"**{t}**") for v, b in zip(vals, best)) + " |")
        return "\n".join(out) + "\n"
    if fmt == "tex":
        esc = lambda s: s.replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")  # noqa: E731
        out = [r"\begin{tabular}{l" + "r" * len(columns) + "}", r"\toprule", "Method & " + " & ".join(esc(c) for c in columns) + r" \\", r"\midrule"]
        for label, vals in zip(labels, rows):
            out.append(esc(label) + " & " + " & ".join(cell(v, b, lambda t: rf"\textbf{{{t}}}") for v, b in zip(vals, best)) + r" \\")
        out += [r"\bottomrule", r"\end{tabular}", f"% {title}"]
        return "\n".join(out) + "\n"
    raise ValueError(fmt)


def write_tables(summaries: dict[str, dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    k = next(iter(summaries.values())).get("sampling", {}).get("samples", 8)
    written = []
    for metric, title in METRIC_TITLES.items():
        title = title.format(k=k) + " (%)"
        columns, labels, rows = build_table(summaries, metric)
        for fmt in ("md", "tex"):
            path = out / f"{metric}.{fmt}"
            path.write_text(render(columns, labels, rows, metric, fmt, title))
            written.append(path)
        path = out / f"{metric}.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["Method", *columns])
            for label, vals in zip(labels, rows):
                w.writerow([label, *("" if v is None else f"{v:.2f}" for v in vals)])
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# Selection figures
# ---------------------------------------------------------------------------------------------


def selection_matrix(rounds: list[dict], trust_budget: float, feasibility_tol: float = 1e-8):
    """(candidates, round numbers, Ĵ(a) − Ĵ(1) [cand × round], feasible mask, selected mask)."""
    scored = [r for r in rounds if r.get("teacher_scores")]
    if not scored:
        raise ValueError("no round with teacher scores: figures need a FedTOPS run")
    cands = scored[0]["candidates"]
    ref = cands.index(1.0) if 1.0 in cands else None
    diff = np.full((len(cands), len(scored)), np.nan)
    feasible = np.zeros_like(diff, dtype=bool)
    selected = np.zeros_like(diff, dtype=bool)
    for t, r in enumerate(scored):
        j = np.asarray(r["teacher_scores"], dtype=float)
        diff[:, t] = j - (j[ref] if ref is not None else np.nanmin(j))
        change = [[float(x) for x in row] for row in r["change_scores"]]
        feasible[feasible_indices(change, trust_budget, len(cands), feasibility_tol), t] = True
        if r["multiplier"] in cands:
            selected[cands.index(r["multiplier"]), t] = True
    return cands, [r["round"] for r in scored], diff, feasible, selected


# The paper's colour scale for Ĵ(a) − Ĵ(1): linear within ±0.002 nats, logarithmic beyond, and the
# same range on every panel, so that runs compare by colour.
SCORE_LINTHRESH = 0.002


def score_range(runs: list[Path]) -> float:
    """The largest |Ĵ(a) − Ĵ(1)| over the FedTOPS rounds of ``runs``: the shared colour range."""
    from server_app.run_folder import read_rounds

    vmax = 0.0
    for run in runs:
        config = json.loads((run / "config.json").read_text())
        try:
            _, _, diff, _, _ = selection_matrix([r for r in read_rounds(run) if r["round"] > 0], float(config["strategy.trust-budget"]))
        except ValueError:
            continue
        finite = np.abs(diff[np.isfinite(diff)])
        if finite.size:
            vmax = max(vmax, float(finite.max()))
    return max(vmax, 10 * SCORE_LINTHRESH)


def score_ticks(vmax: float) -> list[float]:
    """Colour-bar ticks that do not crowd: 0, ±the linear range, ±decades beyond it up to ±vmax."""
    ticks = [SCORE_LINTHRESH]
    while ticks[-1] * 10 <= vmax * 1.0001:
        ticks.append(ticks[-1] * 10)
    if vmax >= ticks[-1] * 5:  # closer than that, the end's label would overlap the last decade's
        ticks.append(vmax)
    return [-t for t in reversed(ticks)] + [0.0] + ticks


def plot_run(run: Path, out: Path, vmax: float | None = None) -> list[Path]:
    """The selected multiplier per round, and Ĵ(a) − Ĵ(1) per candidate and round on the paper's
    symmetric-log scale (``vmax``: the colour range, shared across runs; default this run's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm
    from matplotlib.ticker import MaxNLocator

    from server_app.progress import run_title
    from server_app.run_folder import read_rounds

    rounds = [r for r in read_rounds(run) if r["round"] > 0]  # round 0: the initial adapter's evaluation
    config = json.loads((run / "config.json").read_text())
    title = run_title(config)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    xs = [r["round"] for r in rounds]
    ax.step(xs, [r["multiplier"] for r in rounds], where="mid", marker="o")
    for r in rounds:
        if r.get("fallback"):
            ax.annotate("fallback", (r["round"], r["multiplier"]), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("selected multiplier a_t")
    ax.set_title(f"selected multiplier per round\n{title}", fontsize=9)
    fig.tight_layout()
    path = out / f"{run.name}-multiplier.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    written.append(path)

    try:
        cands, xs, diff, feasible, selected = selection_matrix(rounds, float(config["strategy.trust-budget"]))
    except ValueError:
        return written
    vmax = vmax if vmax is not None else score_range([run])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(xs) + 3.5), 4.2))
    norm = SymLogNorm(linthresh=SCORE_LINTHRESH, vmin=-vmax, vmax=vmax, base=10)
    im = ax.imshow(diff, aspect="auto", cmap="coolwarm", norm=norm, origin="lower")
    ci, ti = np.nonzero(~feasible)
    ax.scatter(ti, ci, marker="x", color="black", s=30, label="infeasible")
    ci, ti = np.nonzero(selected)
    ax.scatter(ti, ci, marker="o", facecolors="none", edgecolors="black", s=90, linewidths=1.5, label="selected")
    ax.set_yticks(range(len(cands)), [f"{a:g}" for a in cands])
    step = max(1, len(xs) // 15)  # at most ~15 round labels
    ax.set_xticks(range(0, len(xs), step), [str(x) for x in xs[::step]])
    ax.set_xlabel("round")
    ax.set_ylabel("candidate a")
    ax.set_title(f"Ĵ(a) − Ĵ(1) (nats): below 0 is closer to the teacher than FedAvg\n{title}", fontsize=9)
    bar = fig.colorbar(im, ax=ax, ticks=score_ticks(vmax), format="%.3g")
    bar.set_label(f"symmetric log, linear within ±{SCORE_LINTHRESH:g}", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    path = out / f"{run.name}-scores.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", action="append", default=[], help="METHOD=path/to/summary.json (repeatable, row order)")
    p.add_argument("--run", action="append", default=[], type=Path, help="run folder with rounds.jsonl (repeatable)")
    p.add_argument("--out", type=Path, default=Path("report"))
    args = p.parse_args(argv)
    if not args.summary and not args.run:
        p.error("give --summary and/or --run")

    summaries = {}
    for item in args.summary:
        label, sep, path = item.partition("=")
        path = Path(path if sep else label)
        label = label if sep else path.parent.name
        if not path.is_file():
            print(f"error: summary file '{path}' does not exist", file=sys.stderr)
            return 1
        summaries[label] = json.loads(path.read_text())
    for run in args.run:
        if not (run / "rounds.jsonl").is_file():
            print(f"error: '{run}' is not a run folder (no rounds.jsonl)", file=sys.stderr)
            return 1

    written = write_tables(summaries, args.out) if summaries else []
    vmax = score_range(args.run) if args.run else None  # one colour range for every run's panel
    for run in args.run:
        written += plot_run(run, args.out, vmax)
    for path in written:
        print(path)
    if summaries:
        print()
        print((args.out / "avg_at_k.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
