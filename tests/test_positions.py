"""A run's longest prompt plus its longest response must fit the student's and the teacher's
positions (fedopd.models.positions): read as vLLM derives them, refused before round 1 naming the keys,
for the HF engine as for vLLM, and vLLM's context never exceeds them."""

import pytest

from fedopd.config import ConfigError, parse_run_config
from fedopd.models.positions import check_run_positions, engine_context, model_positions, needed_positions, position_problem

# config.json facts of real checkpoints (hub pages, 2026-11):
# Qwen/Qwen3-0.6B-Base: "max_position_embeddings": 32768, "rope_scaling": null.
QWEN3_06B_BASE = {"model_type": "qwen3", "max_position_embeddings": 32768, "rope_scaling": None}
# Qwen/Qwen3-8B (the paper's teacher): "max_position_embeddings": 40960, "rope_scaling": null.
QWEN3_8B = {"model_type": "qwen3", "max_position_embeddings": 40960, "rope_scaling": None}
# meta-llama/Llama-3.1-8B: 131072 positions, rope_scaling of type llama3 (factor 8, already applied).
LLAMA31 = {"max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
# lmsys/vicuna-7b-v1.5-16k: 4096 positions stretched 4x by linear RoPE scaling = 16384.
VICUNA_16K = {"max_position_embeddings": 4096, "rope_scaling": {"factor": 4.0, "type": "linear"}}
# CohereForAI/c4ai-command-r-v01: "max_position_embeddings": 8192, "model_max_length": 131072;
# vLLM takes model_max_length where a config has it (derive_max_model_len_and_key, "Command-R").
COMMAND_R = {"max_position_embeddings": 8192, "model_max_length": 131072}
# openai-community/gpt2: "n_positions": 1024.
GPT2 = {"n_positions": 1024, "n_ctx": 1024}


@pytest.mark.parametrize(
    "config, expected",
    [
        (QWEN3_06B_BASE, (32768, "max_position_embeddings")),
        (QWEN3_8B, (40960, "max_position_embeddings")),
        (LLAMA31, (131072, "max_position_embeddings")),
        (VICUNA_16K, (16384, "max_position_embeddings x rope factor 4")),
        (GPT2, (1024, "n_positions")),
        (COMMAND_R, (131072, "model_max_length")),
        ({"max_position_embeddings": 4096, "seq_length": 2048}, (2048, "seq_length")),  # the smallest key wins
        ({"text_config": {"max_position_embeddings": 8192}, "max_position_embeddings": 99}, (8192, "max_position_embeddings")),
        ({"hidden_size": 8}, (None, None)),
    ],
)
def test_model_positions_are_read_as_vllm_derives_them(config, expected):
    assert model_positions(config) == expected


def test_transformers_5_rope_parameters_per_layer_type_scale_the_positions():
    config = {"max_position_embeddings": 1000, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}}
    assert model_positions(config)[0] == 2000


def test_the_paper_setting_fits_qwen3():
    # data.max-prompt-tokens 2048 + eval.max-new-tokens 8192 (configs/paper-*.toml) = 10240 <= 32768
    lengths = dict(max_prompt_tokens=2048, max_new_tokens=4096, eval_max_new_tokens=8192)
    assert needed_positions(**lengths) == 10240
    assert position_problem("model.student", "Qwen/Qwen3-0.6B-Base", QWEN3_06B_BASE, **lengths) is None
    assert position_problem("model.teacher", "Qwen/Qwen3-8B", QWEN3_8B, **lengths) is None


def test_a_run_longer_than_the_model_is_refused_naming_the_keys_and_the_value_that_fits():
    # the failure vLLM met on the sandbox student: 2048 + 128 = 2176 > 512
    problem = position_problem(
        "model.student", "builtin:sandbox-student", {"max_position_embeddings": 512}, max_prompt_tokens=2048, max_new_tokens=128
    )
    assert problem == (
        "data.max-prompt-tokens (2048) + rollout.max-new-tokens (128) = 2176 positions, but model.student 'builtin:sandbox-student' "
        "has 512 (max_position_embeddings in its config.json); lower data.max-prompt-tokens to at most 384, or rollout.max-new-tokens"
    )


