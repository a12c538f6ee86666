"""eval.sandbox's table and reuse, and eval.source_swap's increment and paired bootstrap."""

import json

import numpy as np
import pytest

from eval import sandbox
from eval.bootstrap import paired_bootstrap
from eval.source_swap import recover_increment


def _row(method, lr, seed, acc, a=None):
    return {"method": method, "lr": lr, "seed": seed, "accuracy": acc, "avg@8": acc / 2, "mean_multiplier": a}


def test_the_table_shows_mean_and_sample_sd_over_seeds_with_the_best_per_learning_rate_in_bold():
    rows = [
        _row("fedavg", 1e-3, 0, 30.0),
        _row("fedavg", 1e-3, 1, 34.0),
        _row("fedtops", 1e-3, 0, 40.0, 5.0),
        _row("fedtops", 1e-3, 1, 41.0, 3.0),
        _row("fedavg", 1e-2, 0, 50.0),
        _row("fedavg", 1e-2, 1, 52.0),
        _row("fedtops", 1e-2, 0, 45.0, 1.0),
        _row("fedtops", 1e-2, 1, 46.0, 2.0),
    ]
    text = sandbox.table(rows, "accuracy", "t")
    # fedavg at 1e-3: mean 32, sd sqrt(((30-32)^2 + (34-32)^2) / 1) = 2.83
    assert "| FedAvg | 32.0 ± 2.8 | **51.0 ± 1.4** |" in text
    assert "| FedTOPS | **40.5 ± 0.7** | 45.5 ± 0.7 |" in text
    assert "| FedTOPS mean a | 4.00 | 1.50 |" in text


def test_a_finished_run_with_the_same_config_is_reused_and_an_unfinished_one_is_not(tmp_path):
    from fedopd.config import parse_run_config

    config = sandbox.run_config("fedavg", 1e-3, 0, 2, 1, tmp_path)
    run = tmp_path / "20260101-000000-fedavg"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(parse_run_config(config).to_run_config()))
    (run / "rounds.jsonl").write_text(json.dumps({"round": 1, "evaluation": {"accuracy": 1.0}}) + "\n")
    (run / "status.json").write_text(json.dumps({"status": "completed"}))
    assert sandbox.finished_run(tmp_path, config) is None  # stopped after round 1 of 2
    with open(run / "rounds.jsonl", "a") as f:
        f.write(json.dumps({"round": 2, "evaluation": {"accuracy": 2.0}}) + "\n")
    assert sandbox.finished_run(tmp_path, config) == run
    assert sandbox.finished_run(tmp_path, {**config, "train.lr": 2e-3}) is None  # another cell


def test_run_config_sets_every_cell_and_the_cell_keeps_its_own_method_rate_and_seed(tmp_path):
    setting = {"num-clients": 12, "data.partitioner": "dirichlet", "strategy.fraction-train": 0.25}
    config = sandbox.run_config("fixed3", 3e-4, 2, 20, 5, tmp_path, setting)
    assert {k: config[k] for k in setting} == setting
    assert (config["strategy.name"], config["strategy.multiplier"], config["train.lr"], config["seed"]) == ("fixed", 3.0, 3e-4, 2)
    assert (config["num-server-rounds"], config["eval.every"]) == (20, 5)


def test_run_config_may_not_set_a_key_of_the_grid():
    from fedopd.config import ConfigError

    assert sandbox.grid_setting(["num-clients=12 strategy.fraction-train=0.25"]) == {"num-clients": 12, "strategy.fraction-train": 0.25}
    for key in ("train.lr=0.1", "seed=3", "strategy.name='fedavg'", "num-server-rounds=5"):
        with pytest.raises(ConfigError, match=f"'{key.split('=')[0]}'"):
            sandbox.grid_setting([key])


def test_a_grid_key_in_run_config_stops_the_command_before_any_run(tmp_path, capsys):
    code = sandbox.main(["--run-config", "train.lr=0.1", "--out", str(tmp_path / "out")])
    assert code == 1 and "'train.lr'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_the_round_increment_is_recovered_from_the_adapters_and_the_recorded_multiplier():
    prev = {"a": np.array([1.0, 2.0], np.float32)}
    delta = recover_increment(prev, {"a": np.array([4.0, 2.0 - 3.0], np.float32)}, 3.0)
    np.testing.assert_allclose(delta["a"], [1.0, -1.0])
    with pytest.raises(ValueError, match="held"):
        recover_increment(prev, prev, 0.0)


