"""eval.sandbox's table and reuse, and eval.source_swap's increment and paired bootstrap."""

import json

import numpy as np
import pytest

from eval import sandbox
from eval.source_swap import paired_bootstrap, recover_increment


def _row(method, lr, seed, acc, a=None):
    return {"method": method, "lr": lr, "seed": seed, "accuracy": acc, "avg@8": acc / 2, "mean_multiplier": a}


def test_the_table_shows_mean_and_sample_sd_over_seeds_with_the_best_per_learning_rate_in_bold():
    rows = [_row("fedavg", 1e-3, 0, 30.0), _row("fedavg", 1e-3, 1, 34.0),
            _row("fedtops", 1e-3, 0, 40.0, 5.0), _row("fedtops", 1e-3, 1, 41.0, 3.0),
            _row("fedavg", 1e-2, 0, 50.0), _row("fedavg", 1e-2, 1, 52.0),
            _row("fedtops", 1e-2, 0, 45.0, 1.0), _row("fedtops", 1e-2, 1, 46.0, 2.0)]
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
