"""Variants side by side: one base config, the keys to vary, seeds; one table and one figure.

    python -m eval.variants [-c FILE.toml | -c "k=v ..."] \\
        [--variant "NAME: k=v k=v"] ... [--vary KEY=V1,V2] ... [--seeds 0,1] \\
        [--num-clients 3] [--jobs 2] [--out variants]

``-c``/``--run-config`` (repeatable, exactly as for ``flwr run``) is the base every variant starts
from, over the app's defaults. ``--variant`` names one set of overrides (Flower's run-config syntax
after ``NAME:``); ``--vary KEY=V1,V2`` crosses every variant with each value of the key (values in
TOML syntax; a bare word is a string). Every (variant, values, seed) is one run.

Runs go through the app's own ServerApp, ClientApp and strategies in this process
(:mod:`server_app.inprocess`), never through a SuperLink, so a set of variants cannot wedge the
local SuperLink that ``flwr run`` uses, and a failed run is reported as failed.
``--jobs`` runs that many at once in fresh single-threaded interpreters (docs/running.md: which is
faster on 2 cores). Every configuration is validated before the first run starts. A finished run
with the same resolved configuration anywhere under ``--runs`` (default ``OUT/runs``) is reused;
``logging.*`` and ``output-dir`` do not count, since they change where a run is reported, not what
it computes.

Writes to ``--out``: ``results.json`` (one row per run), ``table.md`` (per variant, mean ± sd over
seeds of the final held-out greedy accuracy, Avg@k and Pass@k, and the run folders) and
``heldout.png`` (held-out greedy accuracy per round, mean over seeds, one line per variant).
:mod:`eval.sandbox` (the paper's grid) is one use of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
FIXED_KEYS = ("seed", "output-dir")  # set per run by this command: --seeds, --runs
NOT_COMPARED = ("output-dir",)  # keys that do not change what a run computes (plus logging.*)


@dataclass(frozen=True)
class Variant:
    """A named set of run-config overrides."""

    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)  # hashed by identity: a dict key of the run it maps to
class Cell:
    """One run of the comparison: a variant, its ``--vary`` values, a seed, and its full run config."""

    variant: str
    values: tuple[tuple[str, Any], ...]
    seed: int
    config: Mapping[str, Any]

    @property
    def label(self) -> str:
        """The variant with its ``--vary`` values (the table's row)."""
        return " ".join([self.variant, *(f"{k}={_text(v)}" for k, v in self.values)])

    @property
    def folder_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._+=-]+", "_", "-".join([self.variant, *(f"{k}={_text(v)}" for k, v in self.values), f"seed{self.seed}"]))


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _value(text: str) -> Any:
    """A ``--vary`` value: TOML syntax (``3e-4``, ``true``, ``'a b'``), else the bare word as a string."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


SCALARS = (str, bool, int, float)


def _values(rest: str) -> tuple[Any, ...]:
    """The values after ``KEY=``: a TOML array's items when ``[rest]`` is one of scalars (so
    ``'a,b','c'`` keeps its quoted comma), else each comma-separated item as a TOML scalar or, when
    it is none (a bare word, a date), as the text itself."""
    import tomllib

    try:
        items = tomllib.loads(f"v = [{rest}]")["v"]
        if items and all(isinstance(v, SCALARS) for v in items):
            return tuple(items)
    except tomllib.TOMLDecodeError:
        pass
    out = []
    for item in (x.strip() for x in rest.split(",")):
        value = _value(item)
        out.append(value if isinstance(value, SCALARS) else item)
    return tuple(out)


def parse_vary(text: str) -> tuple[str, tuple[Any, ...]]:
    """``KEY=V1,V2,...`` -> (key, values); a ValueError names what is wrong."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    values = _values(rest) if sep and rest.strip() else ()
    if not key or not sep or not values or any(v == "" for v in values):
        raise ValueError(f"--vary {text!r}: expected KEY=V1,V2,... (e.g. train.lr=3e-4,3e-3)")
    if key in FIXED_KEYS:
        raise ValueError(f"--vary {key}: set by this command ({'--seeds' if key == 'seed' else '--runs'})")
    if any(a == b for i, a in enumerate(values) for b in values[i + 1 :]):
        raise ValueError(f"--vary {key}: a value is repeated")
    return key, values