def test_the_paired_bootstrap_difference_and_interval():
    a = np.array([[0, 0], [1, 1], [0, 1], [1, 0]])
    b = np.array([[1, 1], [1, 1], [0, 1], [1, 0]])
    diff, lo, hi = paired_bootstrap(a, b, 4000, seed=1)
    assert diff == pytest.approx(25.0)  # question 0 goes from 0/2 to 2/2: +1/4 of the mean
    # per-question differences are (1, 0, 0, 0): a resample's mean is a multiple of 1/4 in [0, 1]
    assert lo == pytest.approx(0.0) and 25.0 <= hi <= 75.0
    same = paired_bootstrap(a, a, 100)
    assert same == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same questions"):
        paired_bootstrap(a, b[:3], 10)


# ------------------------------------------------------------------------------------------------
# Trust-budget sweep, reuse across grids, per-problem intervals
# ------------------------------------------------------------------------------------------------


def test_a_trust_budget_method_records_its_delta_in_its_name_and_settings():
    assert sandbox.trust_budget_method(0.05) == "fedtops-d0.05" and sandbox.trust_budget_method(float("inf")) == "fedtops-dinf"
    assert sandbox.method_trust_budget("fedtops-d0.02") == 0.02 and sandbox.method_trust_budget("fedtops") is None
    assert sandbox.method_settings("fedtops-dinf") == {"strategy.name": "fedtops", "strategy.trust-budget": float("inf")}
    assert sandbox.method_title("fedtops-dinf") == "FedTOPS δ = ∞" and sandbox.method_title("fedtops-d0.1") == "FedTOPS δ = 0.1"
    assert sandbox.parse_trust_budgets("0.01, 0.1,inf") == (0.01, 0.1, float("inf"))
    for bad, what in (("0.1,-1", "'-1'"), ("0.1,x", "'x'"), ("nan", "'nan'"), ("0.1,0.1", "repeated")):
        with pytest.raises(ValueError, match=what):
            sandbox.parse_trust_budgets(bad)


def test_the_grid_refuses_a_bad_trust_budget_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sandbox.main(["--trust-budgets", "0.1,-2", "--out", str(tmp_path / "out")])
    assert "--trust-budgets" in capsys.readouterr().err and not (tmp_path / "out").exists()


def _write_run(folder, config, rounds):
    from fedopd.config import parse_run_config
    from server_app.run_folder import _jsonable

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(_jsonable(parse_run_config(config).to_run_config())))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (folder / "status.json").write_text(json.dumps({"status": "completed"}))
    return folder


def test_a_finished_run_is_reused_from_another_cells_folder_when_only_the_output_dir_differs(tmp_path):
    # FedTOPS at the preset's δ = 0.05 run by the 6-method grid is the δ = 0.05 cell of a sweep
    grid = sandbox.run_config("fedtops", 3e-4, 1, 1, 0, tmp_path / "runs" / "fedtops-lr0.0003-seed1")
    sweep = sandbox.run_config("fedtops-d0.05", 3e-4, 1, 1, 0, tmp_path / "runs" / "fedtops-d0.05-lr0.0003-seed1")
    run = _write_run(tmp_path / "runs" / "fedtops-lr0.0003-seed1" / "r", grid, [{"round": 1, "multiplier": 1.0}])
    assert sandbox.finished_run(tmp_path / "runs", sweep) == run  # eval.every = 0: no evaluation needed
    assert sandbox.finished_run(tmp_path / "runs", sandbox.run_config("fedtops-dinf", 3e-4, 1, 1, 0, tmp_path)) is None


