"""Validation of the run config: bad values fail before work starts, naming the key."""

import json

import pytest

from fedopd.config import ConfigError, RunConfig, parse_run_config


def test_defaults_parse_and_round_trip_through_run_config_keys():
    cfg = parse_run_config(RunConfig().to_run_config())  # 'auto' choices resolved
    assert parse_run_config(cfg.to_run_config()) == cfg
    assert cfg.to_run_config()["strategy.candidates"] == "0.5,1,2,3,5,10"


def test_flat_keys_fill_the_groups():
    cfg = parse_run_config({"train.lr": 9e-6, "strategy.name": "fixed", "strategy.multiplier": 3, "cache.top-k": 8})
    assert cfg.train.lr == 9e-6 and cfg.strategy.name == "fixed" and cfg.strategy.multiplier == 3.0
    assert cfg.cache.top_k == 8


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("strategy.name", "fedprox", "'strategy.name' = 'fedprox' is invalid; allowed: one of 'fedavg', 'fixed', 'fedtops'"),
        ("strategy.trust-budget", -0.1, "'strategy.trust-budget' = -0.1 is invalid; allowed: a number >= 0, or inf"),
        ("strategy.trust-budget", "nan", "'strategy.trust-budget' = 'nan' is invalid; allowed: a number >= 0, or inf"),
        ("strategy.candidates", "0.5,,2", "'strategy.candidates' = '0.5,,2' is invalid: empty entry"),
        ("strategy.candidates", "1,two", "'strategy.candidates' = '1,two' is invalid"),
        ("strategy.candidates", "1,1", "duplicate candidates"),
        ("train.micro-batch", 0, "'train.micro-batch' = 0 is invalid; allowed: an integer >= 1"),
        ("rollout.top-p", 1.5, "'rollout.top-p' = 1.5 is invalid"),
        ("num-server-rounds", "many", "'num-server-rounds' = 'many' is invalid"),
        ("rollout.backend", "tpu", "'rollout.backend' = 'tpu'"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_run_config({key: value})


def test_mini_batch_must_be_a_multiple_of_the_micro_batch():
    with pytest.raises(ConfigError, match="'train.mini-batch' = 6 is not a multiple of 'train.micro-batch' = 4"):
        parse_run_config({"train.mini-batch": 6, "train.micro-batch": 4})


def test_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match="unknown run config key\\(s\\) 'train.learning-rate'"):
        parse_run_config({"train.learning-rate": 1e-5})


def test_total_local_steps_follow_rounds_rollouts_and_mini_batch():
    cfg = parse_run_config({"num-server-rounds": 50, "rollout.per-round": 32, "train.mini-batch": 8})
    assert cfg.total_local_steps == 200  # paper: 600 client steps system-wide = 3 clients x 200


def test_dataclass_defaults_are_the_apps_tiny_preset():
    from fedopd.config.presets import app_defaults

    assert parse_run_config(app_defaults()) == parse_run_config({})
    assert app_defaults() == RunConfig().to_run_config()


def test_config_cli_prints_the_resolved_config_of_a_valid_file(tmp_path, capsys):
    from fedopd.config.presets import main

    good = tmp_path / "good.toml"
    good.write_text('num-server-rounds = 50\n"train.lr" = 9e-6\n')
    assert main([str(good)]) == 0
    assert '"train.lr": 9e-06' in capsys.readouterr().out


def test_config_cli_exits_one_naming_a_bad_value_in_a_file(tmp_path, capsys):
    from fedopd.config.presets import main

    bad = tmp_path / "bad.toml"
    bad.write_text('"strategy.name" = "fedprox"\n')
    assert main([str(bad)]) == 1
    assert "'strategy.name' = 'fedprox' is invalid" in capsys.readouterr().err


def test_config_cli_exits_one_for_a_missing_file(tmp_path, capsys):
    from fedopd.config.presets import main

    assert main([str(tmp_path / "missing.toml")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_booleans_accept_toml_booleans_and_their_spelling():
    assert parse_run_config({"train.gradient-checkpointing": True}).train.gradient_checkpointing is True
    assert parse_run_config({"train.gradient-checkpointing": "false"}).train.gradient_checkpointing is False
    with pytest.raises(ConfigError, match="'train.gradient-checkpointing' = 1 is invalid; allowed: true or false"):
        parse_run_config({"train.gradient-checkpointing": 1})


def test_an_unknown_key_is_named_with_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"'strategy.nme' \(did you mean 'strategy.name'\?\)"):
        parse_run_config({"strategy.nme": "fedavg"})
    with pytest.raises(ConfigError) as err:
        parse_run_config({"zzz": 1})
    assert "did you mean" not in str(err.value)  # nothing close: no guess


def test_fixed_without_a_multiplier_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="'strategy.multiplier' is not set, and 'strategy.name' = 'fixed' needs it"):
        parse_run_config({"strategy.name": "fixed"})