def parse_variant(text: str) -> Variant:
    """``NAME: k=v k=v`` (Flower's run-config syntax after the colon; nothing after it: the base)."""
    from fedopd.config.presets import overrides_from_args

    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not NAME.fullmatch(name):
        raise ValueError(f"--variant {text!r}: expected 'NAME: k=v k=v' with NAME of letters, digits, '.', '_', '+', '-'")
    overrides = overrides_from_args([rest.strip()]) if rest.strip() else {}
    fixed = sorted(set(overrides) & set(FIXED_KEYS))
    if fixed:
        raise ValueError(f"--variant {name}: sets {', '.join(fixed)}, which this command sets itself (--seeds, --runs)")
    return Variant(name, overrides)


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``: integers >= 0; a ValueError names the bad one."""
    seeds = []
    for item in (x.strip() for x in text.split(",")):
        if not item.isdigit():
            raise ValueError(f"--seeds: {item!r} is not an integer >= 0")
        seeds.append(int(item))
    return seeds


def plan(
    base: Mapping[str, Any],
    variants: Sequence[Variant],
    vary: Sequence[tuple[str, Sequence[Any]]],
    seeds: Sequence[int],
    runs_root: Path,
    num_clients: int | None = None,
) -> list[Cell]:
    """Every (variant, --vary values, seed), variants outermost; each config is ``base``, then the
    variant's overrides, then the values, then the seed and its folder under ``runs_root``;
    ``num_clients`` (when given) where the config leaves ``num-clients`` at 0. Two runs that would
    share a folder are refused."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"--variant: a name is repeated ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError("--seeds: give at least one seed, none repeated")
    keys = [k for k, _ in vary]
    if len(set(keys)) != len(keys):
        raise ValueError("--vary: a key is given twice")
    fixed = sorted(set(base) & set(FIXED_KEYS))
    if fixed:
        raise ValueError(f"--run-config sets {', '.join(fixed)}, which this command sets itself (--seeds, --runs)")
    cells = []
    for variant in variants:
        for values in itertools.product(*(vals for _, vals in vary)):
            pairs = tuple(zip(keys, values))
            for seed in seeds:
                config = {**base, **variant.overrides, **dict(pairs), "seed": int(seed)}
                if not config.get("logging.run-name"):  # the trackers' name of the run: what the table calls it
                    config["logging.run-name"] = f"{Cell(variant.name, pairs, int(seed), {}).label} seed {int(seed)}"
                if num_clients is not None and not config.get("num-clients"):
                    config["num-clients"] = num_clients  # in process no SuperNodes are counted: the run's own number, compared on reuse
                cell = Cell(variant.name, pairs, int(seed), config)
                cells.append(Cell(variant.name, pairs, int(seed), {**config, "output-dir": str(runs_root / cell.folder_name)}))
    folders = [c.config["output-dir"] for c in cells]
    same = sorted({f for f in folders if folders.count(f) > 1})
    if same:
        raise ValueError(f"two runs would share the folder {same[0]!r}: give the variants or values names that differ in letters or digits")
    return cells


def comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved run config without where the run was written or reported (``output-dir``, ``logging.*``)."""
    from fedopd.config import parse_run_config

    resolved = parse_run_config(dict(config)).to_run_config()
    return {k: v for k, v in resolved.items() if k not in NOT_COMPARED and not k.startswith("logging.")}


def finished_run(folder: Path, config: Mapping[str, Any]) -> Path | None:
    """A run folder anywhere under ``folder`` with this resolved config (:func:`comparable`) that
    completed (``status.json``) with its last round done (and evaluated, unless ``eval.every`` is 0)."""
    from fedopd.config import ConfigError, parse_run_config
    from server_app.run_folder import read_rounds, read_run_config, read_status

    want = comparable(config)
    cfg = parse_run_config(dict(config))
    for path in sorted(folder.rglob("config.json")) if folder.is_dir() else []:
        run = path.parent
        try:
            if comparable(read_run_config(run)) != want:
                continue
            rounds = read_rounds(run)
        except (OSError, ValueError, ConfigError):
            continue
        done = read_status(run).get("status") in ("completed", "budget-spent")
        if done and rounds and rounds[-1]["round"] == cfg.num_server_rounds and (rounds[-1].get("evaluation") or not cfg.eval.every):
            return run
    return None


def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)


def newest_run(folder: Path) -> Path | None:
    """The newest run folder (``config.json``) directly under ``folder``, if any."""
    runs = [p.parent for p in Path(folder).glob("*/config.json")] if Path(folder).is_dir() else []
    return max(runs, key=lambda p: (p / "config.json").stat().st_mtime, default=None)


def run_cell(
    config: Mapping[str, Any] | None, run: Path | None = None, num_clients: int = 3, post: Callable[[Path], Any] | None = None
) -> tuple[Path | None, float, str | None]:
    """Run ``config`` in process (or take the finished ``run``), then ``post(run)``: (run folder,
    seconds, None), or where the run raised (run folder if it made one, seconds, the error: the
    run folder's ``status.json`` says ``failed``; ``post`` is skipped)."""
    from server_app.inprocess import run_in_process

    t0 = time.perf_counter()
    if run is None:
        try:
            run = run_in_process(config, num_clients=num_clients)
        except Exception as err:  # noqa: BLE001 - one failed run is a row of the table, not the end of the command
            return newest_run(Path(config["output-dir"])), time.perf_counter() - t0, f"{type(err).__name__}: {err}"
    if post is not None:
        post(run)
    return run, time.perf_counter() - t0, None


def num_clients_of(config: Mapping[str, Any], default: int = 3) -> int:
    """The clients of an in-process run: ``num-clients``, or ``default`` where it is 0 (all SuperNodes)."""
    return int(config.get("num-clients") or default)


def run_cells(
    configs: Mapping[Any, Mapping[str, Any]],
    runs: dict[Any, Path | None],
    todo: Sequence[Any],
    jobs: int,
    describe: Callable[[Any, Path], str],
    post: Callable[[Path], Any] | None = None,
    num_clients: int = 3,
) -> dict[Any, str]:
    """Run the cells in ``todo`` (or only ``post`` them where ``runs[cell]`` is already a run),
    ``jobs`` at once in fresh single-threaded interpreters; ``runs[cell]`` becomes each one's run
    folder (None for a run that failed before making one), and ``[i/n] describe(cell, run)`` with
    its seconds is printed as each finishes. Returns the error of each cell whose run failed.
    ``post`` must be a module-level function (it is pickled to the workers)."""
    failed: dict[Any, str] = {}
    if not todo:
        return failed
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    started = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch or grader state
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_single_thread) as pool:
        futures = {pool.submit(run_cell, configs[c], runs[c], num_clients_of(configs[c], num_clients), post): c for c in todo}
        for i, future in enumerate(as_completed(futures), 1):
            cell = futures[future]
            runs[cell], seconds, error = future.result()
            so_far = f"{seconds:.0f} s; {time.perf_counter() - started:.0f} s so far"
            if error is not None:
                failed[cell] = error
                print(f"[{i}/{len(todo)}] FAILED: {error} ({runs[cell] or 'no run folder'}; {so_far})", flush=True)
            else:
                print(f"[{i}/{len(todo)}] {describe(cell, runs[cell])} ({so_far})", flush=True)
    return failed


