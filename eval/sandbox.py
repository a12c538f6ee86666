"""The paper's learning-rate × method comparison on the CPU sandbox.

    python -m eval.sandbox [--lrs 3e-4,3e-3] [--methods local,centralized,fedavg,fixed3,fixed10,fedtops]
                           [--seeds 0,1] [--rounds 10] [--eval-every 5] [--jobs 2] [--out sandbox-results]
                           [--run-config "num-clients=12 data.partitioner='dirichlet' ..."]

Every run goes through the app's own ServerApp, ClientApp and strategies (in process, see
:mod:`server_app.inprocess`) on the sandbox preset, changing only ``train.lr``, ``seed``, the
method and the number of rounds. Budgets are equal as in the paper: every method sees the same
rollouts per round (Centralized: the clients' combined rollouts in one learner) and the same
mini-batch. Held-out evaluation runs every ``--eval-every`` rounds and in the last round.
``--jobs`` runs that many grid cells at once in worker processes with one torch thread each (the
sandbox models are small enough that two single-threaded runs beat one two-threaded run).

``--run-config`` (repeatable, exactly as for ``flwr run``) changes the setting every cell runs in:
the number of clients (``num-clients``, default 3), the partitioner, ``strategy.fraction-train``,
the evaluation, ... The grid's own keys (the method's, ``train.lr``, ``seed``,
``num-server-rounds``, ``eval.every``) come from the grid's options and cannot be overridden.

Writes to ``--out``: ``runs/<method>-lr<lr>-seed<seed>/<run folder>`` (a finished run with the
same configuration is reused, an unfinished one is left alone and run again), ``results.json``
(one row per run), ``table.md`` (final held-out greedy accuracy and Avg@8, mean ± sd over seeds,
best per learning rate in bold, FedTOPS's mean selected multiplier) and figures: accuracy per
round per method, FedTOPS's selected multiplier per round, and Ĵ(a) − Ĵ(1) per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

METHODS: dict[str, dict[str, Any]] = {
    "local": {"strategy.name": "local"},
    "centralized": {"strategy.name": "centralized"},
    "fedavg": {"strategy.name": "fedavg"},
    "fixed3": {"strategy.name": "fixed", "strategy.multiplier": 3.0},
    "fixed10": {"strategy.name": "fixed", "strategy.multiplier": 10.0},
    "fedtops": {"strategy.name": "fedtops"},
}
TITLES = {"local": "Local mean", "centralized": "Centralized", "fedavg": "FedAvg", "fixed3": "a = 3", "fixed10": "a = 10", "fedtops": "FedTOPS"}
# Chosen once, before any method was compared: the sandbox preset's rate (3e-3, the largest at
# which FedAvg's first rounds stayed stable when the preset was tuned) and a tenth of it.
DEFAULT_LRS = (3e-4, 3e-3)
DEFAULT_SEEDS = (0, 1)
DEFAULT_ROUNDS = 10
DEFAULT_EVAL_EVERY = 5


GRID_KEYS = ("strategy.name", "strategy.multiplier", "train.lr", "seed", "num-server-rounds", "eval.every", "output-dir", "preset")


def grid_setting(run_config_args: list[str]) -> dict[str, Any]:
    """The ``--run-config`` values as a dict; a ``ConfigError`` when they set a key of :data:`GRID_KEYS`."""
    from fedopd.config import ConfigError
    from fedopd.presets import overrides_from_args

    setting = overrides_from_args(run_config_args) if run_config_args else {}
    fixed = sorted(set(setting) & set(GRID_KEYS))
    if fixed:
        raise ConfigError(f"--run-config sets {', '.join(repr(k) for k in fixed)}, which the grid sets itself; "
                          "use --methods, --lrs, --seeds, --rounds, --eval-every and --out")
    return setting


def run_config(method: str, lr: float, seed: int, rounds: int, eval_every: int, output_dir: Path,
               setting: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sandbox preset with ``setting`` (``--run-config``) and this grid cell's method, learning
    rate, seed and length."""
    return {
        **(setting or {}),
        **METHODS[method],
        "train.lr": lr,
        "seed": seed,
        "num-server-rounds": rounds,
        "eval.every": eval_every,
        "output-dir": str(output_dir),
        "preset": "sandbox-grid",
    }


