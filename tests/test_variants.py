"""eval.variants: parsing the variants, the plan of runs, reuse, the comparison table, one real run."""

import json

import pytest

from eval import variants
from eval.variants import Variant


def test_vary_values_are_toml_values_and_a_bare_word_is_a_string():
    assert variants.parse_vary("train.lr=3e-4,3e-3") == ("train.lr", (3e-4, 3e-3))
    assert variants.parse_vary("strategy.name=fedavg,fedtops") == ("strategy.name", ("fedavg", "fedtops"))
    assert variants.parse_vary("train.exact-kl=true,false") == ("train.exact-kl", (True, False))


@pytest.mark.parametrize("text", ["train.lr", "train.lr=", "=1,2", "train.lr=1,,2", "seed=1,2", "output-dir=a,b", "train.lr=1,1.0"])
def test_a_malformed_vary_or_one_of_the_commands_own_keys_is_refused(text):
    with pytest.raises(ValueError, match="--vary"):
        variants.parse_vary(text)


def test_a_variant_is_a_name_and_overrides_in_flowers_syntax():
    assert variants.parse_variant("fixed3: strategy.name='fixed' strategy.multiplier=3.0") == Variant(
        "fixed3", {"strategy.name": "fixed", "strategy.multiplier": 3.0}
    )
    assert variants.parse_variant("base:") == Variant("base", {})


@pytest.mark.parametrize("text", ["strategy.name='fixed'", "bad name: seed=1", ": seed=1", "s: seed=3", "o: output-dir='x'"])
def test_a_variant_without_a_name_or_setting_the_commands_own_keys_is_refused(text):
    with pytest.raises(ValueError, match="--variant"):
        variants.parse_variant(text)


def test_the_plan_crosses_variants_values_and_seeds_with_later_layers_winning(tmp_path):
    base = {"strategy.name": "fedavg", "train.lr": 1e-3, "num-server-rounds": 2}
    cells = variants.plan(
        base, [Variant("a", {}), Variant("b", {"strategy.name": "fedtops", "train.lr": 5e-3})], [("train.lr", (1e-4, 2e-4))], [0, 7], tmp_path
    )
    assert [(c.variant, c.values, c.seed) for c in cells] == [(v, (("train.lr", lr),), s) for v in ("a", "b") for lr in (1e-4, 2e-4) for s in (0, 7)]
    b = cells[6]  # variant b, lr 2e-4, seed 0: the --vary value beats the variant's own train.lr
    assert (b.config["strategy.name"], b.config["train.lr"], b.config["seed"], b.config["num-server-rounds"]) == ("fedtops", 2e-4, 0, 2)
    assert b.label == "b train.lr=0.0002"
    assert b.config["output-dir"] == str(tmp_path / "b-train.lr=0.0002-seed0")
    assert len({c.config["output-dir"] for c in cells}) == len(cells)


@pytest.mark.parametrize(
    "variant_list, vary, seeds, match",
    [
        ([Variant("a"), Variant("a")], [], [0], "name is repeated"),
        ([Variant("a")], [], [0, 0], "--seeds"),
        ([Variant("a")], [], [], "--seeds"),
        ([Variant("a")], [("train.lr", (1e-3,)), ("train.lr", (2e-3,))], [0], "given twice"),
    ],
)
def test_a_plan_with_repeated_names_seeds_or_keys_is_refused(tmp_path, variant_list, vary, seeds, match):
    with pytest.raises(ValueError, match=match):
        variants.plan({}, variant_list, vary, seeds, tmp_path)


def _finished(folder, config, rounds=2, evaluated=True):
    from fedopd.config import parse_run_config

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(parse_run_config(config).to_run_config()))
    lines = [
        {"round": r, "seconds": 1.5, **({"evaluation": {"accuracy": 10.0 * r, "avg@8": 5.0 * r, "pass@8": 20.0 * r}} if evaluated else {})}
        for r in range(rounds + 1)
    ]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "status.json").write_text(json.dumps({"status": "completed"}))
    return folder


def test_a_run_that_differs_only_in_where_it_is_reported_is_reused_and_one_that_computes_otherwise_is_not(tmp_path):
    config = {"num-server-rounds": 2, "eval.every": 1, "output-dir": str(tmp_path / "x")}
    run = _finished(tmp_path / "runs" / "r1", config)
    tracked = {**config, "output-dir": str(tmp_path / "elsewhere"), "logging.tensorboard": True}
    assert variants.finished_run(tmp_path / "runs", tracked) == run
    assert variants.finished_run(tmp_path / "runs", {**config, "train.lr": 1e-4}) is None
    assert variants.finished_run(tmp_path / "runs", {**config, "num-server-rounds": 3}) is None  # stopped short of 3


