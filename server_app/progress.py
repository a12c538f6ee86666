"""What a run shows while it runs: the per-round figure, TensorBoard scalars, the end-of-run summary.
(W&B and MLflow get the same scalars: :mod:`server_app.tracking`.)

All of it is read from the round records (``rounds.jsonl``), so the same functions serve a
finished run folder: ``python -m server_app.progress RUN_FOLDER`` redraws its figure.

Scalars per round (:func:`round_scalars`): held-out greedy accuracy and Avg@k (evaluated rounds),
the clients' OPD loss at the round's first and last mini-batch (and the exact KL before/after
with ``train.exact-kl``), FedTOPS's Ĵ at the selected multiplier, the multiplier, the aggregation
error of averaging the LoRA factors (% of the update; mean factors and applied update), round seconds,
and the round's communication in MB (10⁶ bytes): sent to and received from the clients, and per
phase (train, score, evaluate; sent + received). The figure shows the communication cumulated
over the run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedopd.core.strategies import capabilities
from server_app.traffic import PHASES, human_bytes, run_traffic, totals

FIGURE = "progress.png"
LABELS = {
    "clients/loss_first": "OPD loss, first mini-batch (at θ_t)",
    "clients/loss_last": "OPD loss, last mini-batch",
    "clients/kl_before": "KL on all rollouts, before",
    "clients/kl_after": "KL on all rollouts, after",
    "server/teacher_score_selected": "Ĵ(a_t) on the scoring caches",
    "server/aggregation_error": "mean factors: ‖Σw_iB_iA_i − B̄Ā‖ / ‖Σw_iB_iA_i − B_tA_t‖",
    "server/aggregation_error_applied": "applied update θ_t + a_tΔ_t",
    "comm/sent_mb": "sent to the clients",
    "comm/received_mb": "received from the clients",
    "comm/train_mb": "train (θ_t out, θ_t,i⁺ back)",
    "comm/score_mb": "score query (Δ_t out, Ĵ, K̂ back)",
    "comm/evaluate_mb": "evaluation (adapter out, metrics back)",
}
CUMULATIVE = ("comm/sent_mb", "comm/received_mb")  # drawn as running sums over the rounds


def _mean(values: Iterable[float]) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def round_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one round record that are plotted and logged (absent ones are left out)."""
    out: dict[str, float] = {}
    evaluation = record.get("evaluation") or {}
    for key, value in evaluation.items():
        if key == "accuracy" or key.startswith(("avg@", "pass@")):
            out[f"heldout/{'greedy' if key == 'accuracy' else key}"] = float(value)
    clients = record.get("clients") or []
    for key in ("loss", "loss_first", "loss_last", "kl_before", "kl_after"):
        value = _mean(c[key] for c in clients if key in c)
        if value is not None:
            out[f"clients/{key}"] = value
    a = record.get("multiplier")
    if a is not None:
        out["server/multiplier"] = float(a)
        candidates, scores = record.get("candidates") or [], record.get("teacher_scores") or []
        if a in candidates and len(scores) == len(candidates):
            out["server/teacher_score_selected"] = float(scores[candidates.index(a)])
    for key in ("aggregation-error", "aggregation-error-applied"):
        if record.get(key) is not None:
            out[f"server/{key.replace('-', '_')}"] = 100.0 * float(record[key])
    if record.get("step-cosine") is not None:  # where the step went relative to Δ_t (docs/strategies.md)
        out["server/step_cosine"] = float(record["step-cosine"])
    if (record.get("privacy") or {}).get("epsilon") is not None:  # None: ∞, nothing to plot
        out["privacy/epsilon"] = float(record["privacy"]["epsilon"])
    if "seconds" in record:
        out["server/round_seconds"] = float(record["seconds"])
    communication = record.get("communication")
    if communication:
        out["comm/sent_mb"] = communication["sent"] / 1e6
        out["comm/received_mb"] = communication["received"] / 1e6
        for phase in PHASES:
            if phase in communication:
                sent, received = totals(communication[phase])
                out[f"comm/{phase}_mb"] = (sent + received) / 1e6
    return out