def test_a_result_row_counts_infeasible_rounds_per_candidate_and_averages_the_aggregation_error(tmp_path):
    config = sandbox.run_config("fedtops-d0.1", 3e-3, 0, 3, 3, tmp_path)
    cands = [0.5, 1.0, 3.0]
    rounds = [
        {"round": 0, "evaluation": {"accuracy": 10.0, "avg@8": 5.0, "pass@8": 20.0}},
        # δ = 0.1: round 1 only a = 3 infeasible (0.2 > 0.1 for the second client)
        {
            "round": 1,
            "multiplier": 1.0,
            "candidates": cands,
            "change_scores": [[0.0, 0.01, 0.05], [0.0, 0.02, 0.2]],
            "aggregation-error": 0.1,
            "aggregation-error-applied": 0.1,
        },
        # round 2: everything infeasible, a hold; no applied error
        {
            "round": 2,
            "multiplier": 0.0,
            "candidates": cands,
            "change_scores": [[0.3, 0.4, 0.5]],
            "aggregation-error": 0.3,
            "aggregation-error-applied": None,
        },
        {
            "round": 3,
            "multiplier": 0.5,
            "candidates": cands,
            "change_scores": [[0.1, 0.2, 0.3]],
            "aggregation-error": 0.2,
            "aggregation-error-applied": 0.4,
            "evaluation": {"accuracy": 40.0, "avg@8": 30.0, "pass@8": 60.0},
        },
    ]
    row = sandbox.result_row("fedtops-d0.1", 3e-3, 0, _write_run(tmp_path / "run", config, rounds))
    assert row["infeasible_rounds"] == [1, 2, 3] and row["scored_rounds"] == 3 and row["held_rounds"] == 1
    assert row["mean_multiplier"] == pytest.approx(0.5) and row["trust_budget"] == 0.1
    assert row["aggregation_error"] == pytest.approx(0.2) and row["aggregation_error_applied"] == pytest.approx(0.25)
    assert (row["accuracy"], row["avg@8"]) == (40.0, 30.0)
    text = sandbox.trust_budget_table([row, {**row, "seed": 1, "accuracy": 50.0, "infeasible_rounds": [0, 0, 3]}], 8)
    # two seeds: 6 scored rounds; a = 0.5 infeasible in 1 of them (17 %), a = 1 in 2 (33 %), a = 3 in 6
    assert "| 0.003 | 0.1 | 45.0 ± 7.1 | 30.0 ± 0.0 | 0.50 | 2 | 17 | 33 | 100 |" in text


def test_seed_and_problem_bootstraps_of_a_paired_difference():
    from eval.bootstrap import problem_bootstrap, seed_bootstrap

    # 2 seeds × 4 problems × 1 sample; B − A per seed: +25 pp and +75 pp, per problem (mean over
    # seeds): +100, +50, +50, 0 pp
    a = np.zeros((2, 4, 1))
    b = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], float)[:, :, None]
    diff, lo, hi = seed_bootstrap(a, b, 4000, seed=0)
    assert diff == pytest.approx(50.0) and lo == pytest.approx(25.0) and hi == pytest.approx(75.0)  # resamples: 25, 50 or 75
    diff, lo, hi = problem_bootstrap(a, b, 4000, seed=0)
    assert diff == pytest.approx(50.0) and 0.0 <= lo < 50.0 < hi <= 100.0
    assert problem_bootstrap(a, a, 10) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same seeds and problems"):
        seed_bootstrap(a, b[:1], 10)


def test_the_detectable_difference_is_2_8_standard_errors():
    from eval.bootstrap import detectable_difference

    assert detectable_difference(1.0, 1) == pytest.approx(1.959964 + 0.841621, rel=1e-6)
    assert detectable_difference(3.0, 9) == pytest.approx(2.801585, rel=1e-6)  # 3 / sqrt(9) = 1


def test_the_intervals_pair_each_seed_and_problem_of_the_two_methods(tmp_path):
    rows = []
    for method, grades in (("fedavg", [[0, 0, 1, 1], [0, 1, 1, 1]]), ("fedtops", [[1, 0, 1, 1], [1, 1, 1, 1]])):
        for seed, g in enumerate(grades):
            run = tmp_path / f"{method}-{seed}"
            run.mkdir()
            np.savez(run / sandbox.GRADES, greedy=np.array(g, float), sampled=np.array(g, float)[:, None].repeat(2, axis=1))
            rows.append({"method": method, "lr": 1e-3, "seed": seed, "run": str(run)})
    found = sandbox.intervals(rows, draws=200)
    assert [(d["a"], d["b"], d["metric"]) for d in found] == [("fedavg", "fedtops", "accuracy"), ("fedavg", "fedtops", "avg@k")]
    assert found[0]["per_seed"] == [25.0, 25.0] and found[0]["difference"] == 25.0 and found[0]["by_seed"] == [25.0, 25.0]


def test_replicates_of_the_source_swap_give_a_mean_a_seed_interval_and_a_detectable_difference():
    from eval.bootstrap import DETECTABLE_Z
    from eval.source_swap import replicate_summary

    def result(seed, diff):
        return {"lr": 1e-3, "seed": seed, "differences": [{"model": "source a=3", "minus": "source a=1", "metric": "accuracy", "difference": diff}]}

    (row,) = replicate_summary([result(0, 2.0), result(1, 4.0)], 1000, {(1e-3, "accuracy"): 1.0})
    assert (row["mean"], row["per_run"], row["runs"]) == (3.0, [2.0, 4.0], 2)
    assert row["by_seed"][0] >= 2.0 and row["by_seed"][1] <= 4.0
    # sd of (2, 4) = √2; 2 replicates: 2.8 · √2 / √2
    assert row["sd"] == pytest.approx(np.sqrt(2)) and row["detectable"] == pytest.approx(DETECTABLE_Z)
    # from the grid: two independent models of seed sd 1 differ with sd √2
    assert row["detectable_from_grid"] == {1: pytest.approx(DETECTABLE_Z * np.sqrt(2)), 2: pytest.approx(DETECTABLE_Z)}


