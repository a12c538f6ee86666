"""python -m eval.run on the tiny models and a small local benchmark, then python -m eval.report."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedopd.config import LoraSettings
from fedopd.models import attach_lora, load_causal_lm, save_adapter

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def _run(*args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    rows = [
        {"problem": "What is 2 + 3?", "answer": "5"},
        {"question": "Compute 3 times 4.", "final_answer": ["12"]},
        {"problem": "What is 10 - 4?", "answer": r"\boxed{6}"},
    ]
    (root / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    student = attach_lora(load_causal_lm("builtin:tiny-student"), LoraSettings(), seed=3)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(a.shape).astype(np.float32) * 0.1 for n, a in student.get_lora_arrays().items()}
    save_adapter(root / "run" / "round-001", arrays, student.lora_config)
    # A run folder for the selection figures.
    rounds = [
        {
            "round": t,
            "strategy": "fedtops",
            "multiplier": a,
            "candidates": [0.5, 1.0, 2.0],
            "teacher_scores": [0.3, 0.2, 0.2 - 0.01 * t],
            "change_scores": [[0.0, 0.01, 0.02 * t]],
            "fallback": False,
        }
        for t, a in ((1, 2.0), (2, 2.0), (3, 1.0))
    ]
    (root / "run" / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (root / "run" / "config.json").write_text(json.dumps({"strategy.name": "fedtops", "strategy.trust-budget": 0.05}))
    return root


@pytest.fixture(scope="module")
def eval_output(workspace):
    return _run(
        "eval.run",
        "--model",
        "builtin:tiny-student",
        "--base",
        "--adapter",
        str(workspace / "run" / "round-001"),
        "--label",
        "trained",
        "--benchmark-file",
        f"tiny={workspace / 'tiny.jsonl'}",
        "--samples",
        "4",
        "--max-new-tokens",
        "12",
        "--out",
        str(workspace / "results"),
        "--no-progress",
    )


def test_eval_run_writes_graded_responses_and_a_summary(workspace, eval_output):
    out = eval_output
    assert "base: macro Avg@4" in out and "trained: macro Avg@4" in out
    for label in ("base", "trained"):
        records = [json.loads(l) for l in (workspace / "results" / label / "responses.jsonl").read_text().splitlines()]
        assert len(records) == 3 * 4
        assert {r["gold"] for r in records} == {"5", "12", "6"}
        assert all(set(r) >= {"response", "correct", "capped", "response_tokens"} for r in records)
        summary = json.loads((workspace / "results" / label / "summary.json").read_text())
        tiny = summary["benchmarks"]["tiny"]
        assert tiny["problems"] == 3 and tiny["samples"] == 4
        assert tiny["cap_hit"] == pytest.approx(100 * np.mean([r["capped"] for r in records]))
        assert summary["sampling"]["top_p"] == 0.8 and summary["sampling"]["seed"] == 0
        assert summary["sampling"]["stop_tokens"] == ["<|im_end|>"]  # the tiny student's own EOS, no --teacher
    base = [json.loads(l)["response"] for l in (workspace / "results" / "base" / "responses.jsonl").read_text().splitlines()]
    trained = [json.loads(l)["response"] for l in (workspace / "results" / "trained" / "responses.jsonl").read_text().splitlines()]
    assert base != trained  # the adapter is applied


def test_eval_report_writes_tables_and_figures(workspace, eval_output):
    report = workspace / "report"
    _run(
        "eval.report",
        "--summary",
        f"Base={workspace / 'results' / 'base' / 'summary.json'}",
        "--summary",
        f"Trained={workspace / 'results' / 'trained' / 'summary.json'}",
        "--run",
        str(workspace / "run"),
        "--out",
        str(report),
    )
    for metric in ("avg_at_k", "pass_at_k", "cap_hit"):
        for ext in ("md", "csv", "tex"):
            assert (report / f"{metric}.{ext}").stat().st_size > 0
    md = (report / "cap_hit.md").read_text()
    assert "| Method | tiny | Macro |" in md and "| Base |" in md and "| Trained |" in md
    assert r"\begin{tabular}{lrr}" in (report / "avg_at_k.tex").read_text()
    for fig in ("run-multiplier.png", "run-scores.png"):
        assert (report / fig).read_bytes()[:4] == b"\x89PNG"


def test_report_tables_bold_the_best_and_compute_macro_over_benchmarks():
    from eval.report import build_table, render

    summaries = {
        "A": {"benchmarks": {"math500": {"avg_at_k": 40.0, "cap_hit": 5.0}, "aime24": {"avg_at_k": 10.0, "cap_hit": 1.0}}},
        "B": {"benchmarks": {"math500": {"avg_at_k": 45.0, "cap_hit": 2.0}, "aime24": {"avg_at_k": 2.0, "cap_hit": 3.0}}},
    }
    columns, labels, rows = build_table(summaries, "avg_at_k")
    assert columns == ["MATH500", "AIME24", "Macro"] and labels == ["A", "B"]
    assert rows == [[40.0, 10.0, 25.0], [45.0, 2.0, 23.5]]
    md = render(columns, labels, rows, "avg_at_k", "md", "Avg@8")
    assert "| A | 40.00 | **10.00** | **25.00** |" in md and "| B | **45.00** | 2.00 | 23.50 |" in md
    cap = render(*build_table(summaries, "cap_hit"), "cap_hit", "md", "Cap-hit")
    assert "| B | **2.00** | 3.00 | **2.50** |" in cap  # lower is better


def test_score_colour_scale_is_the_papers_and_its_ticks_do_not_crowd():
    from eval.report import SCORE_LINTHRESH, score_ticks

    assert SCORE_LINTHRESH == 0.002  # the paper's linear range, nats
    assert score_ticks(0.02) == pytest.approx([-0.02, -0.002, 0.0, 0.002, 0.02])
    assert score_ticks(5.32) == pytest.approx([-2, -0.2, -0.02, -0.002, 0, 0.002, 0.02, 0.2, 2])  # 5.32: too close to 2
    assert score_ticks(0.5) == pytest.approx([-0.2, -0.02, -0.002, 0, 0.002, 0.02, 0.2])
    assert score_ticks(1.5) == pytest.approx([-1.5, -0.2, -0.02, -0.002, 0, 0.002, 0.02, 0.2, 1.5])  # far enough: shown


def test_report_panels_share_one_colour_range(tmp_path):
    import json

    from eval.report import score_range

    def run(name, diffs):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"strategy.trust-budget": 0.05}))
        rows = [
            {"round": 1, "candidates": [1.0, 3.0], "teacher_scores": [0.5, 0.5 + d], "change_scores": [[0.0, 0.01]], "multiplier": 1.0} for d in diffs
        ]
        (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    a, b = run("a", [0.03]), run("b", [-0.4])
    assert score_range([a]) == pytest.approx(0.03)
    assert score_range([a, b]) == pytest.approx(0.4)  # both panels drawn with ±0.4
    assert score_range([run("c", [0.0001])]) == pytest.approx(0.02)  # at least a decade beyond the linear range
