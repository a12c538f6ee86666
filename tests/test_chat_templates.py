"""The student's and the teacher's chat templates render the training prompt alike
(fedopd.engine.templates), on sandbox-model copies carrying real checkpoints' chat templates
(tests/model_fixtures.py cites each). The expected renderings below are read off the templates by
hand; token positions are those of the hand-written text under the sandbox tokenizer."""

import json
import logging
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_fixtures import ONE_ROUND

from fedopd.core.errors import ModelLoadError
from fedopd.data.prompts import INSTRUCTION, render_prompt
from fedopd.engine.templates import FAIL, OK, WARN, check_chat_templates, compare_chat_templates
from fedopd.models.vocab import ModelFiles

PROBLEM = "What is 2 + 3?"
USER = f"<|im_start|>user\n{PROBLEM}\n{INSTRUCTION}<|im_end|>\n"
QWEN25_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
MATH_SYSTEM = "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
QWEN25_GENERATION = "<|im_start|>assistant\n"
QWEN3_GENERATION = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _files(model_copies, name):
    return ModelFiles.load(model_copies.get(name, name))


def _ids(files, text):
    return files.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("qwen2.5-instruct-student", QWEN25_SYSTEM + USER + QWEN25_GENERATION),  # ignores enable_thinking
        ("qwen2.5-math-teacher", MATH_SYSTEM + USER + QWEN25_GENERATION),
        ("qwen3-teacher", USER + QWEN3_GENERATION),
        ("builtin:sandbox-teacher", USER + QWEN3_GENERATION),
    ],
)
def test_the_real_templates_render_the_training_prompt_as_read_by_hand(model_copies, name, expected):
    assert render_prompt(_files(model_copies, name).tokenizer, PROBLEM) == expected


@pytest.mark.parametrize(
    "student, teacher",
    [
        ("qwen2.5-instruct-student", "qwen2.5-instruct-student"),  # one template that ignores enable_thinking
        ("qwen3-student", "qwen3-teacher"),
        ("builtin:sandbox-student", "builtin:sandbox-teacher"),
        ("qwen3-student", "builtin:sandbox-teacher"),  # other template text, the same rendering
    ],
)
def test_templates_that_render_the_same_ids_pass_silently(model_copies, student, teacher):
    result = check_chat_templates(_files(model_copies, student), _files(model_copies, teacher))
    assert result.status == OK


def test_a_qwen25_instruct_student_with_a_qwen3_teacher_is_refused_naming_the_think_block(model_copies):
    student, teacher = _files(model_copies, "qwen2.5-instruct-student"), _files(model_copies, "qwen3-teacher")
    with pytest.raises(ModelLoadError) as err:
        check_chat_templates(student, teacher, [PROBLEM])
    message = str(err.value)
    start = len(_ids(student, QWEN25_GENERATION))  # the generation prompts agree up to Qwen3's think block
    assert f"student '{student.name}' and teacher '{teacher.name}'" in message
    assert f"the student's appends {QWEN25_GENERATION!r} ({start} tokens)" in message
    assert f"the teacher's {QWEN3_GENERATION!r} ({len(_ids(teacher, QWEN3_GENERATION))} tokens)" in message
    assert f"from token {start} of it: student (nothing) vs teacher {'<think>' + chr(10) * 2 + '</think>' + chr(10) * 2!r}" in message
    assert "chat_template.jinja" in message and "tokenizer_config.json" in message  # the fix


def test_a_qwen3_student_with_a_qwen25_teacher_is_refused_the_other_way_round(model_copies):
    result = compare_chat_templates(_files(model_copies, "qwen3-student"), _files(model_copies, "qwen2.5-math-teacher"), [PROBLEM])
    assert result.status == FAIL
    assert f"the student's appends {QWEN3_GENERATION!r}" in result.message and f"the teacher's {QWEN25_GENERATION!r}" in result.message


def test_a_different_default_system_message_is_a_warning_naming_the_first_differing_tokens(model_copies):
    student, teacher = _files(model_copies, "qwen2.5-instruct-student"), _files(model_copies, "qwen2.5-math-teacher")
    result = check_chat_templates(student, teacher, [PROBLEM])  # no refusal
    assert result.status == WARN
    position = len(_ids(student, "<|im_start|>system\n"))  # the two system messages part after this
    student_len = len(_ids(student, QWEN25_SYSTEM + USER + QWEN25_GENERATION))
    teacher_len = len(_ids(teacher, MATH_SYSTEM + USER + QWEN25_GENERATION))
    assert f"first difference at token {position} of {student_len} / {teacher_len}" in result.message
    assert "student 'You are Qwen" in result.message and "teacher 'Please reason step" in result.message
    assert f"the same generation prompt ({QWEN25_GENERATION!r})" in result.message