def test_fixed_accepts_a_zero_multiplier_and_other_strategies_need_none():
    assert parse_run_config({"strategy.name": "fixed", "strategy.multiplier": 0.0}).strategy.multiplier == 0.0
    assert parse_run_config({"strategy.name": "fedavg"}).strategy.multiplier == -1.0  # not needed there


def test_a_negative_multiplier_other_than_unset_is_refused():
    with pytest.raises(ConfigError, match="'strategy.multiplier' = -2.0 is invalid"):
        parse_run_config({"strategy.name": "fixed", "strategy.multiplier": -2.0})


def test_config_cli_reads_run_config_overrides_as_flwr_run_does(capsys):
    import json

    from fedopd.config.presets import main

    assert main(["--run-config", "strategy.name='fixed' strategy.multiplier=3.0", "-c", "train.mini-batch=8"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["strategy.name"] == "fixed" and resolved["strategy.multiplier"] == 3.0
    assert resolved["train.mini-batch"] == 8 and resolved["train.micro-batch"] == 4  # the rest: defaults


def test_config_cli_names_the_closest_key_for_a_misspelt_override(capsys):
    from fedopd.config.presets import main

    assert main(["--run-config", "strategy.nme='fedavg'"]) == 1
    assert "did you mean 'strategy.name'" in capsys.readouterr().err


def test_config_cli_applies_the_cross_key_checks_to_overrides(capsys):
    from fedopd.config.presets import main

    assert main(["-c", "strategy.name='fixed'"]) == 1
    assert "'strategy.multiplier' is not set" in capsys.readouterr().err


def test_config_cli_passes_on_flowers_own_message_for_an_override_that_is_not_toml(capsys):
    from fedopd.config.presets import main

    assert main(["-c", "train.lr=abc"]) == 1
    assert "invalid format" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["vllm", "auto"])
@pytest.mark.parametrize("key", ["rollout.temperature", "eval.temperature"])
def test_a_temperature_above_two_is_refused_where_vllm_may_sample(backend, key):
    """vLLM's SamplingParams refuses temperatures above 2; 'auto' may choose vLLM on a GPU host."""
    with pytest.raises(ConfigError, match=f"'{key}' = 2.5 is invalid with 'rollout.backend' = '{backend}'"):
        parse_run_config({"rollout.backend": backend, key: 2.5})
    assert parse_run_config({"rollout.backend": backend, key: 2.0})  # the bound itself is allowed


def test_a_temperature_above_two_is_allowed_on_the_hf_engine():
    assert parse_run_config({"rollout.backend": "hf", "rollout.temperature": 2.5}).rollout.temperature == 2.5


@pytest.mark.parametrize("value", ["", " , ", "<|im_end|>,,<|endoftext|>"])
def test_stop_tokens_must_be_auto_or_a_list_of_tokens(value):
    with pytest.raises(ConfigError, match="'rollout.stop-tokens'"):
        parse_run_config({"rollout.stop-tokens": value})


def test_data_seed_is_a_non_negative_integer_with_the_papers_42_as_default():
    assert RunConfig().data.seed == 42
    with pytest.raises(ConfigError, match="'data.seed' = -1 is invalid; allowed: an integer >= 0"):
        parse_run_config({"data.seed": -1})


def test_an_infinite_trust_budget_parses_and_survives_config_json(tmp_path):
    from server_app.run_folder import _jsonable  # what config.json is written through

    for raw in ("inf", float("inf"), "Infinity"):
        assert parse_run_config({"strategy.trust-budget": raw}).strategy.trust_budget == float("inf")
    resolved = parse_run_config({"strategy.trust-budget": "inf"}).to_run_config()
    written = json.loads(json.dumps(_jsonable(resolved)))  # config.json has no Infinity literal
    assert written["strategy.trust-budget"] == "inf"
    assert parse_run_config(written).to_run_config() == resolved


def test_a_local_data_path_that_does_not_exist_is_refused_before_round_one_naming_its_key(tmp_path, capsys):
    """Before (issue 49): it passed the offline check, started the run and failed in every client
    with pages of traces. The offline check and the ServerApp (check_server_requirements) refuse
    it; a hub id and an existing file pass; nothing is read for a hub id."""
    from fedopd.config import check_server_requirements
    from fedopd.config.presets import main

    missing = tmp_path / "nope.jsonl"
    for key, value in (("data.path", str(missing)), ("data.path", "./nope/"), ("data.eval-path", "~/nope.csv")):
        cfg = parse_run_config({"data.name": "prompts", "data.partitioner": "iid", "data.path": "owner/set", key: value})
        with pytest.raises(ConfigError, match=f"run config '{key}' = .* is a local path that does not exist on this host"):
            check_server_requirements(cfg)
    assert main(["--run-config", f"data.name='prompts' data.partitioner='iid' data.path='{missing}'"]) == 1
    assert "run config 'data.path'" in capsys.readouterr().err
    missing.write_text('{"problem": "Compute 1 + 1.", "answer": "2"}\n')
    check_server_requirements(parse_run_config({"data.name": "prompts", "data.partitioner": "iid", "data.path": str(missing)}))
    check_server_requirements(parse_run_config({"data.name": "prompts", "data.partitioner": "iid", "data.path": "owner/set"}))


@pytest.mark.parametrize("name, chosen", [("sandbox", "groups"), ("math", "groups"), ("tiny-arith", "groups"), ("prompts", "iid")])
def test_the_default_partitioner_is_the_data_sets_own_and_the_config_records_the_choice(name, chosen):
    cfg = parse_run_config({"data.name": name, "eval.every": 0, **({"data.path": "owner/set"} if name == "prompts" else {})})
    assert cfg.data.partitioner == chosen
    assert cfg.to_run_config()["data.partitioner"] == chosen  # config.json says what was used, not 'auto'


def test_an_explicit_partitioner_that_the_data_set_lacks_is_still_refused():
    with pytest.raises(ConfigError, match="'data.partitioner' = 'groups' is not defined for 'data.name' = 'prompts'"):
        parse_run_config({"data.name": "prompts", "data.partitioner": "groups", "data.path": "owner/set", "eval.every": 0})


def test_the_offline_check_reads_a_local_prompt_files_columns_and_rows(tmp_path, capsys):
    from fedopd.config.presets import main

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "1+1", "solution": "2"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--run-config", f"data.name='prompts' data.path='{wrong}' eval.every=0"]) == 1
    assert "data.problem-column = 'problem' is not a column of" in capsys.readouterr().err
    assert main(["--run-config", f"data.name='prompts' data.path='{empty}' eval.every=0"]) == 1
    assert "is empty" in capsys.readouterr().err
    assert main(["--run-config", "data.name='prompts' data.path='owner/set' eval.every=0"]) == 0  # a hub id: not fetched, said so
    assert "data.path = 'owner/set' is not a path on this host, so its prompts were not read here" in capsys.readouterr().err


def test_the_offline_check_reads_what_the_loader_reads_and_says_what_it_did_not(tmp_path, monkeypatch):
    from fedopd.config.parse import check_local_prompts

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "myset").mkdir(parents=True)
    (tmp_path / "data" / "myset" / "a.jsonl").write_text('{"question": "1+1", "solution": "2"}\n')
    with pytest.raises(ConfigError, match="is not a column of"):  # a relative folder without ./ is still a local one
        check_local_prompts(parse_run_config({"data.name": "prompts", "data.path": "data/myset", "eval.every": 0}), 3)
    with pytest.raises(ConfigError, match="3 subject-group clients; num-partitions is 4"):  # needs no download
        check_local_prompts(parse_run_config({"data.name": "math", "eval.every": 0}), 4)
    assert "not downloaded for this offline check" in check_local_prompts(parse_run_config({"data.name": "math", "eval.every": 0}), 3)
    (tmp_path / "ok.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n' * 40)
    hub_eval = parse_run_config({"data.name": "prompts", "data.path": "ok.jsonl", "data.eval-path": "owner/evalset", "eval.every": 0})
    assert "data.eval-path = 'owner/evalset' is not a path on this host" in check_local_prompts(hub_eval, 3)
