"""What a run shows and leaves for scripts: per-reply progress lines, the per-round scalars, the
figure, TensorBoard, the end-of-run summary, and ``status.json`` / ``python -m server_app.run_status``.
"""

import json

import pytest

from server_app.progress import FIGURE, draw, round_scalars, run_summary, run_title
from server_app.run_status import folder_status

RECORDS = [
    {"round": 0, "strategy": "fedtops", "evaluation": {"accuracy": 38.5, "avg@8": 21.9, "pass@8": 57.3, "clients": []}},
    {
        "round": 1,
        "strategy": "fedtops",
        "multiplier": 3.0,
        "candidates": [0.5, 1.0, 3.0],
        "teacher_scores": [0.3, 0.2, 0.1],
        "seconds": 4.5,
        "clients": [{"loss": 0.5, "loss_first": 0.6, "loss_last": 0.4}, {"loss": 0.3, "loss_first": 0.2, "loss_last": 0.2}],
    },
    {
        "round": 2,
        "strategy": "fedtops",
        "multiplier": 0.0,
        "candidates": [0.5, 1.0, 3.0],
        "teacher_scores": [0.3, 0.2, 0.1],
        "seconds": 4.0,
        "clients": [{"loss": 0.4, "loss_first": 0.5, "loss_last": 0.3}],
        "evaluation": {"accuracy": 40.6, "avg@8": 23.0, "pass@8": 60.0, "clients": []},
    },
]


def test_round_scalars_are_the_client_means_the_selected_score_and_the_evaluation():
    s = round_scalars(RECORDS[1])
    assert s == pytest.approx(
        {
            "clients/loss": 0.4,
            "clients/loss_first": 0.4,
            "clients/loss_last": 0.3,
            "server/multiplier": 3.0,
            "server/teacher_score_selected": 0.1,
            "server/round_seconds": 4.5,
        }
    )
    assert round_scalars(RECORDS[0]) == {"heldout/greedy": 38.5, "heldout/avg@8": 21.9, "heldout/pass@8": 57.3}
    # a = 0 (hold) is not among the candidates: no selected score, but the multiplier is kept
    assert round_scalars(RECORDS[2])["server/multiplier"] == 0.0 and "server/teacher_score_selected" not in round_scalars(RECORDS[2])


def test_the_summary_names_rounds_multipliers_accuracy_and_folder(tmp_path):
    lines = run_summary(RECORDS, "fedtops", tmp_path, 12.3)
    assert lines == [
        "Run summary: 2 rounds of fedtops in 12 s",
        "  selected multipliers: 3, 0",
        "  held-out greedy accuracy: 38.5% (round 0) -> 40.6% (round 2)",
        f"  run folder: {tmp_path}",
    ]


def test_the_summary_is_named_for_no_strategy_and_counts_one_round_as_one(tmp_path):
    """FedAvg's summary does not say FedTOPS, and its multipliers were not selected (issue 49)."""
    fedavg = [{"round": 1, "multiplier": 1.0}]
    assert run_summary(fedavg, "fedavg", tmp_path, 3.0)[:2] == ["Run summary: 1 round of fedavg in 3 s", "  multipliers: 1"]


