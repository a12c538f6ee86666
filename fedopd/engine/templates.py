"""Whether the teacher's chat template renders the training prompt as the student's does.

Prompts are rendered with the student's chat template (:func:`fedopd.data.render_prompt`) and the
teacher scores those prompt ids followed by the response ids. When the teacher's own template
renders the same conversation differently, the teacher's distributions are conditioned on a prompt
it was not trained on, and nothing fails: the loss is still computed. This module renders a few
problems with both templates exactly as ``render_prompt`` does (one user message,
``add_generation_prompt=True``, ``enable_thinking=False``), tokenizes them as
:func:`fedopd.data.encode_prompts` does, and compares the ids:

- identical: nothing to say (:data:`OK`);
- different only before the generation prompt (a default system message, a date line):
  :data:`WARN`, naming the first differing token position and a window of tokens on each side;
  responses still start where the teacher's template would start them;
- different in the generation prompt (what ``add_generation_prompt=True`` appends, where the
  response starts: Qwen3's non-thinking template appends an empty ``<think>\\n\\n</think>\\n\\n``
  block that Qwen2.5's does not): :data:`FAIL`, naming the differing tokens and the fix.

The generation prompt is the text that rendering with ``add_generation_prompt=True`` adds to
rendering without it. A template that raises without it, adds nothing with it (one that ignores
it, "[INST] ... [/INST]"), or whose two renderings do not extend one another, has no separable
generation prompt; then the two renderings must have the same text after the user's message (its
turn close and what follows), else :data:`FAIL`.

A student without a chat template is a :data:`FAIL` (``render_prompt`` needs it); a teacher
without one is a :data:`WARN`: it scores the student's rendering and there is nothing to compare
it with. Templates that ignore ``enable_thinking`` (Qwen2.5's) render as they would without it.
Only tokenizers are read (:class:`~fedopd.models.vocab.ModelFiles`), no weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedopd.core.errors import ModelLoadError
from fedopd.models.vocab import ModelFiles

# The same strings as the row statuses of fedopd.preflight.
OK, WARN, FAIL = "ok", "warn", "FAIL"

# Fixed problems of the shapes the prompt sets hold: plain arithmetic, LaTeX with backslashes,
# braces and dollars, and several lines with surrounding spaces (templates that trim or branch on
# the content). The ServerApp has no problems loaded before round 1 (the clients load them).
PROBLEMS = (
    "What is 17 + 25?",
    "Let $f(x) = \\frac{x^2 + 1}{x - 1}$. Find $f(3)$ and write it as $\\{a, b\\}$ if needed.",
    "  A train travels 60 km in 45 minutes.\nWhat is its average speed in km/h?  ",
)
WINDOW = 12  # tokens shown on each side of a difference

FIX = (
    "make the templates agree: give the student a local copy whose chat_template.jinja (or, without that file, "
    "tokenizer_config.json's chat_template) carries the teacher's chat template, so that its rollouts start where "
    "the teacher's do, or give the teacher a copy with the student's"
)


@dataclass(frozen=True)
class TemplateCheck:
    """The outcome of :func:`compare_chat_templates`: a status (:data:`OK`, :data:`WARN`,
    :data:`FAIL`) and a message naming both models (for a log line or a preflight row)."""

    status: str
    message: str


@dataclass(frozen=True)
class _Rendering:
    ids: tuple[int, ...]  # the whole prompt, as encode_prompts tokenizes it
    generation: tuple[int, ...] | None  # the generation prompt's ids; None: not separable
    tail: str | None = None  # the text after the user's message (turn close and generation prompt); None: not found


def _messages(problem: str) -> list[dict]:
    from fedopd.data.prompts import format_problem

    return [{"role": "user", "content": format_problem(problem)}]


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, problem: str) -> _Rendering:
    """The prompt as ``render_prompt`` renders it, and its generation prompt where separable.
    Raises what the template raises for the prompt itself."""
    from fedopd.data.prompts import format_problem, render_prompt

    text = render_prompt(tokenizer, problem)
    ids = _encode(tokenizer, text)
    content = format_problem(problem)
    tail = text[text.rindex(content) + len(content) :] if content in text else None
    try:
        base = tokenizer.apply_chat_template(_messages(problem), tokenize=False, add_generation_prompt=False, enable_thinking=False)
    except Exception:  # noqa: BLE001 - a template that needs the generation prompt has no separable one
        return _Rendering(ids, None, tail)
    if not isinstance(base, str) or not text.startswith(base) or text == base:
        # not a prefix, or no generation prompt at all (a template that ignores add_generation_prompt,
        # e.g. "[INST] ... [/INST]"): where the response starts is not told apart from the rest
        return _Rendering(ids, None, tail)
    suffix = text[len(base) :]
    base_ids = _encode(tokenizer, base)
    if ids[: len(base_ids)] == base_ids:
        return _Rendering(ids, ids[len(base_ids) :], tail)
    return _Rendering(ids, _encode(tokenizer, suffix), tail)  # a token spans the boundary: the suffix on its own


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _window(tokenizer, ids: Sequence[int], start: int) -> str:
    part = list(ids[start : start + WINDOW])
    if not part:
        return "(nothing)"
    more = "..." if len(ids) > start + WINDOW else ""
    return f"{tokenizer.decode(part)!r}{more}"


def _generation_differs(s: _Rendering, t: _Rendering) -> bool:
    """Whether the two renderings start the response differently."""
    if s.generation is not None and t.generation is not None:
        return s.generation != t.generation
    # One side (or neither) separates its generation prompt: the response starts alike only if both
    # renderings have the same text after the user's message (its turn close and generation prompt).
    return s.tail is None or s.tail != t.tail


def _short(text: str | None, limit: int = 120) -> str:
    """A rendering's text for a message: its repr (control characters escaped), at most ``limit``
    characters of it; "(not found)" for None."""
    if text is None:
        return "(not found)"
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _refusal(student: ModelFiles, teacher: ModelFiles, s: _Rendering, t: _Rendering) -> str:
    pair = f"student '{student.name}' and teacher '{teacher.name}'"
    if s.generation is None or t.generation is None:
        i = _first_difference(s.ids, t.ids)
        return (
            f"the chat templates of {pair} render the training prompt differently, and not both separate a generation "
            f"prompt (rendering without add_generation_prompt fails, does not prefix the prompt, or adds nothing), so "
            f"where the response starts is compared by the text after the user's message: student {_short(s.tail)} vs "
            f"teacher {_short(t.tail)}; first difference at token {i} of {len(s.ids)} / {len(t.ids)}: student "
            f"{_window(student.tokenizer, s.ids, i)} vs teacher {_window(teacher.tokenizer, t.ids, i)}; {FIX}"
        )
    sg, tg = s.generation, t.generation
    i = _first_difference(sg, tg)
    return (
        f"the chat templates of {pair} end the training prompt differently: with add_generation_prompt=True "
        f"(enable_thinking=False) the student's appends {student.tokenizer.decode(list(sg))!r} ({len(sg)} tokens) and "
        f"the teacher's {teacher.tokenizer.decode(list(tg))!r} ({len(tg)} tokens); from token {i} of it: student "
        f"{_window(student.tokenizer, sg, i)} vs teacher {_window(teacher.tokenizer, tg, i)}. The teacher would score "
        f"responses that start where its own template never starts one, so the distillation loss is computed on "
        f"positions it was not trained for; {FIX}"
    )


def _warning(student: ModelFiles, teacher: ModelFiles, s: _Rendering, t: _Rendering, problem: int) -> str:
    i = _first_difference(s.ids, t.ids)
    if s.generation is not None and t.generation is not None:
        same = f"the same generation prompt ({_short(student.tokenizer.decode(list(s.generation)))})"
    else:
        same = f"the same text after the user's message ({_short(s.tail)})"
    return (
        f"the chat templates of student '{student.name}' and teacher '{teacher.name}' render the training prompt "
        f"differently before the generation prompt (e.g. a default system message, a date line, another turn close): "
        f"the teacher scores the student's prompt, which its own template renders otherwise; first difference at token {i} of "
        f"{len(s.ids)} / {len(t.ids)} (problem {problem + 1}): student {_window(student.tokenizer, s.ids, i)} vs teacher "
        f"{_window(teacher.tokenizer, t.ids, i)}. Both end with {same}, so responses start where the teacher's "
        f"template starts them; to condition the teacher on its own prompt, {FIX}"
    )


def compare_chat_templates(student: ModelFiles, teacher: ModelFiles, problems: Sequence[str] = PROBLEMS) -> TemplateCheck:
    """Render ``problems`` with the student's and the teacher's chat templates as
    :func:`fedopd.data.render_prompt` does and compare the token ids (module docstring). Never
    raises for a template; a :data:`FAIL` result says why and how to fix it."""
    pair = f"student '{student.name}' and teacher '{teacher.name}'"
    if not getattr(student.tokenizer, "chat_template", None):
        return TemplateCheck(
            FAIL,
            f"student '{student.name}' has no chat template: prompts are rendered with the student's chat template "
            f"(one user message, add_generation_prompt=True); give it one in chat_template.jinja or tokenizer_config.json",
        )
    if not getattr(teacher.tokenizer, "chat_template", None):
        return TemplateCheck(
            WARN,
            f"teacher '{teacher.name}' has no chat template: it scores the student's rendering of each prompt as it is, "
            f"and whether that is what the teacher was trained on cannot be checked",
        )
    warning = None
    for n, problem in enumerate(problems):
        try:
            s = _render(student.tokenizer, problem)
        except Exception as err:  # noqa: BLE001 - any template error: the prompts cannot be rendered
            return TemplateCheck(FAIL, f"the chat template of student '{student.name}' cannot render the training prompt: {_short(str(err), 300)}")
        try:
            t = _render(teacher.tokenizer, problem)
        except Exception as err:  # noqa: BLE001 - the teacher's template is only compared, never used
            return TemplateCheck(
                WARN, f"the chat template of teacher '{teacher.name}' cannot render the training prompt ({_short(str(err), 300)}): not compared"
            )
        if s.ids == t.ids:
            continue
        if _generation_differs(s, t):
            return TemplateCheck(FAIL, _refusal(student, teacher, s, t))
        warning = warning or _warning(student, teacher, s, t, n)
    if warning:
        return TemplateCheck(WARN, warning)
    return TemplateCheck(OK, f"the chat templates of {pair} render the training prompt to the same ids ({len(problems)} problems)")


def check_chat_templates(student: ModelFiles, teacher: ModelFiles, problems: Sequence[str] = PROBLEMS) -> TemplateCheck:
    """:func:`compare_chat_templates`, raising :class:`ModelLoadError` with its message on a :data:`FAIL`."""
    result = compare_chat_templates(student, teacher, problems)
    if result.status == FAIL:
        raise ModelLoadError(result.message)
    return result


def run_chat_templates(student: str, teacher: str, problems: Sequence[str] = PROBLEMS) -> TemplateCheck:
    """:func:`check_chat_templates` for a run's model names (tokenizers only): what the ServerApp
    does before round 1."""
    return check_chat_templates(ModelFiles.load(student), ModelFiles.load(teacher), problems)
