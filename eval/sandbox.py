"""The paper's learning-rate × method comparison on the CPU sandbox.

    python -m eval.sandbox [--lrs 3e-4,3e-3] [--methods local,centralized,fedavg,fixed3,fixed10,fedtops]
                           [--trust-budgets 0.01,0.05,inf] [--tune fedadam,... | --tuned tuned.json]
                           [--seeds 0,1] [--rounds 10] [--eval-every 5]
                           [--jobs 2] [--out sandbox-results] [--runs DIR] [--bootstrap 5000]
                           [--run-config "num-clients=12 data.partitioner='dirichlet' ..."]

The grid is a use of :mod:`eval.variants` (its methods are the variants, crossed with the learning
rates and seeds). Every run goes through the app's own ServerApp, ClientApp and strategies (in
process, see :mod:`server_app.inprocess`) on the sandbox preset, changing only ``train.lr``, ``seed``, the
method and the number of rounds. Budgets are equal as in the paper: every method sees the same
rollouts per round (Centralized: the clients' combined rollouts in one learner) and the same
mini-batch. Held-out evaluation runs every ``--eval-every`` rounds and in the last round (0: not
during the runs). ``--jobs`` runs that many grid cells at once in worker processes with one torch
thread each (the sandbox models are small enough that two single-threaded runs beat one
two-threaded run).

``--trust-budgets`` adds FedTOPS at each trust budget δ as a method of its own,
``fedtops-d<δ>`` (``inf``: no constraint, the candidate with the lowest Ĵ wins).

The server optimizers (``fedexp``, ``fedavgm``, ``fedadam``, ``fedyogi``, ``fedadagrad``) are
tuned first: ``--tune RULES --seeds <tuning seeds>`` runs each rule's declared sweep
(:data:`SWEEPS`, three settings, the adaptive rules' η and τ in units of the client learning
rate) and writes ``OUT/tuned.json``, the setting with the best mean final greedy accuracy per rule
and learning rate (:func:`choose_settings`); ``--methods fedadam,... --tuned tuned.json`` then runs
each rule at its chosen setting, compared with FedTOPS and FedAvg (FedTOPS − R, R − FedAvg).

``--run-config`` (repeatable, exactly as for ``flwr run``) changes the setting every cell runs in:
the number of clients (``num-clients``, default 3), the partitioner, ``strategy.fraction-train``,
``eval.prompts-per-client``, ... The grid's own keys (the method's, ``train.lr``, ``seed``,
``num-server-rounds``, ``eval.every``) come from the grid's options and cannot be overridden.

After each run, the final adapter(s) are graded per problem on every client's held-out problems
(``heldout-grades.npz`` in the run folder, with the seeds of the run's last evaluation, whose
scores they must reproduce). The held-out problems are the same in every run, so two methods pair
by seed and by problem.

Writes to ``--out``: ``results.json`` (one row per run: final greedy, Avg@k, Pass@k, mean
multiplier, mean aggregation errors, FedTOPS's infeasible rounds per candidate), ``intervals.json``
(paired bootstrap intervals of FedTOPS − FedAvg and FedAvg − Local per learning rate, by seed and
by problem), ``table.md`` (the tables: scores as mean ± sd over seeds with the best per learning
rate in bold, the intervals, the aggregation error per method, the trust-budget sweep) and figures:
accuracy per round per method (when evaluated during the runs), FedTOPS's selected multiplier per
round, Ĵ(a) − Ĵ(1) per round, and final accuracy against δ (``trust_budget.png``). Run folders live
in ``--runs`` (default ``OUT/runs``); a finished run with the same configuration anywhere under
it is reused, so grids that share ``--runs`` share their common cells.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from eval import variants
from eval.variants import finished_run, mean_sd

METHODS: dict[str, dict[str, Any]] = {
    "local": {"strategy.name": "local"},
    "centralized": {"strategy.name": "centralized"},
    "fedavg": {"strategy.name": "fedavg"},
    "fixed3": {"strategy.name": "fixed", "strategy.multiplier": 3.0},
    "fixed10": {"strategy.name": "fixed", "strategy.multiplier": 10.0},
    "fedtops": {"strategy.name": "fedtops"},
    # The variants of the lr 3e-3 study (docs/sandbox.md, "Why FedTOPS trails FedAvg at the large
    # learning rate"); not in the default grid.
    "fedtops-cache-xl": {"strategy.name": "fedtops", "cache.rollouts": 8, "cache.positions": 64},
    "fedtops-se": {"strategy.name": "fedtops-se"},
    "fedtops-heldout-cache": {"strategy.name": "fedtops-heldout-cache"},
}
DEFAULT_METHODS = ("local", "centralized", "fedavg", "fixed3", "fixed10", "fedtops")

# The server optimizers of the study "Does the teacher need to choose the step?" (docs/sandbox.md):
# each rule's declared sweep, three settings of the rule as functions of the client learning rate
# (run with --tune on the tuning seeds); the rule as a method of the grid runs the setting that
# its tuning chose at that learning rate (--tuned FILE, written by --tune).
SWEEPS: dict[str, dict[str, Any]] = {
    "fedavgm": {
        f"fedavgm-s{eta:g}": (lambda lr, eta=eta: {"strategy.name": "fedavgm", "strategy.server-lr": eta, "strategy.server-momentum": 0.9})
        for eta in (0.1, 0.3, 1.0)
    },
    **{
        rule: {
            f"{rule}-x{c:g}": (
                lambda lr, c=c, rule=rule: {
                    "strategy.name": rule,
                    "strategy.server-lr": c * lr,
                    "strategy.tau": lr / 100,
                    **({"strategy.beta1": 0.9, "strategy.beta2": 0.99} if rule != "fedadagrad" else {}),
                }
            )
            for c in (2, 6, 20)
        }
        for rule in ("fedadam", "fedyogi", "fedadagrad")
    },
    "fedexp": {
        f"fedexp-e{eps:g}": (lambda lr, eps=eps: {"strategy.name": "fedexp", "strategy.fedexp-epsilon": eps, "strategy.fedexp-average": True})
        for eps in (1e-4, 1e-3, 1e-2)
    },
}
SWEEP_SETTINGS = {name: settings for sweep in SWEEPS.values() for name, settings in sweep.items()}
TUNED = tuple(SWEEPS)  # methods whose setting comes from their tuning
TITLES = {
    "local": "Local mean",
    "centralized": "Centralized",
    "fedavg": "FedAvg",
    "fixed3": "a = 3",
    "fixed10": "a = 10",
    "fedtops": "FedTOPS",
    "fedtops-cache-xl": "FedTOPS, cache 8 × 64",
    "fedtops-se": "FedTOPS, SE walk",
    "fedtops-heldout-cache": "FedTOPS, held-out cache",
    "fedexp": "FedExP",
    "fedavgm": "FedAvgM",
    "fedadam": "FedAdam",
    "fedyogi": "FedYogi",
    "fedadagrad": "FedAdagrad",
}
# Chosen once, before any method was compared: the sandbox preset's rate (3e-3, the largest at
# which FedAvg's first rounds stayed stable when the preset was tuned) and a tenth of it.
DEFAULT_LRS = (3e-4, 3e-3)
DEFAULT_SEEDS = (0, 1)
DEFAULT_ROUNDS = 10
DEFAULT_EVAL_EVERY = 5


TRUST_BUDGET_PREFIX = "fedtops-d"  # fedtops-d0.05, fedtops-dinf: FedTOPS at that trust budget δ


def trust_budget_method(delta: float) -> str:
    """The grid's method name of FedTOPS at trust budget ``delta`` (``inf``: no constraint)."""
    return f"{TRUST_BUDGET_PREFIX}{delta:g}"