def figure_series(rows: list[tuple[int, Mapping[str, float]]], key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) of scalar ``key`` over ``rows`` of (round, :func:`round_scalars`), the
    rounds that lack it left out; the :data:`CUMULATIVE` keys as running sums."""
    points = [(n, s[key]) for n, s in rows if key in s]
    x, y = [n for n, _ in points], [v for _, v in points]
    if key in CUMULATIVE:
        y = [sum(y[: i + 1]) for i in range(len(y))]
    return x, y


def draw(records: list[Mapping[str, Any]], path: str | Path, title: str) -> Path:
    """Write the run's figure (seven panels over rounds) atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = [(int(r["round"]), round_scalars(r)) for r in records]
    fig = Figure(figsize=(20, 7), layout="constrained")
    axes = fig.subplots(2, 4, sharex=True)
    panels = [
        (axes[0, 0], "held-out accuracy (%)", ["heldout/greedy"] + sorted({k for _, s in rows for k in s if k.startswith("heldout/avg@")})),
        (
            axes[0, 1],
            "KL to the teacher (nats per token)",
            ["clients/loss_first", "clients/loss_last", "clients/kl_before", "clients/kl_after", "server/teacher_score_selected"],
        ),
        (axes[0, 2], "selected multiplier a", ["server/multiplier"]),
        (axes[0, 3], "error of averaging the LoRA factors (% of the update)", ["server/aggregation_error", "server/aggregation_error_applied"]),
        (axes[1, 0], "round time (s)", ["server/round_seconds"]),
        (axes[1, 1], "communication since round 0 (MB, all clients)", list(CUMULATIVE)),
        (axes[1, 2], "communication per round by phase (MB, sent + received)", [f"comm/{phase}_mb" for phase in PHASES]),
    ]
    axes[1, 3].set_visible(False)
    stacked = axes[1, 2]  # a bar per round, one segment per phase
    for ax, label, keys in panels:
        drawn = False
        bottom: dict[int, float] = {}
        for key in dict.fromkeys(keys):
            x, y = figure_series(rows, key)
            if x and ax is stacked:
                ax.bar(x, y, bottom=[bottom.get(n, 0.0) for n in x], width=0.6, label=LABELS.get(key, key.split("/", 1)[1]))
                for n, v in zip(x, y):
                    bottom[n] = bottom.get(n, 0.0) + v
                drawn = True
            elif x:
                ax.plot(x, y, marker="o", ms=3, label=LABELS.get(key, key.split("/", 1)[1]))
                drawn = True
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if bottom and max(bottom.values()) > 0:
            ax.set_ylim(0, 1.45 * max(bottom.values()))  # room for the legend above the bars
        if drawn and len(keys) > 1:
            ax.legend(fontsize=8, loc="upper left" if bottom else "best")
        if not drawn:
            ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes, alpha=0.6)
    for ax in axes[1]:
        ax.set_xlabel("round")
    fig.suptitle(title, fontsize=11)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    os.replace(tmp, path)
    return path


def run_title(config: Mapping[str, Any]) -> str:
    """Strategy, δ or a, learning rate, models: what tells two runs' figures apart."""
    name = config.get("strategy.name", "?")
    what = {
        "fedtops": f"FedTOPS δ = {config.get('strategy.trust-budget')}",
        "fixed": f"fixed a = {config.get('strategy.multiplier')}",
    }.get(name, name)
    return f"{what}, lr {config.get('train.lr')}, {config.get('model.student')} ← {config.get('model.teacher')}, seed {config.get('seed')}"


def run_summary(records: list[Mapping[str, Any]], strategy: str, folder: Path, seconds: float) -> list[str]:
    """A few lines for the end of a run: rounds, multipliers, held-out accuracy, the bytes sent to
    and received from the clients (in all and by phase), the folder."""
    trained = [r for r in records if r["round"] > 0]
    lines = [f"Run summary: {len(trained)} round{'' if len(trained) == 1 else 's'} of {strategy} in {seconds:.0f} s"]
    multipliers = [r.get("multiplier") for r in trained]
    if any(a is not None for a in multipliers):
        shown = ", ".join("-" if a is None else f"{a:g}" for a in multipliers)
        lines.append(f"  {'selected ' if capabilities(strategy).score_phase else ''}multipliers: {shown}")  # chosen by a score phase, or fixed
    evaluated = [r for r in records if "accuracy" in (r.get("evaluation") or {})]
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        lines.append(
            f"  held-out greedy accuracy: {first['evaluation']['accuracy']:.1f}% (round {first['round']}) -> "
            f"{last['evaluation']['accuracy']:.1f}% (round {last['round']})"
        )
    private = [r["privacy"] for r in trained if "delta" in (r.get("privacy") or {})]
    if private:
        eps = private[-1].get("epsilon")
        lines.append(
            f"  differential privacy: ε = {'∞' if eps is None else f'{eps:.3g}'} at δ = {private[-1]['delta']:g} "
            f"after {private[-1]['releases']} Gaussian releases in {len(private)} rounds (docs/privacy.md)"
        )
    traffic = run_traffic(records)
    if "total" in traffic:
        total = traffic["total"]
        lines.append(f"  communication: {human_bytes(total['sent'])} sent to clients, {human_bytes(total['received'])} received from them")
        by_phase = ", ".join(
            f"{phase} {human_bytes(traffic[phase]['sent'])} / {human_bytes(traffic[phase]['received'])}" for phase in PHASES if phase in traffic
        )
        lines.append(f"    by phase (sent / received): {by_phase}")
    lines.append(f"  run folder: {folder}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import json

    from server_app.run_folder import read_rounds

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m server_app.progress RUN_FOLDER   (redraws RUN_FOLDER/progress.png)", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    if not (folder / "rounds.jsonl").is_file():
        print(f"error: '{folder}' is not a run folder (no rounds.jsonl)", file=sys.stderr)
        return 2
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    print(draw(read_rounds(folder), folder / FIGURE, run_title(config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