def finished_run(folder: Path, config: dict[str, Any]) -> Path | None:
    """A run folder under ``folder`` with exactly this resolved config and its last round evaluated."""
    from fedopd.config import parse_run_config
    from server_app.run_folder import read_rounds, read_run_config

    want = parse_run_config(config).to_run_config()
    for run in sorted(folder.glob("*/")) if folder.is_dir() else []:
        try:
            if read_run_config(run) != want:
                continue
            rounds = read_rounds(run)
        except (OSError, ValueError):
            continue
        if rounds and rounds[-1]["round"] == config["num-server-rounds"] and rounds[-1].get("evaluation"):
            return run
    return None


def result_row(method: str, lr: float, seed: int, run: Path) -> dict[str, Any]:
    """One results.json row from a finished run folder."""
    from server_app.run_folder import read_rounds

    rounds = read_rounds(run)
    final = rounds[-1]["evaluation"]
    k = next(int(key[4:]) for key in final if key.startswith("avg@"))
    multipliers = [r["multiplier"] for r in rounds if r["round"] > 0]
    return {
        "method": method,
        "lr": lr,
        "seed": seed,
        "accuracy": final["accuracy"],
        f"avg@{k}": final[f"avg@{k}"],
        f"pass@{k}": final[f"pass@{k}"],
        "mean_multiplier": float(np.mean(multipliers)) if method == "fedtops" else None,
        "run": str(run),
    }


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def table(rows: list[dict[str, Any]], metric: str, title: str) -> str:
    """Methods × learning rates, mean ± sd over seeds, the best mean per column in bold."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lrs = sorted({r["lr"] for r in rows})
    cells = {(m, lr): mean_sd([r[metric] for r in rows if r["method"] == m and r["lr"] == lr]) for m in methods for lr in lrs
             if any(r["method"] == m and r["lr"] == lr for r in rows)}
    best = {lr: max(round(cells[m, lr][0], 1) for m in methods if (m, lr) in cells) for lr in lrs}
    out = [f"**{title}**", "", "| Method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for m in methods:
        vals = []
        for lr in lrs:
            if (m, lr) not in cells:
                vals.append("–")
                continue
            mu, sd = cells[m, lr]
            text = f"{mu:.1f} ± {sd:.1f}"
            vals.append(f"**{text}**" if round(mu, 1) == best[lr] and len(methods) > 1 else text)
        out.append(f"| {TITLES.get(m, m)} | " + " | ".join(vals) + " |")
    fedtops = [r for r in rows if r["method"] == "fedtops"]
    if fedtops and metric == "accuracy":
        means = [np.mean([r["mean_multiplier"] for r in fedtops if r["lr"] == lr]) if any(r["lr"] == lr for r in fedtops) else None for lr in lrs]
        out.append("| FedTOPS mean a | " + " | ".join("–" if v is None else f"{v:.2f}" for v in means) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy per round per method (one panel per lr); FedTOPS's multiplier per round; Ĵ(a) − Ĵ(1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.report import plot_run
    from server_app.run_folder import read_rounds

    lrs = sorted({r["lr"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    written = []
    fig, axes = plt.subplots(1, len(lrs), figsize=(4.2 * len(lrs), 3.4), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for m in methods:
            curves = [[(r["round"], r["evaluation"]["accuracy"]) for r in read_rounds(row["run"]) if r.get("evaluation")]
                      for row in rows if row["method"] == m and row["lr"] == lr]
            if not curves:
                continue
            xs = [x for x, _ in curves[0]]
            ys = np.mean([[y for _, y in c] for c in curves], axis=0)
            ax.plot(xs, ys, marker="o", ms=3, label=TITLES.get(m, m))
        ax.set_title(f"client learning rate {lr:g}")
        ax.set_xlabel("round")
    axes[0][0].set_ylabel("held-out greedy accuracy (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "accuracy_per_round.png")
    fig.savefig(written[-1], dpi=150)
    plt.close(fig)

    fedtops = [r for r in rows if r["method"] == "fedtops"]
    if fedtops:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for lr in lrs:
            runs = [read_rounds(r["run"]) for r in fedtops if r["lr"] == lr]
            if runs:
                xs = [r["round"] for r in runs[0] if r["round"] > 0]
                ys = np.mean([[r["multiplier"] for r in run if r["round"] > 0] for run in runs], axis=0)
                ax.plot(xs, ys, marker="o", ms=3, label=f"lr {lr:g}")
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("selected a (mean over seeds)")
        ax.set_title("FedTOPS: selected multiplier per round")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "fedtops_multiplier.png")
        fig.savefig(written[-1], dpi=150)
        plt.close(fig)
        for lr in lrs:  # Ĵ(a) − Ĵ(1) per round, first seed of each learning rate
            first = next((r for r in fedtops if r["lr"] == lr), None)
            if first:
                written += [p for p in plot_run(Path(first["run"]), out / f"fedtops-lr{lr:g}") if p.name.endswith("-scores.png")]
    return written


def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _run_cell(config: dict[str, Any]) -> tuple[Path, float]:
    from server_app.inprocess import run_in_process

    t0 = time.perf_counter()
    return run_in_process(config, num_clients=int(config.get("num-clients") or 3)), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.sandbox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--lrs", type=floats, default=DEFAULT_LRS, help="comma-separated local learning rates")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--seeds", type=ints, default=DEFAULT_SEEDS)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    p.add_argument("--jobs", type=int, default=2, help="grid cells run at once (one torch thread each)")
    p.add_argument("--out", type=Path, default=Path("sandbox-results"))
    p.add_argument("--run-config", "-c", action="append", default=[], metavar="'k1=v1 k2=v2'",
                   help="the setting of every cell, exactly as for `flwr run --run-config` (repeatable)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(repr(m) for m in unknown)}; allowed: {', '.join(METHODS)}")
    if args.rounds < 1 or args.eval_every < 1 or args.jobs < 1 or any(lr <= 0 for lr in args.lrs):
        p.error("--rounds, --eval-every and --jobs must be >= 1 and every learning rate > 0")

    from fedopd.config import ConfigError, parse_run_config

    cells = [(m, lr, s) for lr in args.lrs for m in methods for s in args.seeds]
    configs = {}
    try:  # every configuration is valid before the first run starts
        setting = grid_setting(args.run_config)
        for m, lr, s in cells:
            folder = args.out / "runs" / f"{m}-lr{lr:g}-seed{s}"
            configs[m, lr, s] = (folder, run_config(m, lr, s, args.rounds, args.eval_every, folder, setting))
            parse_run_config(configs[m, lr, s][1])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    started = time.perf_counter()
    runs = {cell: finished_run(*configs[cell]) for cell in cells}
    todo = [cell for cell in cells if runs[cell] is None]
    print(f"{len(cells) - len(todo)} of {len(cells)} runs already finished (reused); running {len(todo)} with {args.jobs} job(s)", flush=True)
    if todo:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch or grader state
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, initializer=_single_thread) as pool:
            futures = {pool.submit(_run_cell, configs[cell][1]): cell for cell in todo}
            for i, future in enumerate(as_completed(futures), 1):
                cell = futures[future]
                runs[cell], seconds = future.result()
                m, lr, s = cell
                print(f"[{i}/{len(todo)}] {m} lr {lr:g} seed {s}: greedy {result_row(m, lr, s, runs[cell])['accuracy']:.1f}% "
                      f"({seconds:.0f} s; {time.perf_counter() - started:.0f} s so far)", flush=True)
    rows = [result_row(m, lr, s, runs[m, lr, s]) for m, lr, s in cells]

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    k = next(int(key[4:]) for key in rows[0] if key.startswith("avg@"))
    text = (table(rows, "accuracy", "Final held-out greedy accuracy (%), mean ± sd over seeds")
            + "\n" + table(rows, f"avg@{k}", f"Final held-out Avg@{k} (%), mean ± sd over seeds"))
    (args.out / "table.md").write_text(text)
    figures = plot(rows, args.out)
    print()
    print(text)
    for path in [args.out / "results.json", args.out / "table.md", *figures]:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