def method_trust_budget(method: str) -> float | None:
    """δ of a :func:`trust_budget_method` name; None for the other methods."""
    if not method.startswith(TRUST_BUDGET_PREFIX):
        return None
    return float(method[len(TRUST_BUDGET_PREFIX) :])


def method_settings(method: str, lr: float | None = None, tuned: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """The run-config keys that make a grid method at client learning rate ``lr``: :data:`METHODS`,
    FedTOPS at a δ, one setting of a sweep (:data:`SWEEPS`), or a server optimizer at the setting
    its tuning chose at ``lr`` (``tuned``: :func:`choose_settings`'s file)."""
    delta = method_trust_budget(method)
    if delta is not None:
        return {"strategy.name": "fedtops", "strategy.trust-budget": delta}
    if method in SWEEP_SETTINGS:
        return SWEEP_SETTINGS[method](lr)
    if method in TUNED:
        chosen = (tuned or {}).get(method, {}).get(f"{lr:g}")
        if chosen is None:
            raise ValueError(
                f"--methods {method}: no tuned setting at lr {lr:g}; run --tune {method} on the tuning seeds and pass its tuned.json as --tuned"
            )
        if chosen not in SWEEPS[method]:
            raise ValueError(f"--tuned: {chosen!r} is not a setting of {method}'s sweep ({', '.join(SWEEPS[method])})")
        return SWEEP_SETTINGS[chosen](lr)
    return METHODS[method]


def choose_settings(rows: list[dict[str, Any]], k: int) -> tuple[dict[str, dict[str, str]], str]:
    """The declared selection rule of the tuning (docs/sandbox.md): per rule and learning rate, the
    sweep setting with the highest mean final greedy accuracy over the tuning seeds; a tie within
    0.1 pp goes to the higher Avg@k, then to the setting listed first. Returns {rule: {lr: setting}}
    and the tuning table (mean greedy / Avg@k per setting, the chosen ones in bold)."""
    chosen: dict[str, dict[str, str]] = {}
    lines = [
        f"**Tuning: final held-out greedy / Avg@{k} (%), mean over the tuning seeds; chosen in bold**",
        "",
        "| setting | " + " | ".join(f"lr {lr:g}" for lr in sorted({r["lr"] for r in rows})) + " |",
        "|---|" + "---:|" * len({r["lr"] for r in rows}),
    ]
    lrs = sorted({r["lr"] for r in rows})
    cells: dict[tuple[str, float], tuple[float, float]] = {}
    for rule, sweep in SWEEPS.items():
        for lr in lrs:
            scored = []
            for order, name in enumerate(sweep):
                sel = [r for r in rows if r["method"] == name and r["lr"] == lr]
                if sel:
                    cells[name, lr] = (float(np.mean([r["accuracy"] for r in sel])), float(np.mean([r[f"avg@{k}"] for r in sel])))
                    scored.append((name, order, *cells[name, lr]))
            if scored:
                top = max(g for _, _, g, _ in scored)
                tied = [x for x in scored if x[2] >= top - 0.1]
                best = max(tied, key=lambda x: (x[3], -x[1]))
                chosen.setdefault(rule, {})[f"{lr:g}"] = best[0]
    for name in (n for sweep in SWEEPS.values() for n in sweep):
        if any((name, lr) in cells for lr in lrs):
            row = []
            for lr in lrs:
                if (name, lr) not in cells:
                    row.append("–")
                    continue
                text = f"{cells[name, lr][0]:.1f} / {cells[name, lr][1]:.1f}"
                row.append(f"**{text}**" if chosen.get(name.rsplit("-", 1)[0], {}).get(f"{lr:g}") == name else text)
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return chosen, "\n".join(lines) + "\n"


def delta_text(delta: float) -> str:
    """A trust budget as tables and figures show it (∞ for no constraint)."""
    return "∞" if delta == float("inf") else f"{delta:g}"


def method_title(method: str) -> str:
    delta = method_trust_budget(method)
    return f"FedTOPS δ = {delta_text(delta)}" if delta is not None else TITLES.get(method, method)


def swept_methods(rows: list[dict[str, Any]]) -> list[str]:
    """The trust-budget sweep's methods among ``rows``, by increasing δ."""
    return sorted({m for m in (r["method"] for r in rows) if method_trust_budget(m) is not None}, key=method_trust_budget)


def parse_trust_budgets(text: str) -> tuple[float, ...]:
    """``--trust-budgets``: comma-separated numbers >= 0 and ``inf``; a ValueError names the bad one."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        if not value >= 0:
            raise ValueError(f"--trust-budgets: {item!r} is not a number >= 0 or 'inf'")
        out.append(value)
    if len(set(out)) != len(out):
        raise ValueError("--trust-budgets: a value is repeated")
    return tuple(out)


GRID_KEYS = (
    "strategy.name",
    "strategy.trust-budget",
    "strategy.multiplier",
    "train.lr",
    "seed",
    "num-server-rounds",
    "eval.every",
    "output-dir",
    "preset",
)


def grid_setting(run_config_args: list[str]) -> dict[str, Any]:
    """The ``--run-config`` values as a dict; a ``ConfigError`` when they set a key of :data:`GRID_KEYS`."""
    from fedopd.config import ConfigError
    from fedopd.config.presets import overrides_from_args

    setting = overrides_from_args(run_config_args) if run_config_args else {}
    fixed = sorted(set(setting) & set(GRID_KEYS))
    if fixed:
        raise ConfigError(
            f"--run-config sets {', '.join(repr(k) for k in fixed)}, which the grid sets itself; "
            "use --methods, --lrs, --seeds, --rounds, --eval-every and --out"
        )
    return setting


def run_config(
    method: str,
    lr: float,
    seed: int,
    rounds: int,
    eval_every: int,
    output_dir: Path,
    setting: dict[str, Any] | None = None,
    tuned: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The sandbox preset with ``setting`` (``--run-config``) and this grid cell's method, learning
    rate, seed and length."""
    return {
        **(setting or {}),
        **method_settings(method, lr, tuned),
        "train.lr": lr,
        "seed": seed,
        "num-server-rounds": rounds,
        "eval.every": eval_every,
        "output-dir": str(output_dir),
        "preset": "sandbox-grid",
    }


GRADES = "heldout-grades.npz"  # per-problem grades of a grid run's final adapter(s), in its run folder


def grade_clients(cfg, adapter_for, eval_round: int, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem grades on every client's held-out problems, clients in partition order: greedy
    (problems,) and sampled (problems, k), client ``i`` grading ``adapter_for(i)`` with the seeds
    its evaluation in round ``eval_round`` uses."""
    from client_app.worker import setup_heldout
    from fedopd.engine.heldout import heldout_correctness
    from fedopd.engine.round import derive_seed

    greedy, sampled = [], []
    for i in range(num_clients):
        models, prompts = setup_heldout(cfg, i, num_clients)
        g, c, _ = heldout_correctness(models, adapter_for(i), prompts, cfg.eval, derive_seed(cfg.seed, i, eval_round, 3))
        greedy.append(g)
        sampled.append(c)
    return np.concatenate(greedy), np.concatenate(sampled)


def final_grades(run: Path) -> Path:
    """Grade the final adapter(s) of a finished run on every client's held-out problems, with the
    very seeds of the run's last evaluation, and save ``greedy`` (problems,) and ``sampled``
    (problems, k) 0/1 grades, clients in partition order, to ``run/heldout-grades.npz``.

    Local grades each client's own adapter (``round-NNN/client-<i>``), FedExP with
    ``strategy.fedexp-average`` the average it evaluates (``round-NNN/evaluated``), the other
    methods the global one. The means must equal the run's recorded final evaluation (same adapters, seeds
    and problems); a mismatch is an error.
    """
    from fedopd.config import parse_run_config
    from fedopd.models.lora import load_adapter
    from server_app.run_folder import EVALUATED, read_rounds, read_run_config

    cfg = parse_run_config(read_run_config(run))
    last = read_rounds(run)[-1]
    folder = run / f"round-{last['round']:03d}"
    if cfg.strategy.name == "local":
        adapter_for = lambda pid: load_adapter(folder / f"client-{pid}")  # noqa: E731
    else:  # the adapter the run's evaluation reads: FedExP's average of its last two iterates where it saved one
        theta = load_adapter(folder / EVALUATED if (folder / EVALUATED).is_dir() else folder)
        adapter_for = lambda pid: theta  # noqa: E731
    greedy_all, sampled_all = grade_clients(cfg, adapter_for, last["round"], int(cfg.num_clients or 3))
    recorded = last.get("evaluation")
    k = cfg.eval.samples
    if (
        recorded
        and cfg.eval.fraction == 1.0
        and (abs(100 * greedy_all.mean() - recorded["accuracy"]) > 1e-6 or abs(100 * sampled_all.mean() - recorded[f"avg@{k}"]) > 1e-6)
    ):
        raise RuntimeError(
            f"{run}: re-graded final adapter gives greedy {100 * greedy_all.mean():.3f} % / "
            f"Avg@{k} {100 * sampled_all.mean():.3f} %, the run recorded {recorded['accuracy']:.3f} % / "
            f"{recorded[f'avg@{k}']:.3f} %"
        )
    path = run / GRADES
    np.savez_compressed(path, greedy=greedy_all, sampled=sampled_all)
    return path


def graded_scores(path: Path) -> dict[str, float]:
    """Greedy accuracy, Avg@k and Pass@k (%) from a :func:`final_grades` file."""
    from fedopd.engine.heldout import heldout_scores

    with np.load(path) as z:
        return heldout_scores(z["greedy"], z["sampled"])


def step_fields(record: dict[str, Any]) -> tuple[float | None, float | None]:
    """(effective multiplier, cosine to Δ_t) of a round record. A record written before the round
    record had them (issue 50) and whose strategy steps along Δ_t (no ``step-cosine``, a
    ``multiplier`` a) moved by θ_t + aΔ_t: (a, 1), or (0, None) for a hold; Local: (None, None)."""
    if "step-cosine" in record or "effective-multiplier" in record:
        return record.get("effective-multiplier"), record.get("step-cosine")
    a = record.get("multiplier")
    if a is None or record.get("strategy") in ("local", "centralized"):
        return None, None
    return float(a), (1.0 if a > 0 else None)


def _mean_of(values: list) -> float | None:
    values = [float(v) for v in values if v is not None]
    return float(np.mean(values)) if values else None


def result_row(method: str, lr: float, seed: int, run: Path) -> dict[str, Any]:
    """One results.json row from a finished run folder: final held-out scores, the multipliers,
    the aggregation errors (mean over rounds), and for FedTOPS how often each candidate was
    infeasible."""
    from fedopd.core.strategies import capabilities
    from fedtops_strategy.selection import feasible_indices
    from server_app.run_folder import read_rounds, read_run_config

    rounds = read_rounds(run)
    final = rounds[-1].get("evaluation") or graded_scores(run / GRADES)
    k = next(int(key[4:]) for key in final if key.startswith("avg@"))
    trained = [r for r in rounds if r["round"] > 0]
    multipliers = [r["multiplier"] for r in trained]
    row: dict[str, Any] = {
        "method": method,
        "lr": lr,
        "seed": seed,
        "accuracy": final["accuracy"],
        f"avg@{k}": final[f"avg@{k}"],
        f"pass@{k}": final[f"pass@{k}"],
        "mean_multiplier": float(np.mean(multipliers)) if str(read_run_config(run).get("strategy.name")).startswith("fedtops") else None,
        "mean_effective_multiplier": _mean_of([step_fields(r)[0] for r in trained]),
        "mean_step_cosine": _mean_of([step_fields(r)[1] for r in trained]),
        "seconds": float(sum(r.get("seconds", 0.0) for r in trained)),  # the rounds' wall time (train and score phases)
        "aggregation_error": _mean_of([r.get("aggregation-error") for r in trained]),
        "aggregation_error_applied": _mean_of([r.get("aggregation-error-applied") for r in trained]),
        "run": str(run),
    }
    config = read_run_config(run)
    settings = {key: config[key] for key in capabilities(str(config.get("strategy.name"))).server_keys if key in config}
    if settings:
        row["settings"] = settings
    if any(r.get("change_scores") for r in trained):
        delta = float(read_run_config(run)["strategy.trust-budget"])
        candidates = next(r["candidates"] for r in trained if r.get("change_scores"))
        infeasible = [0] * len(candidates)
        for r in trained:
            if r.get("change_scores"):
                feasible = set(feasible_indices(r["change_scores"], delta, len(candidates)))
                for j in range(len(candidates)):
                    infeasible[j] += j not in feasible
        row.update(
            trust_budget=delta,
            candidates=candidates,
            infeasible_rounds=infeasible,
            scored_rounds=sum(1 for r in trained if r.get("change_scores")),
            held_rounds=sum(1 for a in multipliers if a == 0.0),
        )
    return row


def table(rows: list[dict[str, Any]], metric: str, title: str) -> str:
    """Methods × learning rates, mean ± sd over seeds, the best mean per column in bold."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lrs = sorted({r["lr"] for r in rows})
    cells = {
        (m, lr): mean_sd([r[metric] for r in rows if r["method"] == m and r["lr"] == lr])
        for m in methods
        for lr in lrs
        if any(r["method"] == m and r["lr"] == lr for r in rows)
    }
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
        out.append(f"| {method_title(m)} | " + " | ".join(vals) + " |")
    fedtops = [r for r in rows if r["method"] == "fedtops"]
    if fedtops and metric == "accuracy" and "fedtops" in methods:
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
    evaluated = any(r.get("evaluation") and r["round"] > 0 for row in rows for r in read_rounds(row["run"]))
    fig, axes = plt.subplots(1, len(lrs), figsize=(4.2 * len(lrs), 3.4), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for m in methods:
            curves = [
                [(r["round"], r["evaluation"]["accuracy"]) for r in read_rounds(row["run"]) if r.get("evaluation")]
                for row in rows
                if row["method"] == m and row["lr"] == lr
            ]
            if not curves or not curves[0]:  # not evaluated during the runs (--eval-every 0)
                continue
            xs = [x for x, _ in curves[0]]
            ys = np.mean([[y for _, y in c] for c in curves], axis=0)
            ax.plot(xs, ys, marker="o", ms=3, label=method_title(m))
        ax.set_title(f"client learning rate {lr:g}")
        ax.set_xlabel("round")
    axes[0][0].set_ylabel("held-out greedy accuracy (%)")
    if evaluated:
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    if evaluated:  # not with --eval-every 0
        written.append(out / "accuracy_per_round.png")
        fig.savefig(written[-1], dpi=150)
    plt.close(fig)

    averaged = methods_with(rows, "aggregation_error")
    if averaged:  # the aggregation error per round, mean over seeds: mean factors (solid) and applied update (dashed)
        fig, axes = plt.subplots(1, len(lrs), figsize=(4.6 * len(lrs), 3.4), sharey=True, squeeze=False)
        for ax, lr in zip(axes[0], lrs):
            for i, m in enumerate(averaged):
                runs = [read_rounds(row["run"]) for row in rows if row["method"] == m and row["lr"] == lr]
                if not runs:
                    continue
                for key, style in (("aggregation-error", "-"), ("aggregation-error-applied", "--")):
                    per_run = [{r["round"]: 100 * r[key] for r in run if r["round"] > 0 and r.get(key) is not None} for run in runs]
                    xs = sorted(set().union(*per_run))
                    ys = [float(np.mean([d[x] for d in per_run if x in d])) for x in xs]
                    ax.plot(xs, ys, style, color=f"C{i}", marker="o", ms=2, label=method_title(m) if style == "-" else None)
            ax.set_yscale("log")
            ax.set_title(f"client learning rate {lr:g}")
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("aggregation error (% of the update)")
        axes[0][-1].legend(fontsize=7, title="solid: mean factors\ndashed: applied", title_fontsize=7)
        fig.tight_layout()
        written.append(out / "aggregation_error.png")
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


def grade_once(run: Path) -> None:
    """:func:`final_grades` of a run, unless it was graded before (the grid's ``post`` step)."""
    if not (run / GRADES).is_file():
        final_grades(run)


def run_cells(configs: dict, runs: dict, todo: list, jobs: int, describe) -> None:
    """:func:`eval.variants.run_cells` for grid cells: run each one in ``todo`` (or take its
    finished run) and grade its final adapter(s) per problem (:func:`grade_once`)."""
    failed = variants.run_cells(configs, runs, todo, jobs, describe, post=grade_once)
    if failed:  # the grid's tables and intervals need every cell
        raise RuntimeError("grid cells failed: " + "; ".join(f"{cell}: {error}" for cell, error in failed.items()))


def load_grades(rows: list[dict[str, Any]]) -> dict[tuple[str, float, int], dict[str, np.ndarray]]:
    """(method, lr, seed) -> that run's ``greedy`` and ``sampled`` per-problem grades."""
    out = {}
    for r in rows:
        path = Path(r["run"]) / GRADES
        if path.is_file():
            with np.load(path) as z:
                out[r["method"], r["lr"], r["seed"]] = {"greedy": z["greedy"], "sampled": z["sampled"]}
    return out


# The comparisons the intervals are for (fixed before the 5-seed grid was run): B − A.
COMPARISONS = (("fedavg", "fedtops"), ("local", "fedavg"))


def paired_grade_intervals(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]], seeds: list[int], draws: int) -> list[dict[str, Any]]:
    """B − A in percentage points for greedy accuracy and Avg@k, from the two methods' per-seed
    grades (``{"greedy": (problems,), "sampled": (problems, k)}``, paired by seed and problem): the
    mean, each seed's, and the 95 % intervals by seed (:func:`eval.bootstrap.seed_bootstrap`) and
    by problem (:func:`eval.bootstrap.problem_bootstrap`)."""
    from eval.bootstrap import problem_bootstrap, seed_bootstrap

    out = []
    for metric, key in (("accuracy", "greedy"), ("avg@k", "sampled")):
        ga = np.stack([g[key].reshape(len(g[key]), -1) for g in a])
        gb = np.stack([g[key].reshape(len(g[key]), -1) for g in b])
        diff, s_lo, s_hi = seed_bootstrap(ga, gb, draws)
        _, p_lo, p_hi = problem_bootstrap(ga, gb, draws)
        out.append(
            {
                "metric": metric,
                "seeds": seeds,
                "problems": int(ga.shape[1]),
                "difference": diff,
                "per_seed": (100 * (gb.mean(axis=(1, 2)) - ga.mean(axis=(1, 2)))).tolist(),
                "by_seed": [s_lo, s_hi],
                "by_problem": [p_lo, p_hi],
            }
        )
    return out