def test_a_date_line_one_day_apart_is_found_by_the_ids_not_by_the_length(model_copies):
    """The Qwen2.5-7B-Instruct template with its default system message replaced by the date lines
    of Llama-3.1-8B-Instruct's template ("Cutting Knowledge Date: December 2023", "Today Date: "
    + date_string; huggingface.js e2e.test.js): two days give prompts of one length."""
    student, teacher = _files(model_copies, "qwen2.5-instruct-student"), _files(model_copies, "qwen2.5-instruct-student")
    default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    texts = {}
    for files, day in ((student, "26"), (teacher, "27")):
        line = f"Cutting Knowledge Date: December 2023\\nToday Date: {day} Jul 2024"
        files.tokenizer.chat_template = files.tokenizer.chat_template.replace(default, line)
        texts[day] = _ids(
            files, f"<|im_start|>system\nCutting Knowledge Date: December 2023\nToday Date: {day} Jul 2024<|im_end|>\n" + USER + QWEN25_GENERATION
        )
    assert len(texts["26"]) == len(texts["27"])  # what a length comparison would call equal
    position = next(i for i, (a, b) in enumerate(zip(texts["26"], texts["27"])) if a != b)
    result = compare_chat_templates(student, teacher, [PROBLEM])
    assert result.status == WARN and f"first difference at token {position} of {len(texts['26'])} / {len(texts['27'])}" in result.message


def test_a_student_without_a_chat_template_is_refused_and_a_teacher_without_one_is_a_warning(model_copies):
    plain = _files(model_copies, "no-template-teacher")
    with pytest.raises(ModelLoadError, match=r"student '.*no-template-teacher' has no chat template"):
        check_chat_templates(plain, _files(model_copies, "builtin:sandbox-teacher"))
    result = check_chat_templates(_files(model_copies, "builtin:sandbox-student"), plain)
    assert result.status == WARN and "has no chat template: it scores the student's rendering" in result.message


NEEDS_GENERATION = (  # raises without add_generation_prompt, else renders as the sandbox template
    "{%- if not add_generation_prompt %}{{ raise_exception('no generation prompt') }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
)


@pytest.mark.parametrize(
    "generation, teacher_generation, status",
    [
        (QWEN3_GENERATION, "qwen3-teacher", OK),
        (QWEN3_GENERATION, "qwen2.5-math-teacher", FAIL),  # the teacher's generation prompt is not at the end
        (QWEN25_GENERATION, "qwen2.5-math-teacher", WARN),  # it is: the system message alone differs
        (QWEN25_GENERATION, None, WARN),  # neither separates one; the same text follows the user's message on both
    ],
)
def test_a_template_that_raises_without_the_generation_prompt_is_compared_by_the_other_sides(model_copies, generation, teacher_generation, status):
    student = _files(model_copies, "builtin:sandbox-student")
    student.tokenizer.chat_template = NEEDS_GENERATION + "{{- '" + generation.replace("\n", "\\n") + "' }}"
    if teacher_generation is None:
        teacher = _files(model_copies, "builtin:sandbox-teacher")
        teacher.tokenizer.chat_template = "{{- '<|im_start|>system\\nS<|im_end|>\\n' }}" + student.tokenizer.chat_template
    else:
        teacher = _files(model_copies, teacher_generation)
    assert compare_chat_templates(student, teacher, [PROBLEM]).status == status