def test_the_figure_is_a_png_written_whole(tmp_path):
    path = draw(RECORDS, tmp_path / FIGURE, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == [FIGURE]  # no temporary file left beside it


def test_figure_titles_tell_runs_apart():
    base = {"strategy.name": "fedtops", "strategy.trust-budget": 0.05, "train.lr": 3e-3, "seed": 1}
    assert "δ = 0.05" in run_title(base) and "lr 0.003" in run_title(base)
    assert run_title({**base, "strategy.trust-budget": 0.01}) != run_title(base)
    assert "fixed a = 3.0" in run_title({**base, "strategy.name": "fixed", "strategy.multiplier": 3.0})


def test_tensorboard_gets_the_same_scalars_one_step_per_round(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from server_app.tracking import TensorBoardTracker

    tb = TensorBoardTracker(tmp_path / "tb")
    for record in RECORDS:
        tb.log_round(record)
    tb.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    greedy = [(e.step, e.value) for e in events.Scalars("heldout/greedy")]
    assert greedy == [(0, 38.5), (2, pytest.approx(40.6))]
    assert [(e.step, e.value) for e in events.Scalars("server/multiplier")] == [(1, 3.0), (2, 0.0)]


@pytest.mark.parametrize(
    "state, code", [({"status": "completed"}, 0), ({"status": "failed", "error": "X: y"}, 1), ({"status": "running", "rounds-done": 3}, 3), (None, 3)]
)
def test_run_status_exit_codes(tmp_path, state, code):
    (tmp_path / "config.json").write_text("{}")
    if state is not None:
        (tmp_path / "status.json").write_text(json.dumps(state))
    got, line = folder_status(tmp_path)
    assert got == code
    if state and "error" in state:
        assert "X: y" in line
    if state and "rounds-done" in state:
        assert line.endswith(": running, 3 rounds recorded")
    assert folder_status(tmp_path / "nothing")[0] == 2


def test_a_run_that_recorded_one_round_says_one_round(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "status.json").write_text(json.dumps({"status": "failed", "rounds-done": 1, "error": "no client returned a valid update"}))
    assert folder_status(tmp_path)[1] == f"{tmp_path}: failed, 1 round recorded: no client returned a valid update"


def test_a_reply_becomes_one_progress_line(task_identity):
    from flwr.app import Message, MetricRecord, RecordDict

    from server_app.log_lines import reply_summary

    request = Message(RecordDict(), dst_node_id=7, message_type="train")
    metrics = {
        "partition-id": 2,
        "rollout_s": 1.25,
        "response_length": 61.4,
        "cap_hit_rate": 0.03125,
        "accuracy": 0.4375,
        "teacher_s": 0.4,
        "cache_s": 0.031,
        "cache_teacher_score": 0.1,
        "steps": 8,
        "opd_s": 0.61,
        "loss_first": 0.41234,
        "loss_last": 0.38761,
        "total_s": 2.3,
    }
    reply = Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=request)
    assert reply_summary(reply) == (
        "  node 7 client 2 trained: 1.2 s rollouts (mean 61 tokens, cap-hit 3%, reward 44%) | teacher 0.4 s | cache 0.03 s"
        " | OPD 8 steps 0.6 s, loss 0.4123 -> 0.3876 | 2.3 s"
    )


def test_a_round_whose_multiplier_was_capped_says_so_in_its_line():
    from server_app.log_lines import round_summary

    record = {
        "round": 2,
        "strategy": "fedtops",
        "multiplier": 1.0,
        "selected-multiplier": 10.0,
        "multiplier-cap": 1.0,
        "unscored-node-ids": [1002],
        "candidates": [1.0, 10.0],
        "teacher_scores": [0.2, 0.1],
        "num-feasible": 2,
        "excluded": [{"node-id": 1002, "reason": "score: error reply: x"}],
        "clients": [],
        "seconds": 3.0,
    }
    assert round_summary(record, 4) == (
        "round 2/4 [fedtops] a = 1 | J(a) = 0.2000 | feasible 2/2 | client loss - | 3.0 s"
        " (capped at 1, selected 10: no valid scores from node 1002) (1 excluded)"
    )
    uncapped = {**record, "multiplier-cap": None, "unscored-node-ids": []}
    assert "capped" not in round_summary(uncapped, 4)


def test_the_aggregation_error_is_a_scalar_in_percent_and_part_of_the_round_line():
    from server_app.log_lines import round_summary

    record = {
        "round": 3,
        "strategy": "fixed",
        "multiplier": 3.0,
        "clients": [],
        "seconds": 1.0,
        "aggregation-error": 0.0671,
        "aggregation-error-applied": 0.254,
    }
    s = round_scalars(record)
    assert s["server/aggregation_error"] == pytest.approx(6.71) and s["server/aggregation_error_applied"] == pytest.approx(25.4)
    assert "| factor-average error 6.71% (applied 25.40%) |" in round_summary(record, 4)
    # a = 1: the applied update is the mean; a hold: no applied error; Local: no error at all
    assert round_summary({**record, "multiplier": 1.0}, 4).count("6.71%") == 1 and "applied" not in round_summary({**record, "multiplier": 1.0}, 4)
    held = {**record, "multiplier": 0.0, "aggregation-error-applied": None}
    assert "applied" not in round_summary(held, 4) and "server/aggregation_error_applied" not in round_scalars(held)
    assert "factor-average" not in round_summary({"round": 1, "strategy": "local", "clients": []}, 4)


def test_a_step_that_is_not_along_the_average_says_its_multiplier_is_the_effective_one():
    from server_app.log_lines import round_summary

    record = {
        "round": 2,
        "strategy": "fedadam",
        "multiplier": 1.234,
        "clients": [],
        "seconds": 1.0,
        "effective-multiplier": 1.234,
        "step-cosine": 0.8712,
    }
    assert "a = 1.234 (effective, cos 0.87) |" in round_summary(record, 4)
    assert round_scalars(record)["server/step_cosine"] == pytest.approx(0.8712)
    along = {**record, "strategy": "fixed", "multiplier": 3.0, "step-cosine": 0.99999994}  # cosine 1 to fp32 rounding
    assert "a = 3 |" in round_summary(along, 4)


def test_the_eta_is_the_rounds_left_times_the_mean_recorded_round_with_its_evaluation():
    from server_app.log_lines import duration_text, eta_seconds, round_summary

    records = [{"round": 0, "eval_seconds": 9.0}, {"round": 1, "seconds": 2.0}, {"round": 2, "seconds": 3.0, "eval_seconds": 5.0}]
    assert eta_seconds(records, 10) == 8 * (2.0 + 8.0) / 2  # round 0's evaluation is not a round's
    assert eta_seconds(records, 2) is None and eta_seconds(records[:1], 10) is None
    assert [duration_text(s) for s in (44.6, 200, 7500)] == ["45 s", "3 min 20 s", "2 h 05 min"]
    line = round_summary({"round": 2, "strategy": "fedavg", "clients": [], "seconds": 3.0, "multiplier": 1.0}, 10, eta=40.0)
    assert line.endswith("| 3.0 s | ETA 40 s")