def test_the_table_gives_mean_and_sample_sd_over_seeds_with_the_best_in_bold():
    def row(label, seed, acc, avg, run="r"):
        return {
            "label": label,
            "seed": seed,
            "seconds": 90.0,
            "status": "completed",
            "run": run,
            "evaluation": {"accuracy": acc, "avg@8": avg, "pass@8": 50.0},
        }

    text = variants.comparison_table(
        [row("fedavg", 0, 30.0, 20.0), row("fedavg", 1, 34.0, 22.0), row("fedtops", 0, 40.0, 10.0), row("fedtops", 1, 41.0, 12.0)]
    )
    # fedavg: mean 32, sd sqrt((2² + 2²) / 1) = 2.83; avg@8 mean 21, sd 1.41; fedtops 40.5 ± 0.71, 11 ± 1.41; 90 s = 1.5 min
    assert "| fedavg | 32.0 ± 2.8 | **21.0 ± 1.4** | **50.0 ± 0.0** | 0,1 | 1.5 |" in text
    assert "| fedtops | **40.5 ± 0.7** | 11.0 ± 1.4 | **50.0 ± 0.0** | 0,1 | 1.5 |" in text


def test_the_table_names_a_run_that_did_not_complete():
    rows = [
        {"label": "a", "seed": 0, "seconds": 60.0, "status": "completed", "run": "r0", "evaluation": {"accuracy": 1.0}},
        {"label": "a", "seed": 1, "seconds": 60.0, "status": "failed", "run": "r1", "evaluation": None},
    ]
    text = variants.comparison_table(rows)
    assert "| a | – | 0,1 | 1.0 |" in text  # a mean over some seeds only would mislead: none
    assert "a seed 1: failed (r1)" in text


def test_bad_input_stops_the_command_before_any_run(tmp_path, capsys):
    assert variants.main(["--vary", "train.lr=-1", "--out", str(tmp_path)]) == 1
    assert "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_variants_run_in_process_a_failed_one_is_reported_and_a_second_call_reuses_the_finished(tmp_path, capsys):
    from server_app.run_folder import read_rounds

    args = ["-c", "num-server-rounds=1 eval.every=1 eval.prompts-per-client=4 eval.samples=2 rollout.per-round=8", "--variant", "fedavg: strategy.name='fedavg'",
            "--variant", "fixed2: strategy.name='fixed' strategy.multiplier=2.0", "--variant", "broken: rollout.stop-tokens='nosuchtoken'",
            "--out", str(tmp_path)]  # fmt: skip
    assert variants.main(args) == 1  # one run failed: the command says so, after the others ran
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["label"], r["status"]) for r in rows] == [("fedavg", "completed"), ("fixed2", "completed"), ("broken", "failed")]
    assert "nosuchtoken" in rows[2]["error"]
    for r in rows[:2]:  # the table's scores are the runs' own last evaluation
        assert r["rounds"] == 1 and r["evaluation"] == read_rounds(r["run"])[-1]["evaluation"]
    table = (tmp_path / "table.md").read_text()
    assert "| fedavg |" in table and "| broken | – |" in table and "- broken seed 0: failed" in table
    assert (tmp_path / "heldout.png").is_file()
    capsys.readouterr()
    assert variants.main(args) == 1
    assert "2 of 3 runs already finished (reused); running 1" in capsys.readouterr().out


def test_seeds_are_integers_and_the_base_may_not_set_what_the_command_sets(tmp_path):
    assert variants.parse_seeds("0, 7,12") == [0, 7, 12]
    for bad in ("0,x", "1,,2", "-1", "1.5"):
        with pytest.raises(ValueError, match="--seeds"):
            variants.parse_seeds(bad)
    for key in ("seed", "output-dir"):
        with pytest.raises(ValueError, match=f"--run-config sets {key}"):
            variants.plan({key: 1}, [Variant("a")], [], [0], tmp_path)


def test_a_run_that_failed_in_its_last_round_is_not_reused(tmp_path):
    config = {"num-server-rounds": 2, "eval.every": 0}
    run = _finished(tmp_path / "runs" / "r1", config, evaluated=False)
    assert variants.finished_run(tmp_path / "runs", config) == run
    (run / "status.json").write_text(json.dumps({"status": "failed", "error": "no client returned a valid update"}))
    assert variants.finished_run(tmp_path / "runs", config) is None