@pytest.mark.slow
@pytest.mark.parametrize(("method", "settings"), [("local", {}), pytest.param("fedexp", {"strategy.fedexp-average": True}, marks=pytest.mark.slow)])
def test_the_final_grades_reproduce_the_recorded_evaluation_of_what_the_run_evaluated(method, settings, tmp_path):
    # Re-grading happens outside the run (eval.sandbox, after it): each Local client's own final
    # adapter, FedExP's average of its last two iterates, with the seeds of the last evaluation. The
    # run's evaluate handler scored the same adapters independently; equal held-out sets per
    # client, so the pooled mean is Local's mean.
    from client_app.app import app
    from fedopd.config import parse_run_config
    from fedopd.config.presets import app_defaults
    from server_app.app import run_server
    from server_app.inprocess import InProcessGrid, task_identity

    overrides = {
        **app_defaults(),  # the sandbox models: they solve some problems, so the grades vary
        "strategy.name": method,
        "num-server-rounds": 1,
        "data.prompts-per-client": 8,
        "rollout.per-round": 4,
        "rollout.max-new-tokens": 8,
        "train.mini-batch": 4,
        "eval.every": 1,
        "eval.prompts-per-client": 4,
        "eval.samples": 2,
        "output-dir": str(tmp_path),
        **settings,
    }
    cfg = parse_run_config(overrides)
    with task_identity():
        run = run_server(InProcessGrid(app, cfg.to_run_config(), 3), cfg)
    recorded = json.loads((run / "rounds.jsonl").read_text().splitlines()[-1])["evaluation"]
    scores = sandbox.graded_scores(sandbox.final_grades(run))
    assert scores["accuracy"] == pytest.approx(recorded["accuracy"], abs=1e-9)
    assert scores["avg@2"] == pytest.approx(recorded["avg@2"], abs=1e-9)
    assert scores["pass@2"] == pytest.approx(recorded["pass@2"], abs=1e-9)
    with np.load(run / sandbox.GRADES) as z:
        assert z["greedy"].shape == (12,) and z["sampled"].shape == (12, 2)  # 3 clients × 4 problems
        assert 0 < z["sampled"].mean() < 1  # grades that a wrong adapter or seed would change
    if method == "fedexp":  # what was evaluated is (θ_0 + θ_1)/2, not θ_1
        from fedopd.models.lora import load_adapter

        theta = [load_adapter(run / f"round-00{t}") for t in (0, 1)]
        evaluated = load_adapter(run / "round-001" / "evaluated")
        for key in theta[0]:
            np.testing.assert_allclose(evaluated[key], (theta[0][key] + theta[1][key]) / 2, rtol=1e-6, atol=1e-8)
        assert any(not np.allclose(evaluated[k], theta[1][k]) for k in theta[0])


def test_a_sweep_setting_scales_the_adaptive_rules_with_the_client_learning_rate():
    # the declared sweep (docs/sandbox.md): η = c × lr, τ = lr / 100; FedAvgM's η absolute, β = 0.9
    assert sandbox.method_settings("fedadam-x6", 3e-4) == {
        "strategy.name": "fedadam",
        "strategy.server-lr": pytest.approx(1.8e-3),
        "strategy.tau": pytest.approx(3e-6),
        "strategy.beta1": 0.9,
        "strategy.beta2": 0.99,
    }
    assert sandbox.method_settings("fedadagrad-x20", 3e-3) == {
        "strategy.name": "fedadagrad",
        "strategy.server-lr": pytest.approx(0.06),
        "strategy.tau": pytest.approx(3e-5),
    }
    assert sandbox.method_settings("fedavgm-s0.3", 3e-3) == {"strategy.name": "fedavgm", "strategy.server-lr": 0.3, "strategy.server-momentum": 0.9}
    assert sandbox.method_settings("fedexp-e0.01", 3e-3) == {
        "strategy.name": "fedexp",
        "strategy.fedexp-epsilon": 0.01,
        "strategy.fedexp-average": True,
    }
    assert [len(sweep) for sweep in sandbox.SWEEPS.values()] == [3] * 5  # the same tuning budget per rule