def intervals(rows: list[dict[str, Any]], draws: int = 5000) -> list[dict[str, Any]]:
    """Paired bootstrap intervals of B − A for each :data:`COMPARISONS` pair (and FedTOPS at each δ
    of a sweep − FedAvg) and learning rate, on
    the seeds both have: by seed (:func:`eval.bootstrap.seed_bootstrap`) and by problem
    (:func:`eval.bootstrap.problem_bootstrap`), for greedy accuracy and Avg@k."""
    grades = load_grades(rows)
    swept = swept_methods(rows)
    out = []
    for lr in sorted({r["lr"] for r in rows}):
        studied = [m for m in dict.fromkeys(r["method"] for r in rows) if m in METHODS and m not in DEFAULT_METHODS]
        # and each δ of a sweep against FedAvg, each variant against FedAvg and the paper's FedTOPS
        rules = [m for m in dict.fromkeys(r["method"] for r in rows) if m in TUNED]
        # the server-optimizer study's (docs/sandbox.md): FedTOPS − R and R − FedAvg for each rule R
        pairs = [*COMPARISONS, *(("fedavg", m) for m in swept), *((base, v) for v in studied for base in ("fedavg", "fedtops"))]
        pairs += [(m, "fedtops") for m in rules] + [("fedavg", m) for m in rules]
        for a, b in pairs:
            seeds = sorted({s for m, l, s in grades if m == a and l == lr} & {s for m, l, s in grades if m == b and l == lr})
            if not seeds:
                continue
            found = paired_grade_intervals([grades[a, lr, s] for s in seeds], [grades[b, lr, s] for s in seeds], seeds, draws)
            out += [{"lr": lr, "a": a, "b": b, **d} for d in found]
    return out


