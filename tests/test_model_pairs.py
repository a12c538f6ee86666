"""Real checkpoints' metadata on the sandbox models: a Base student with an instruct teacher loads,
and rollouts end where the assistant turn ends (tests/model_fixtures.py says which real files each
copy mirrors)."""

import logging

import pytest
from model_fixtures import ENDOFTEXT, IM_END, ONE_ROUND

from fedopd.config import LoraSettings
from fedopd.core.errors import ModelLoadError
from fedopd.models.vocab import ModelFiles, check_same_vocabulary, end_of_turn_token, resolve_stop_tokens
from fedopd.rollout import SamplingParams

pytestmark = pytest.mark.slow


def _files(model_copies, name):
    return ModelFiles.load(model_copies.get(name, name))


@pytest.mark.parametrize("student", ["base-student", "qwen3-base-student"])
def test_a_base_student_with_an_instruct_teacher_loads(model_copies, student):
    from fedopd.models import load_pair

    s, t = load_pair(model_copies[student], model_copies["instruct-teacher"], lora=LoraSettings(), seed=0, dtype="float32")
    assert s.tokenizer.get_vocab() == t.tokenizer.get_vocab()
    assert s.tokenizer.eos_token_id != t.tokenizer.eos_token_id or student == "qwen3-base-student"


def test_a_teacher_with_another_token_to_id_map_is_refused_naming_a_token(model_copies):
    with pytest.raises(ModelLoadError, match=r"must share a vocabulary .*2 tokens with other ids \(e\.g\. '7': 27 vs 28\)"):
        check_same_vocabulary(_files(model_copies, "base-student"), _files(model_copies, "other-vocab-teacher"))


def test_different_eos_conventions_are_logged_once(model_copies, caplog, monkeypatch):
    monkeypatch.setattr("fedopd.models.vocab._NOTED", set())  # once per process: forget earlier tests' pairs
    student, teacher = _files(model_copies, "base-student"), _files(model_copies, "instruct-teacher")
    with caplog.at_level(logging.INFO, logger="fedopd"):
        check_same_vocabulary(student, teacher)
        check_same_vocabulary(student, teacher)
    notes = [r for r in caplog.records if "different conventions" in r.getMessage()]
    assert len(notes) == 1
    assert "['<|endoftext|>']" in notes[0].getMessage() and "'<|im_end|>'" in notes[0].getMessage()


@pytest.mark.parametrize(
    "student, teacher, expected",
    [
        ("base-student", "instruct-teacher", (ENDOFTEXT, IM_END)),  # student: tokenizer/config/generation <|endoftext|>
        ("qwen3-base-student", "instruct-teacher", (ENDOFTEXT, IM_END)),  # student's tokenizer alone has <|im_end|>
        ("qwen3-base-student", None, (ENDOFTEXT, IM_END)),  # both from the student's own inconsistent files
        ("base-student", None, (ENDOFTEXT,)),  # a Base student alone never stops at the turn's end
        ("builtin:sandbox-student", "builtin:sandbox-teacher", (IM_END,)),
    ],
)
def test_auto_stop_set_is_every_eos_id_that_student_or_teacher_declares(model_copies, student, teacher, expected):
    stop = resolve_stop_tokens("auto", _files(model_copies, student), _files(model_copies, teacher) if teacher else None)
    assert stop.ids == expected
    assert stop.tokens == tuple({ENDOFTEXT: "<|endoftext|>", IM_END: "<|im_end|>"}[i] for i in expected)


@pytest.mark.parametrize("setting, expected", [("<|im_end|>", (IM_END,)), (" <|im_end|> , <|endoftext|>", (ENDOFTEXT, IM_END))])
def test_stop_tokens_setting_lists_tokens_of_the_vocabulary(model_copies, setting, expected):
    stop = resolve_stop_tokens(setting, _files(model_copies, "base-student"), _files(model_copies, "instruct-teacher"))
    assert stop.ids == expected


def test_a_stop_token_outside_the_vocabulary_is_refused_naming_the_key_and_the_token(model_copies):
    with pytest.raises(ModelLoadError, match=r"'rollout.stop-tokens' = '<\|eot_id\|>' is invalid: '<\|eot_id\|>' is not a token"):
        resolve_stop_tokens("<|eot_id|>", _files(model_copies, "base-student"))


def test_the_chat_templates_end_of_turn_token_is_found_by_rendering_an_assistant_turn(model_copies):
    assert end_of_turn_token(_files(model_copies, "base-student").tokenizer) == IM_END


def _sandbox_prompts(tokenizer, count=8):
    from fedopd.data import encode_prompts
    from fedopd.sandbox.task import client_partition

    return [p.token_ids for p in encode_prompts(tokenizer, client_partition(1, 3, count, 42), 2048)]