def test_the_evaluation_cap_counts_when_it_is_the_longer_one():
    problem = position_problem(
        "model.teacher", "t", {"max_position_embeddings": 512}, max_prompt_tokens=384, max_new_tokens=128, eval_max_new_tokens=256
    )
    assert problem.startswith("data.max-prompt-tokens (384) + eval.max-new-tokens (256) = 640 positions, but model.teacher 't' has 512")
    assert "at most 256" in problem
    assert position_problem("model.teacher", "t", {"max_position_embeddings": 512}, max_prompt_tokens=384, max_new_tokens=128) is None


def test_a_response_cap_alone_longer_than_the_model_names_it():
    problem = position_problem("model.student", "s", {"max_position_embeddings": 512}, max_prompt_tokens=8, max_new_tokens=600)
    assert problem.endswith("lower rollout.max-new-tokens below 512")


def test_exactly_the_models_positions_fit():
    assert position_problem("model.student", "s", {"max_position_embeddings": 512}, max_prompt_tokens=384, max_new_tokens=128) is None


def test_the_engine_context_is_what_the_run_needs_capped_at_the_model():
    assert engine_context({"max_position_embeddings": 512}, 300) == 300
    assert engine_context({"max_position_embeddings": 512}, 2176) == 512
    assert engine_context({"max_position_embeddings": 512}, None) == 512
    assert engine_context({}, None) == 2048  # vLLM's assumption for a config that declares nothing


def _cfg(**overrides):
    from fedopd.config.presets import app_defaults

    return parse_run_config({**app_defaults(), **overrides})


def test_the_default_preset_fits_the_sandbox_models():
    from fedopd.models.positions import load_model_config

    cfg = _cfg()
    check_run_positions(cfg, load_model_config(cfg.model.student), load_model_config(cfg.model.teacher))


@pytest.mark.parametrize("role", ["student", "teacher"])
def test_the_run_check_covers_both_models(role):
    short, long = {"max_position_embeddings": 256}, {"max_position_embeddings": 4096}
    configs = {"student": long, "teacher": long, role: short}
    with pytest.raises(ConfigError, match=f"but model.{role} 'builtin:sandbox-{role}' has 256"):
        check_run_positions(_cfg(), configs["student"], configs["teacher"])


def test_the_evaluation_cap_is_not_checked_when_the_run_does_not_evaluate():
    fits = {"max_position_embeddings": 512}
    check_run_positions(_cfg(**{"eval.every": 0, "eval.max-new-tokens": 4096}), fits, fits)
    with pytest.raises(ConfigError, match=r"eval.max-new-tokens \(4096\)"):
        check_run_positions(_cfg(**{"eval.max-new-tokens": 4096}), fits, fits)


def test_the_hf_client_refuses_a_run_past_the_models_positions():
    """The HF engine would run past the positions silently (RoPE extrapolates): the client refuses."""
    from fedopd.config import LoraSettings
    from fedopd.engine.round import load_client_models

    with pytest.raises(ValueError, match=r"this run needs 2176 positions .* but model.student 'builtin:sandbox-student' has 512"):
        load_client_models(
            "builtin:sandbox-student", "builtin:sandbox-teacher", lora=LoraSettings(), backend="hf", dtype="float32", max_model_len=2176
        )
    models = load_client_models(
        "builtin:sandbox-student", "builtin:sandbox-teacher", lora=LoraSettings(), backend="hf", dtype="float32", max_model_len=512
    )
    assert models.rollout is not None


def test_a_run_past_the_positions_stops_before_anything_is_written(tmp_path):
    """The ServerApp refuses it before round 1: no run folder, the keys named."""
    from server_app.inprocess import run_in_process

    with pytest.raises(ConfigError, match=r"data.max-prompt-tokens \(2048\) \+ rollout.max-new-tokens \(128\) = 2176 positions"):
        run_in_process({"data.max-prompt-tokens": 2048, "num-server-rounds": 1, "output-dir": str(tmp_path / "runs")})
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