def intervals_table(found: list[dict[str, Any]], k: int) -> str:
    out = [
        "**Paired bootstrap, 95 % intervals (pp): by seed (seeds resampled) and by problem (problems resampled, the same for every seed)**",
        "",
        "| Difference | lr | metric | mean | by seed | by problem | per seed |",
        "|---|---|---|---:|---|---|---|",
    ]
    for d in found:
        metric = "greedy" if d["metric"] == "accuracy" else f"Avg@{k}"
        out.append(
            f"| {method_title(d['b'])} − {method_title(d['a'])} | {d['lr']:g} | {metric} | {d['difference']:+.1f} | "
            f"[{d['by_seed'][0]:+.1f}, {d['by_seed'][1]:+.1f}] | [{d['by_problem'][0]:+.1f}, {d['by_problem'][1]:+.1f}] | "
            + " ".join(f"{x:+.1f}" for x in d["per_seed"])
            + " |"
        )
    return "\n".join(out) + "\n"


def methods_with(rows: list[dict[str, Any]], key: str) -> list[str]:
    """The methods, in the rows' order, of which some row has a value for ``key``."""
    return [m for m in dict.fromkeys(r["method"] for r in rows) if any(r.get(key) is not None for r in rows if r["method"] == m)]


def step_table(rows: list[dict[str, Any]]) -> str:
    """Per averaging method and learning rate, means over rounds and seeds of the effective
    multiplier ‖θ_{t+1} − θ_t‖/‖Δ_t‖ and the step's cosine to Δ_t, and the mean wall time of a run's
    rounds; the tuned rules' chosen settings."""
    methods = methods_with(rows, "mean_effective_multiplier")
    if not methods:
        return ""
    lrs = sorted({r["lr"] for r in rows})
    out = [
        "**Where the step went: effective multiplier ‖θ_{t+1} − θ_t‖/‖Δ_t‖ / cosine to Δ_t (mean over rounds and seeds), and the rounds' wall time per run (s)**",
        "",
        "| Method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | " + " | ".join(f"s/run, lr {lr:g}" for lr in lrs) + " |",
        "|---|" + "---:|" * (2 * len(lrs)),
    ]
    for m in methods:
        cells, times = [], []
        for lr in lrs:
            sel = [r for r in rows if r["method"] == m and r["lr"] == lr]
            ratios = [r["mean_effective_multiplier"] for r in sel if r.get("mean_effective_multiplier") is not None]
            cosines = [r["mean_step_cosine"] for r in sel if r.get("mean_step_cosine") is not None]
            cells.append(f"{np.mean(ratios):.2f} / {np.mean(cosines):.2f}" if ratios and cosines else "–")
            times.append(f"{np.mean([r['seconds'] for r in sel]):.0f}" if sel and all("seconds" in r for r in sel) else "–")
        out.append(f"| {method_title(m)} | " + " | ".join(cells + times) + " |")
    chosen = sorted({(r["method"], r["lr"], json.dumps(r["settings"], sort_keys=True)) for r in rows if r.get("settings")})
    if chosen:
        out += ["", "Settings of the tuned rules (chosen on the tuning seeds):", ""]
        out += [
            f"- {method_title(m)}, lr {lr:g}: "
            + ", ".join(f"`{k}` = {v:g}" if isinstance(v, float) else f"`{k}` = {v}" for k, v in json.loads(text).items())
            for m, lr, text in chosen
        ]
    return "\n".join(out) + "\n"