def test_a_quoted_comma_stays_in_its_value_and_a_toml_date_stays_text():
    assert variants.parse_vary("rollout.stop-tokens='<|im_end|>,<|endoftext|>','auto'") == (
        "rollout.stop-tokens", ("<|im_end|>,<|endoftext|>", "auto"),
    )  # fmt: skip
    assert variants.parse_vary("data.path=2024-01-01,x") == ("data.path", ("2024-01-01", "x"))


def test_values_that_print_alike_get_folders_of_their_own_and_a_clash_is_refused(tmp_path):
    cells = variants.plan({}, [Variant("a")], [("train.lr", (1e-4, 1.000001e-4))], [0], tmp_path)
    assert len({c.config["output-dir"] for c in cells}) == 2 and len({c.label for c in cells}) == 2
    with pytest.raises(ValueError, match="two runs would share the folder"):
        variants.plan({}, [Variant("a")], [("data.path", ("x y", "x_y"))], [0], tmp_path)


def test_the_number_of_in_process_clients_is_part_of_the_config_a_reused_run_must_match(tmp_path):
    [three] = variants.plan({}, [Variant("a")], [], [0], tmp_path, num_clients=3)
    [six] = variants.plan({}, [Variant("a")], [], [0], tmp_path, num_clients=6)
    [own] = variants.plan({"num-clients": 5}, [Variant("a")], [], [0], tmp_path, num_clients=3)
    assert (three.config["num-clients"], six.config["num-clients"], own.config["num-clients"]) == (3, 6, 5)
    assert variants.comparable(three.config) != variants.comparable(six.config)


def test_a_failed_run_is_a_row_that_says_so_under_the_table(tmp_path):
    [cell] = variants.plan({}, [Variant("a")], [], [0], tmp_path)
    [row] = variants.result_rows([cell], {cell: None}, {cell: "RunFailed: no client returned a valid update"})
    assert (row["status"], row["run"], row["evaluation"], row["error"]) == ("failed", None, None, "RunFailed: no client returned a valid update")
    text = variants.comparison_table([row])
    assert "| a | – | 0 | 0.0 |" in text and "\n\nDid not complete:\n- a seed 0: failed (no run folder)\n" in text


def test_a_prompt_file_without_its_columns_stops_the_command_before_any_run(tmp_path, capsys):
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "1+1", "solution": "2"}\n')
    args = ["--variant", "ok:", "--variant", f"bad: data.name='prompts' data.path='{wrong}' eval.every=0", "--out", str(tmp_path / "out")]
    assert variants.main(args) == 1
    assert "data.problem-column = 'problem' is not a column of" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # the good variant did not run first


def test_each_run_is_named_in_the_trackers_as_the_table_names_it_unless_the_config_names_it(tmp_path):
    cells = variants.plan({}, [Variant("fixed3", {"strategy.name": "fixed"})], [("train.lr", (3e-4,))], [1], tmp_path)
    assert cells[0].config["logging.run-name"] == "fixed3 train.lr=0.0003 seed 1"
    [own] = variants.plan({"logging.run-name": "mine"}, [Variant("a")], [], [0], tmp_path)
    assert own.config["logging.run-name"] == "mine"


@pytest.mark.slow  # MLflow makes a sqlite store's tables in about 8 s
def test_a_store_that_runs_at_once_will_share_is_created_before_they_start(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    shared = {"logging.mlflow": True, "logging.mlflow-uri": uri, "logging.mlflow-experiment": "cmp"}
    variants.open_shared_stores([{**shared, "seed": 0}, {**shared, "seed": 1}, {"logging.mlflow": True}, {}])
    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name("cmp")
    assert experiment is not None and experiment.artifact_location == (tmp_path / "mlartifacts").as_uri()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.db"]  # one per-run-folder store is left to its run


def test_only_a_new_sqlite_store_is_opened_before_parallel_runs_and_a_failure_there_is_a_warning(monkeypatch, capsys):
    import server_app.tracking as tracking

    opened = []
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "mlflow_experiment", lambda uri, name: opened.append(uri) or (_ for _ in ()).throw(OSError("disk")))
    variants.open_shared_stores([{"logging.mlflow": True, "logging.mlflow-uri": "http://127.0.0.1:9"}])
    assert opened == []  # a tracking server makes its own tables
    variants.open_shared_stores([{"logging.mlflow": True, "logging.mlflow-uri": "sqlite:////tmp/x.db"}])
    assert (
        opened == ["sqlite:////tmp/x.db"] and "warning: could not open the MLflow store sqlite:////tmp/x.db: OSError: disk" in capsys.readouterr().err
    )