def _models(student, teacher, stop_tokens="auto"):
    from fedopd.engine.round import load_client_models

    return load_client_models(student, teacher, lora=LoraSettings(), backend="hf", dtype="float32", stop_tokens=stop_tokens)


@pytest.mark.parametrize("student", ["base-student", "qwen3-base-student", "builtin:sandbox-student"])
def test_hf_rollouts_of_the_shipped_student_end_at_im_end_whichever_eos_its_files_declare(model_copies, student):
    models = _models(model_copies.get(student, student), model_copies["instruct-teacher"])
    assert IM_END in models.rollout.eos_ids and models.stop_tokens.ids == (ENDOFTEXT, IM_END)
    models.rollout.set_adapter(models.student.get_lora_arrays())
    out = models.rollout.generate(_sandbox_prompts(models.student.tokenizer), SamplingParams(max_new_tokens=128, temperature=1.0, seed=5))
    finished = [r for r, capped in zip(out.response_ids, out.capped) if not capped]
    assert len(finished) >= 6  # the sandbox student ends its turn well within 128 tokens
    assert all(r[-1] == IM_END and IM_END not in r[:-1] for r in finished)


def test_a_base_students_own_eos_alone_runs_past_the_end_of_the_turn(model_copies):
    """Why the stop set takes the teacher's ids: stopping only at <|endoftext|>, the same student
    writes <|im_end|> and carries on into a new turn."""
    models = _models(model_copies["base-student"], model_copies["instruct-teacher"], stop_tokens="<|endoftext|>")
    models.rollout.set_adapter(models.student.get_lora_arrays())
    out = models.rollout.generate(_sandbox_prompts(models.student.tokenizer), SamplingParams(max_new_tokens=128, temperature=1.0, seed=5))
    assert sum(IM_END in r[:-1] for r in out.response_ids) >= 6


def test_hf_sampling_ignores_the_sampling_defaults_a_models_generation_config_ships(model_copies):
    """An instruct student's generation config says temperature 0.6, top-p 0.95, top-k 20; a run
    at temperature 1 and top-p 1 samples exactly as from a student without them (same stop set)."""
    from fedopd.rollout import HFRolloutEngine

    plain = _models("builtin:sandbox-student", "builtin:sandbox-teacher")
    instruct = _models(model_copies["instruct-student"], "builtin:sandbox-teacher")
    assert instruct.student.causal_lm.generation_config.top_k == 20  # the defaults are really there
    prompts = _sandbox_prompts(plain.student.tokenizer, 12)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, top_p=1.0, seed=9)
    runs = []
    for models in (plain, instruct):
        engine = HFRolloutEngine(models.student, stop_token_ids=[IM_END])
        engine.set_adapter(models.student.get_lora_arrays())
        runs.append(engine.generate(prompts, params).response_ids)
    assert runs[0] == runs[1]
    # The comparison can see inherited settings: the shipped defaults themselves sample otherwise.
    engine = HFRolloutEngine(plain.student, stop_token_ids=[IM_END])
    assert engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0.6, top_p=0.95, seed=9)).response_ids != runs[0]


def test_eval_run_stops_where_training_stops_when_given_the_teacher(model_copies):
    from eval.run import evaluation_stop_tokens

    assert evaluation_stop_tokens(model_copies["base-student"], model_copies["instruct-teacher"], "auto").ids == (ENDOFTEXT, IM_END)
    assert evaluation_stop_tokens(model_copies["base-student"], None, "auto").ids == (ENDOFTEXT,)
    assert evaluation_stop_tokens(model_copies["base-student"], None, "<|im_end|>").ids == (IM_END,)


def test_a_run_of_the_base_instruct_pair_records_its_resolved_stop_set_in_config_json(model_copies, tmp_path):
    import json

    from server_app.inprocess import run_in_process

    run = run_in_process(
        {**ONE_ROUND, "output-dir": str(tmp_path), "model.student": model_copies["base-student"], "model.teacher": model_copies["instruct-teacher"]}
    )
    config = json.loads((run / "config.json").read_text())
    assert config["rollout.stop-tokens"] == "auto"
    assert config["resolved"]["rollout.stop-tokens"] == {"ids": [ENDOFTEXT, IM_END], "tokens": ["<|endoftext|>", "<|im_end|>"]}
    assert json.loads((run / "status.json").read_text())["status"] == "completed"


def test_a_pair_with_another_vocabulary_stops_the_run_before_anything_is_written(model_copies, tmp_path):
    from server_app.inprocess import run_in_process

    with pytest.raises(ModelLoadError, match="must share a vocabulary"):
        run_in_process(
            {
                **ONE_ROUND,
                "output-dir": str(tmp_path / "runs"),
                "model.student": model_copies["base-student"],
                "model.teacher": model_copies["other-vocab-teacher"],
            }
        )
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
