"""The paper presets validate offline and carry the paper's settings."""

from pathlib import Path

import pytest

from fedopd.config import parse_run_config
from fedopd.config.presets import app_defaults, load_preset, main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = {
    "paper-0.6b-1x": ("Qwen/Qwen3-0.6B-Base", 3e-6),
    "paper-0.6b-3x": ("Qwen/Qwen3-0.6B-Base", 9e-6),
    "paper-1.7b": ("Qwen/Qwen3-1.7B-Base", 3e-6),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_validates_and_carries_the_paper_values(name, capsys):
    path = CONFIGS / f"{name}.toml"
    assert main([str(path)]) == 0
    capsys.readouterr()
    overrides = load_preset(path)
    assert set(overrides) == set(app_defaults())  # every key is set by the preset
    cfg = parse_run_config({**app_defaults(), **overrides})
    student, lr = PRESETS[name]
    assert (cfg.model.student, cfg.model.teacher, cfg.train.lr) == (student, "Qwen/Qwen3-8B", lr)
    assert cfg.rollout.backend == "vllm" and cfg.data.name == "math" and cfg.data.prompts_per_client == 570
    assert cfg.num_server_rounds == 50 and cfg.seed == 42 and cfg.num_clients == 3
    assert (cfg.rollout.per_round, cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p) == (32, 4096, 1.0, 1.0)
    assert cfg.data.max_prompt_tokens == 2048
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (8, 16.0, 0.0)
    assert (cfg.train.mini_batch, cfg.train.micro_batch) == (8, 4) and cfg.train.gradient_checkpointing
    assert (cfg.strategy.name, cfg.strategy.trust_budget, cfg.strategy.candidates) == ("fedtops", 0.05, (0.5, 1.0, 2.0, 3.0, 5.0, 10.0))
    assert (cfg.cache.rollouts, cfg.cache.positions, cfg.cache.top_k) == (4, 16, 16)
    assert cfg.total_local_steps == 200  # 600 client steps over 3 clients


@pytest.mark.parametrize("name", list(PRESETS))
def test_flower_reads_the_preset_file_with_the_same_keys(name):
    from flwr.common.config import parse_config_args

    parsed = parse_config_args([str(CONFIGS / f"{name}.toml")])
    assert parsed == load_preset(CONFIGS / f"{name}.toml")


def test_a_bad_preset_value_exits_non_zero_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text((CONFIGS / "paper-0.6b-1x.toml").read_text().replace('"rollout.backend" = "vllm"', '"rollout.backend" = "tgi"'))
    assert main([str(bad)]) == 1
    assert "'rollout.backend' = 'tgi' is invalid" in capsys.readouterr().err