def plot_steps(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Per round, mean over seeds: the effective multiplier (top, log scale) and the step's cosine
    to Δ_t (bottom) of every averaging method, one column per learning rate."""
    from server_app.run_folder import read_rounds

    methods = methods_with(rows, "mean_effective_multiplier")
    if not methods:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r["lr"] for r in rows})
    fig, axes = plt.subplots(2, len(lrs), figsize=(5.2 * len(lrs), 6.4), squeeze=False, sharex=True)
    for col, lr in enumerate(lrs):
        for i, m in enumerate(methods):
            runs = [read_rounds(r["run"]) for r in rows if r["method"] == m and r["lr"] == lr]
            for row_i in range(2):  # the effective multiplier, the cosine
                per_run = [{r["round"]: step_fields(r)[row_i] for r in run if r["round"] > 0 and step_fields(r)[row_i] is not None} for run in runs]
                xs = sorted(set().union(*per_run)) if per_run else []
                ys = [float(np.mean([d[x] for d in per_run if x in d])) for x in xs]
                if xs:
                    axes[row_i][col].plot(xs, ys, marker="o", ms=2, color=f"C{i}", label=method_title(m))
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"client learning rate {lr:g}")
        axes[1][col].set_xlabel("round")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("‖θ_{t+1} − θ_t‖ / ‖Δ_t‖")
    axes[1][0].set_ylabel("cosine(θ_{t+1} − θ_t, Δ_t)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path = out / "step_per_round.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def aggregation_table(rows: list[dict[str, Any]]) -> str:
    """Mean over rounds and seeds of the aggregation error (factor average vs average of the
    products) and of the applied update's, per averaging method and learning rate."""
    methods = methods_with(rows, "aggregation_error")
    if not methods:
        return ""
    lrs = sorted({r["lr"] for r in rows})
    out = [
        "**Aggregation error of averaging the LoRA factors (%, mean over rounds and seeds): mean factors / applied update**",
        "",
        "| Method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
        "|---|" + "---:|" * len(lrs),
    ]
    for m in methods:
        cells = []
        for lr in lrs:
            sel = [r for r in rows if r["method"] == m and r["lr"] == lr and r["aggregation_error"] is not None]
            if not sel:
                cells.append("–")
                continue
            mean = 100 * np.mean([r["aggregation_error"] for r in sel])
            applied = [r["aggregation_error_applied"] for r in sel if r["aggregation_error_applied"] is not None]
            cells.append(f"{mean:.2f} / {100 * np.mean(applied):.2f}" if applied else f"{mean:.2f} / –")
        out.append(f"| {method_title(m)} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def trust_budget_table(rows: list[dict[str, Any]], k: int) -> str:
    """Per δ and learning rate: final greedy and Avg@k (mean ± sd over seeds), mean selected a,
    held rounds, and the share of scored rounds in which each candidate was infeasible."""
    swept = swept_methods(rows)
    if not swept:
        return ""
    candidates = next(r["candidates"] for r in rows if r["method"] in swept)
    out = [
        "**Trust budget δ: final held-out scores (mean ± sd over seeds), mean selected a, rounds held, and % of "
        "scored rounds in which each candidate was infeasible**",
        "",
        "| lr | δ | greedy (%) | Avg@" + str(k) + " (%) | mean a | held | " + " | ".join(f"a={a:g}" for a in candidates) + " |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(candidates),
    ]
    for lr in sorted({r["lr"] for r in rows}):
        for m in swept:
            sel = [r for r in rows if r["method"] == m and r["lr"] == lr]
            if not sel:
                continue
            g, gs = mean_sd([r["accuracy"] for r in sel])
            v, vs = mean_sd([r[f"avg@{k}"] for r in sel])
            scored = sum(r["scored_rounds"] for r in sel)
            infeasible = [100 * sum(r["infeasible_rounds"][j] for r in sel) / scored for j in range(len(candidates))]
            delta = method_trust_budget(m)
            out.append(
                f"| {lr:g} | {delta_text(delta)} | {g:.1f} ± {gs:.1f} | {v:.1f} ± {vs:.1f} | "
                f"{np.mean([r['mean_multiplier'] for r in sel]):.2f} | {sum(r['held_rounds'] for r in sel)} | "
                + " | ".join(f"{x:.0f}" for x in infeasible)
                + " |"
            )
    return "\n".join(out) + "\n"


def change_scale_table(rows: list[dict[str, Any]]) -> str:
    """The scale δ is set against: per learning rate, quartiles over the scored rounds of every
    FedTOPS run (any δ) of max_i K̂_i(a), the client change that the trust constraint reads, per candidate."""
    from server_app.run_folder import read_rounds

    fedtops = [r for r in rows if r.get("candidates")]
    if not fedtops:
        return ""
    candidates = fedtops[0]["candidates"]
    out = [
        "**max_i K̂_i(a) over the scored rounds of every FedTOPS run: median [25th, 75th percentile] (nats)**",
        "",
        "| lr | rounds | " + " | ".join(f"a={a:g}" for a in candidates) + " |",
        "|---|---:|" + "---|" * len(candidates),
    ]
    for lr in sorted({r["lr"] for r in fedtops}):
        worst = np.asarray(
            [np.max(rec["change_scores"], axis=0) for r in fedtops if r["lr"] == lr for rec in read_rounds(r["run"]) if rec.get("change_scores")]
        )
        q = np.percentile(worst, [50, 25, 75], axis=0)
        out.append(f"| {lr:g} | {len(worst)} | " + " | ".join(f"{q[0, j]:.3g} [{q[1, j]:.3g}, {q[2, j]:.3g}]" for j in range(len(candidates))) + " |")
    return "\n".join(out) + "\n"


def plot_trust_budgets(rows: list[dict[str, Any]], out: Path, k: int) -> Path | None:
    """Final greedy accuracy and Avg@k against δ (mean ± sd over seeds, ∞ at the right end),
    one column per learning rate, with the FedAvg and Local levels (mean over the same seeds) as lines."""
    swept = swept_methods(rows)
    if not swept:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deltas = [method_trust_budget(m) for m in swept]
    finite = [d for d in deltas if np.isfinite(d) and d > 0]
    # positions on a log axis; ∞ (and 0) drawn one decade beyond (below) the finite values
    pos = (
        {d: d if np.isfinite(d) and d > 0 else (max(finite) * 10 if d > 0 else min(finite) / 10) for d in deltas}
        if finite
        else {d: i + 1 for i, d in enumerate(deltas)}
    )
    lrs = sorted({r["lr"] for r in rows})
    fig, axes = plt.subplots(2, len(lrs), figsize=(4.6 * len(lrs), 6.2), squeeze=False, sharex=True)
    for col, lr in enumerate(lrs):
        for row_i, (metric, label) in enumerate((("accuracy", "final greedy accuracy (%)"), (f"avg@{k}", f"final Avg@{k} (%)"))):
            ax = axes[row_i][col]
            stats = [
                mean_sd([r[metric] for r in rows if r["method"] == m and r["lr"] == lr])
                if any(r["method"] == m and r["lr"] == lr for r in rows)
                else (np.nan, 0.0)
                for m in swept
            ]
            ax.errorbar([pos[d] for d in deltas], [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3, label="FedTOPS")
            for ref, style in (("fedavg", "--"), ("local", ":")):
                vals = [r[metric] for r in rows if r["method"] == ref and r["lr"] == lr]
                if vals:
                    ax.axhline(np.mean(vals), linestyle=style, color="gray" if ref == "local" else "black", label=method_title(ref))
            if finite:
                ax.set_xscale("log")
            ax.set_xticks([pos[d] for d in deltas], [delta_text(d) for d in deltas])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row_i == 0:
                ax.set_title(f"client learning rate {lr:g}")
            else:
                ax.set_xlabel("trust budget δ")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = out / "trust_budget.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from fedopd.config.presets import add_run_config_option

    p = argparse.ArgumentParser(prog="python -m eval.sandbox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--lrs", type=floats, default=DEFAULT_LRS, help="comma-separated local learning rates")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument(
        "--trust-budgets",
        default="",
        metavar="0.01,0.05,inf",
        help="adds FedTOPS at each trust budget δ (inf: no constraint) as the methods fedtops-d<δ>",
    )
    p.add_argument("--seeds", type=ints, default=DEFAULT_SEEDS)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument(
        "--eval-every",
        type=int,
        default=DEFAULT_EVAL_EVERY,
        help="held-out evaluation during the runs every this many rounds; 0: none (the final adapters are graded after each run either way)",
    )
    p.add_argument("--jobs", type=int, default=2, help="grid cells run at once (one torch thread each)")
    p.add_argument("--out", type=Path, default=Path("sandbox-results"))
    p.add_argument(
        "--runs", type=Path, default=None, help="where the run folders live (default OUT/runs); grids that share it reuse each other's finished runs"
    )
    p.add_argument("--bootstrap", type=int, default=5000, help="bootstrap draws of the paired intervals")
    add_run_config_option(p, help="the setting of every cell, exactly as for `flwr run --run-config` (repeatable)")
    p.add_argument(
        "--tune",
        default="",
        metavar="fedadam,fedexp",
        help=f"run the declared sweep of these server optimizers (from: {', '.join(SWEEPS)}) and write OUT/tuned.json with the chosen setting per learning rate",
    )
    p.add_argument("--tuned", type=Path, default=None, help="a tuned.json written by --tune: the settings of the server optimizers in --methods")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    tune = [m.strip() for m in args.tune.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS and m not in TUNED] + [m for m in tune if m not in SWEEPS]
    if unknown:
        p.error(
            f"--methods / --tune: unknown {', '.join(repr(m) for m in unknown)}; allowed: {', '.join([*METHODS, *TUNED])} (--tune: {', '.join(SWEEPS)})"
        )
    if tune:  # the sweep's settings are the methods
        methods = [m for m in methods if m not in TUNED] if args.methods != ",".join(DEFAULT_METHODS) else []
        methods += [name for rule in tune for name in SWEEPS[rule]]
    tuned = None
    if args.tuned is not None:
        try:
            tuned = json.loads(args.tuned.read_text())
        except (OSError, ValueError) as err:
            p.error(f"--tuned {args.tuned}: {err}")
    if args.trust_budgets:
        try:
            methods += [trust_budget_method(d) for d in parse_trust_budgets(args.trust_budgets)]
        except ValueError as err:
            p.error(str(err))
    if args.rounds < 1 or args.eval_every < 0 or args.jobs < 1 or args.bootstrap < 1 or any(lr <= 0 for lr in args.lrs):
        p.error("--rounds, --jobs and --bootstrap must be >= 1, --eval-every >= 0 and every learning rate > 0")
    runs_root = args.runs or args.out / "runs"

    from fedopd.config import ConfigError, parse_run_config

    try:  # the grid is methods × learning rates × seeds of eval.variants; every config is valid before the first run
        base = {**grid_setting(args.run_config), "num-server-rounds": args.rounds, "eval.every": args.eval_every, "preset": "sandbox-grid"}
        planned = [  # per learning rate: a tuned rule's setting depends on it
            cell
            for lr in args.lrs
            for cell in variants.plan(
                base, [variants.Variant(m, method_settings(m, lr, tuned)) for m in methods], [("train.lr", (lr,))], args.seeds, runs_root
            )
        ]
        configs = {(c.variant, c.values[0][1], c.seed): c.config for c in planned}
        for config in configs.values():
            parse_run_config(dict(config))
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    cells = list(configs)
    runs = {cell: finished_run(runs_root, configs[cell]) for cell in cells}
    todo = [cell for cell in cells if runs[cell] is None or not (runs[cell] / GRADES).is_file()]
    fresh = sum(1 for cell in todo if runs[cell] is None)
    print(
        f"{len(cells) - fresh} of {len(cells)} runs already finished (reused); running {fresh} and grading {len(todo)} with {args.jobs} job(s)",
        flush=True,
    )

    def done(cell, run: Path) -> str:
        m, lr, s = cell
        return f"{m} lr {lr:g} seed {s}: greedy {result_row(m, lr, s, run)['accuracy']:.1f}%"

    run_cells(configs, runs, todo, args.jobs, done)
    rows = [result_row(m, lr, s, runs[m, lr, s]) for m, lr, s in cells]

    args.out.mkdir(parents=True, exist_ok=True)
    k = next(int(key[4:]) for key in rows[0] if key.startswith("avg@"))
    found = intervals(rows, args.bootstrap)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "intervals.json").write_text(json.dumps(found, indent=2) + "\n")
    parts = [
        table(rows, "accuracy", "Final held-out greedy accuracy (%), mean ± sd over seeds"),
        table(rows, f"avg@{k}", f"Final held-out Avg@{k} (%), mean ± sd over seeds"),
        intervals_table(found, k) if found else "",
        step_table(rows),
        aggregation_table(rows),
        trust_budget_table(rows, k),
        change_scale_table(rows),
    ]
    if tune:
        chosen, tuning = choose_settings(rows, k)
        (args.out / "tuned.json").write_text(json.dumps(chosen, indent=2) + "\n")
        parts.insert(0, tuning)
    text = "\n".join(part for part in parts if part)
    (args.out / "table.md").write_text(text)
    figures = plot(rows, args.out)
    figures += [f for f in (plot_trust_budgets(rows, args.out, k), plot_steps(rows, args.out)) if f]
    print()
    print(text)
    for path in [args.out / "results.json", args.out / "intervals.json", args.out / "table.md", *figures]:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