def open_shared_stores(configs: Sequence[Mapping[str, Any]]) -> None:
    """Create, in this process, each MLflow store and experiment that runs at once will share
    (``logging.mlflow`` with a ``logging.mlflow-uri`` or ``MLFLOW_TRACKING_URI``): a new sqlite
    store's tables are made on first use, and two runs making them together collide."""
    import os

    from fedopd.config import parse_run_config
    from server_app.tracking import destinations, mlflow_experiment

    seen = set()
    for config in configs:
        cfg = parse_run_config(dict(config))
        if not cfg.logging.mlflow or not (cfg.logging.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")):
            continue  # off, or one store per run folder
        where = destinations(cfg.logging, os.environ, Path(cfg.output_dir))
        if not where.mlflow_uri.startswith("sqlite:") or (where.mlflow_uri, where.mlflow_experiment) in seen:
            continue  # a tracking server makes its own tables
        seen.add((where.mlflow_uri, where.mlflow_experiment))
        try:
            mlflow_experiment(where.mlflow_uri, where.mlflow_experiment)
        except Exception as err:  # noqa: BLE001 - tracking never stops a run: each run reports its tracker's failure
            print(f"warning: could not open the MLflow store {where.mlflow_uri}: {type(err).__name__}: {err}", file=sys.stderr)


# -- results ---------------------------------------------------------------------------------


def final_scores(run: Path) -> dict[str, Any]:
    """A run's last held-out evaluation (greedy ``accuracy``, ``avg@k``, ``pass@k`` in %), its
    round, the rounds recorded, the run's status, and the seconds its rounds and evaluations took
    (start-up not included); scores None when never evaluated."""
    from server_app.run_folder import read_rounds, read_status

    rounds = read_rounds(run)
    evaluated = [r for r in rounds if r.get("evaluation")]
    last = evaluated[-1] if evaluated else None
    status = read_status(run) if (run / "status.json").is_file() else {}
    return {
        "evaluation": dict(last["evaluation"]) if last else None,
        "evaluated_round": last["round"] if last else None,
        "rounds": rounds[-1]["round"] if rounds else 0,
        "status": status.get("status"),
        "seconds": float(sum((r.get("seconds") or 0.0) + (r.get("eval_seconds") or 0.0) for r in rounds)),
    }


def result_rows(cells: Sequence[Cell], runs: Mapping[Cell, Path | None], errors: Mapping[Cell, str] | None = None) -> list[dict[str, Any]]:
    """One ``results.json`` row per run (a run that failed before making a folder: status
    ``failed``, no scores; ``error``: why a run failed in this call)."""
    errors = errors or {}
    rows = []
    for c in cells:
        run = runs[c]
        scores = final_scores(run) if run is not None else {"evaluation": None, "evaluated_round": None, "rounds": 0, "status": None, "seconds": 0.0}
        if c in errors and scores["status"] in (None, "running"):
            scores["status"] = "failed"
        row = {"variant": c.variant, "label": c.label, "values": dict(c.values), "seed": c.seed, "run": str(run) if run else None, **scores}
        if c in errors:
            row["error"] = errors[c]
        rows.append(row)
    return rows


def _k(rows: Sequence[Mapping[str, Any]]) -> int | None:
    for r in rows:
        for key in r.get("evaluation") or {}:
            if key.startswith("avg@"):
                return int(key[4:])
    return None


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per label: final held-out greedy, Avg@k and Pass@k as mean ± sd over seeds (the best mean of
    each column in bold), the seeds, and the mean minutes of a run."""
    k = _k(rows)
    metrics = ["accuracy", *([f"avg@{k}", f"pass@{k}"] if k else [])]
    titles = {"accuracy": "greedy (%)", f"avg@{k}": f"Avg@{k} (%)", f"pass@{k}": f"Pass@{k} (%)"}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cells: dict[tuple[str, str], tuple[float, float] | None] = {}
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        for m in metrics:
            vals = [r["evaluation"][m] for r in mine if r.get("evaluation") and m in r["evaluation"]]
            cells[label, m] = mean_sd(vals) if len(vals) == len(mine) else None
    best = {m: max((round(v[0], 1) for (lab, mm), v in cells.items() if mm == m and v), default=None) for m in metrics}
    out = ["| Variant | " + " | ".join(titles[m] for m in metrics) + " | seeds | min/run |", "|---|" + "---:|" * (len(metrics) + 2)]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        vals = []
        for m in metrics:
            v = cells[label, m]
            if v is None:
                vals.append("–")
                continue
            text = f"{v[0]:.1f} ± {v[1]:.1f}"
            vals.append(f"**{text}**" if len(labels) > 1 and round(v[0], 1) == best[m] else text)
        minutes = np.mean([r["seconds"] for r in mine]) / 60
        seeds = ",".join(str(r["seed"]) for r in mine)
        out.append(f"| {label} | " + " | ".join(vals) + f" | {seeds} | {minutes:.1f} |")
    failed = [r for r in rows if r.get("status") not in ("completed", "budget-spent")]
    notes = [f"- {r['label']} seed {r['seed']}: {r.get('status') or 'no status'} ({r.get('run') or 'no run folder'})" for r in failed]
    return "\n".join(out) + "\n" + ("\nDid not complete:\n" + "\n".join(notes) + "\n" if notes else "")


def plot_heldout(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Held-out greedy accuracy per round, mean over seeds (band: min to max), one line per label;
    None when no run was evaluated during training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from server_app.run_folder import read_rounds

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    drawn = 0
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        curves = [
            {r["round"]: r["evaluation"]["accuracy"] for r in read_rounds(row["run"]) if r.get("evaluation")}
            for row in rows
            if row["label"] == label and row.get("run")
        ]
        xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not xs:
            continue
        ys = np.array([[c[x] for x in xs] for c in curves])
        ax.plot(xs, ys.mean(axis=0), marker="o", ms=3, color=f"C{i}", label=f"{label} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        if len(curves) > 1:
            ax.fill_between(xs, ys.min(axis=0), ys.max(axis=0), color=f"C{i}", alpha=0.15, linewidth=0)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("round")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


# -- the command -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from fedopd.config import ConfigError, parse_run_config
    from fedopd.config.parse import check_local_prompts, check_server_requirements
    from fedopd.config.presets import add_run_config_option, overrides_from_args

    p = argparse.ArgumentParser(prog="python -m eval.variants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_config_option(p, help="the base config of every variant, exactly as for `flwr run --run-config` (repeatable)")
    p.add_argument(
        "--variant", action="append", default=[], metavar="'NAME: k=v k=v'", help="a named set of overrides (repeatable); none: the base alone"
    )
    p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2", help="cross every variant with these values of KEY (repeatable)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; every variant runs once per seed (default 0)")
    p.add_argument("--num-clients", type=int, default=3, help="clients of a run whose num-clients is 0 (default 3, as `make run`)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own single-threaded interpreter (default 1)")
    p.add_argument("--out", type=Path, default=Path("variants"))
    p.add_argument(
        "--runs", type=Path, default=None, help="where the run folders live (default OUT/runs); finished runs anywhere under it are reused"
    )
    p.add_argument("--dry-run", action="store_true", help="validate and list the runs (reused or to run), run nothing")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.num_clients < 1:
        p.error("--jobs and --num-clients must be >= 1")
    runs_root = args.runs or args.out / "runs"
    try:  # every configuration is valid before the first run starts
        seeds = parse_seeds(args.seeds)
        base = overrides_from_args(args.run_config) if args.run_config else {}
        variants = [parse_variant(v) for v in args.variant] or [Variant("base")]
        ignored = sorted(set(base) & set(FIXED_KEYS))
        if ignored:  # a preset file names them for flwr run; here --seeds and --runs do
            print(f"note: the base config's {', '.join(ignored)} are set by this command (--seeds, --runs): ignored", file=sys.stderr)
            base = {k: v for k, v in base.items() if k not in FIXED_KEYS}
        cells = plan(base, variants, [parse_vary(v) for v in args.vary], seeds, runs_root, num_clients=args.num_clients)
        checked: dict[str, None] = {}
        for cell in cells:  # the keys, the ServerApp's needs and the prompt files' contents, as each run's ServerApp checks them
            cfg = parse_run_config(dict(cell.config))
            check_server_requirements(cfg)
            data_key = json.dumps(
                {k: v for k, v in cfg.to_run_config().items() if k.split(".")[0] in ("data", "eval", "rollout", "cache", "strategy", "num-clients")},
                sort_keys=True,
                default=str,
            )
            if data_key not in checked:
                check_local_prompts(cfg, num_clients_of(cell.config, args.num_clients), fetch=True)
                checked[data_key] = None
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    runs: dict[Cell, Path | None] = {c: finished_run(runs_root, c.config) for c in cells}
    todo = [c for c in cells if runs[c] is None]
    doing = "would run" if args.dry_run else "running"
    print(f"{len(cells) - len(todo)} of {len(cells)} runs already finished (reused); {doing} {len(todo)} with {args.jobs} job(s)", flush=True)
    if args.dry_run:
        for c in cells:
            print(f"  {c.label} seed {c.seed}: {runs[c] or 'to run'}")
        return 0

    def done(cell: Cell, run: Path) -> str:
        score = final_scores(run)
        tail = f"greedy {score['evaluation']['accuracy']:.1f}%" if score["evaluation"] else "not evaluated"
        return f"{cell.label} seed {cell.seed}: {score['status']}, {tail} ({run})"

    if args.jobs > 1:
        open_shared_stores([c.config for c in todo])
    errors = run_cells({c: c.config for c in cells}, runs, todo, args.jobs, done, num_clients=args.num_clients)
    rows = result_rows(cells, runs, errors)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = comparison_table(rows)
    (args.out / "table.md").write_text(text)
    figure = plot_heldout(rows, args.out / "heldout.png")
    print()
    print(text)
    for path in [args.out / "results.json", args.out / "table.md", *([figure] if figure else [])]:
        print(path)
    return 0 if all(r["status"] in ("completed", "budget-spent") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