def test_a_tuned_rule_runs_the_setting_its_tuning_chose_at_that_learning_rate_and_nothing_without_one():
    tuned = {"fedadam": {"0.0003": "fedadam-x20", "0.003": "fedadam-x2"}}
    assert sandbox.method_settings("fedadam", 3e-4, tuned)["strategy.server-lr"] == pytest.approx(6e-3)
    assert sandbox.method_settings("fedadam", 3e-3, tuned)["strategy.server-lr"] == pytest.approx(6e-3)
    with pytest.raises(ValueError, match="no tuned setting at lr 0.001"):
        sandbox.method_settings("fedadam", 1e-3, tuned)
    with pytest.raises(ValueError, match="not a setting of fedadam's sweep"):
        sandbox.method_settings("fedadam", 3e-4, {"fedadam": {"0.0003": "fedyogi-x2"}})


def test_tuning_chooses_the_best_mean_greedy_over_the_tuning_seeds_then_avg_at_k_then_the_first_listed():
    rows = [
        # lr 3e-4: x6 has the best mean greedy (50 vs 49 vs 30)
        *[_row("fedadam-x2", 3e-4, s, a) for s, a in ((20, 48.0), (21, 50.0))],
        *[_row("fedadam-x6", 3e-4, s, a) for s, a in ((20, 52.0), (21, 48.0))],
        *[_row("fedadam-x20", 3e-4, s, a) for s, a in ((20, 30.0), (21, 30.0))],
        # lr 3e-3: x2 and x20 tie within 0.1 pp on greedy; x20's Avg@8 is higher
        {**_row("fedadam-x2", 3e-3, 20, 60.0), "avg@8": 20.0},
        {**_row("fedadam-x20", 3e-3, 20, 59.95), "avg@8": 25.0},
        {**_row("fedadam-x6", 3e-3, 20, 40.0), "avg@8": 40.0},
        # FedAvgM: a full tie at lr 3e-4 goes to the setting listed first (s0.1 before s1)
        _row("fedavgm-s1", 3e-4, 20, 40.0),
        _row("fedavgm-s0.1", 3e-4, 20, 40.0),
    ]
    chosen, text = sandbox.choose_settings(rows, 8)
    assert chosen == {"fedadam": {"0.0003": "fedadam-x6", "0.003": "fedadam-x20"}, "fedavgm": {"0.0003": "fedavgm-s0.1"}}
    assert "| fedadam-x6 | **50.0 / 25.0** | 40.0 / 40.0 |" in text


def test_a_record_from_before_the_step_fields_reads_as_a_step_along_the_average():
    assert sandbox.step_fields({"strategy": "fedtops", "multiplier": 5.0}) == (5.0, 1.0)
    assert sandbox.step_fields({"strategy": "fedavg", "multiplier": 0.0}) == (0.0, None)  # a hold
    assert sandbox.step_fields({"strategy": "local", "multiplier": None}) == (None, None)
    assert sandbox.step_fields({"strategy": "fedadam", "multiplier": 2.0, "effective-multiplier": 2.0, "step-cosine": 0.4}) == (2.0, 0.4)


def test_a_server_optimizer_is_compared_as_fedtops_minus_it_and_it_minus_fedavg(tmp_path):
    rows = []
    grades = {"fedavg": [0, 0, 1, 1], "fedtops": [1, 1, 1, 1], "fedadam": [0, 1, 1, 1]}
    for method, g in grades.items():
        run = tmp_path / method
        run.mkdir()
        np.savez(run / sandbox.GRADES, greedy=np.array(g, float), sampled=np.array(g, float)[:, None].repeat(2, axis=1))
        rows.append({"method": method, "lr": 1e-3, "seed": 0, "run": str(run)})
    found = {(d["a"], d["b"]): d["difference"] for d in sandbox.intervals(rows, draws=50) if d["metric"] == "accuracy"}
    # FedTOPS − FedAdam = 100 − 75 = +25 pp; FedAdam − FedAvg = 75 − 50 = +25 pp
    assert found == {("fedavg", "fedtops"): 50.0, ("fedadam", "fedtops"): 25.0, ("fedavg", "fedadam"): 25.0}


def test_the_step_table_gives_each_rules_mean_multiplier_and_cosine_and_its_seconds_per_run():
    rows = [
        {"method": "fedadam", "lr": 1e-3, "seed": s, "mean_effective_multiplier": a, "mean_step_cosine": c, "seconds": t}
        for s, (a, c, t) in enumerate(((2.0, 0.5, 10.0), (4.0, 0.7, 30.0)))
    ] + [{"method": "local", "lr": 1e-3, "seed": 0, "mean_effective_multiplier": None, "seconds": 5.0}]
    text = sandbox.step_table(rows)
    assert "| FedAdam | 3.00 / 0.60 | 20 |" in text
    assert "Local" not in text  # no step of its own