def test_the_serverapp_refuses_a_qwen3_teacher_for_a_qwen25_student_before_round_1(model_copies, tmp_path):
    from server_app.inprocess import run_in_process

    with pytest.raises(ModelLoadError, match=r"qwen2\.5-instruct-student' and teacher '.*qwen3-teacher'.*<think>"):
        run_in_process(
            {
                **ONE_ROUND,
                "output-dir": str(tmp_path / "runs"),
                "model.student": model_copies["qwen2.5-instruct-student"],
                "model.teacher": model_copies["qwen3-teacher"],
            }
        )
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_serverapp_logs_a_system_message_difference_once_and_goes_on(model_copies, tmp_path, monkeypatch, caplog):
    """Stopped at the next check (check_positions) so that no round runs: the warning came before it."""
    from server_app import app
    from server_app.inprocess import run_in_process

    def reached(cfg):
        raise RuntimeError("reached check_positions")

    monkeypatch.setattr(app, "check_positions", reached)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="reached check_positions"):
        run_in_process(
            {
                **ONE_ROUND,
                "output-dir": str(tmp_path / "runs"),
                "model.student": model_copies["qwen2.5-instruct-student"],
                "model.teacher": model_copies["qwen2.5-math-teacher"],
            }
        )
    warnings = [r for r in caplog.records if "before the generation prompt" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


# ---------------------------------------------------------------------------------------------
# Generated templates: a model's files come from another party (a hub, a colleague's folder)
# ---------------------------------------------------------------------------------------------

GENERATED = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text the sandbox tokenizer encodes and decodes without loss (so that two different strings are
# two different id sequences), jinja's and the templates' own markers included.
SAFE = st.text(alphabet=string.ascii_letters + string.digits + " .,:;!?+-*/=()\n{}%#'\"\\", max_size=24)


def _literal(text: str) -> str:
    """``text`` as a jinja string expression."""
    return "{{- " + json.dumps(text) + " }}"


def _template(preamble: str, generation: str) -> str:
    """A ChatML template with ``preamble`` before the conversation and ``generation`` as its
    generation prompt, written as a hub template is (jinja over ``messages``)."""
    return (
        _literal(preamble)
        + "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        + "{%- if add_generation_prompt %}"
        + _literal("<|im_start|>assistant\n" + generation)
        + "{%- endif %}"
    )


@pytest.fixture(scope="module")
def sandbox_pair():
    pair = ModelFiles.load("builtin:sandbox-student"), ModelFiles.load("builtin:sandbox-teacher")
    templates = [files.tokenizer.chat_template for files in pair]
    yield pair
    for files, template in zip(pair, templates):  # put back what the examples replaced
        files.tokenizer.chat_template = template


def _with(files, template):
    files.tokenizer.chat_template = template
    return files


@GENERATED
@given(preamble=SAFE, generation=SAFE)
def test_one_generated_template_on_both_sides_is_ok(sandbox_pair, preamble, generation):
    student, teacher = sandbox_pair
    template = _template(preamble, generation)
    assert compare_chat_templates(_with(student, template), _with(teacher, template), [PROBLEM]).status == OK


@GENERATED
@given(preambles=st.lists(SAFE, min_size=2, max_size=2, unique=True), generation=SAFE)
def test_generated_templates_that_differ_only_before_the_generation_prompt_warn(sandbox_pair, preambles, generation):
    student, teacher = sandbox_pair
    result = compare_chat_templates(
        _with(student, _template(preambles[0], generation)), _with(teacher, _template(preambles[1], generation)), [PROBLEM]
    )
    assert result.status == WARN, result.message


@GENERATED
@given(preamble=SAFE, generations=st.lists(SAFE, min_size=2, max_size=2, unique=True))
def test_generated_templates_whose_generation_prompts_differ_are_refused(sandbox_pair, preamble, generations):
    student, teacher = sandbox_pair
    result = compare_chat_templates(
        _with(student, _template(preamble, generations[0])), _with(teacher, _template(preamble, generations[1])), [PROBLEM]
    )
    assert result.status == FAIL, result.message


@GENERATED
@given(student_template=st.text(max_size=80), teacher_template=st.text(max_size=80))
def test_any_template_text_gives_a_result_and_never_raises(sandbox_pair, student_template, teacher_template):
    """Broken jinja, templates that raise, render nothing or render control characters: always a
    status, and a message that is one line of printable text."""
    student, teacher = sandbox_pair
    result = compare_chat_templates(_with(student, student_template), _with(teacher, teacher_template), [PROBLEM])
    assert result.status in (OK, WARN, FAIL)
    assert "\n" not in result.message and result.message.isprintable(), result.message


def test_templates_that_ignore_add_generation_prompt_and_end_the_prompt_differently_are_refused(model_copies):
    """A Mistral-style and an Alpaca-style template render nothing more with add_generation_prompt:
    no generation prompt is separable, and the text after the user's message differs (review find)."""
    student, teacher = _files(model_copies, "builtin:sandbox-student"), _files(model_copies, "builtin:sandbox-teacher")
    student.tokenizer.chat_template = "{%- for m in messages %}{{- '[INST] ' + m['content'] + ' [/INST]' }}{%- endfor %}"
    teacher.tokenizer.chat_template = "{%- for m in messages %}{{- 'User: ' + m['content'] + '\\nAssistant:' }}{%- endfor %}"
    result = compare_chat_templates(student, teacher, [PROBLEM])
    assert result.status == FAIL and "student ' [/INST]' vs teacher '\\nAssistant:'" in result.message


def test_a_short_generation_prompt_that_ends_another_ending_too_is_refused(model_copies):
    """The student's generation prompt is two newlines; the teacher (whose template raises without
    the generation prompt) ends with Qwen3's think block, which also ends with two newlines."""
    student, teacher = _files(model_copies, "builtin:sandbox-student"), _files(model_copies, "qwen3-teacher")
    student.tokenizer.chat_template = (
        "{%- for m in messages %}{{- 'Question: ' + m['content'] }}{%- endfor %}{%- if add_generation_prompt %}{{- '\\n\\n' }}{%- endif %}"
    )
    teacher.tokenizer.chat_template = "{%- if not add_generation_prompt %}{{ raise_exception('x') }}{%- endif %}" + teacher.tokenizer.chat_template
    assert compare_chat_templates(student, teacher, [PROBLEM]).status == FAIL
