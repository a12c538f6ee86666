"""The student/teacher pair's shared vocabulary, and where a response ends.

On-policy distillation compares the two models' distributions token id by token id, so the pair
must map every token to the same id. It need not end sequences the same way: the standard pairing
is a Base student with an instruct teacher, and they declare different EOS tokens over one
vocabulary (Llama 3.x Base ``<|end_of_text|>`` vs Instruct ``<|eot_id|>``; Qwen2.5-Coder Base
``<|endoftext|>`` vs Instruct ``<|im_end|>``; Qwen3 Base's tokenizer says ``<|im_end|>`` while its
``config.json`` and ``generation_config.json`` say ``<|endoftext|>``, QwenLM/Qwen3 issue 1422).

A rollout is an assistant turn of the chat template, so it must stop where the turn ends even
when the student's own files declare only its pre-training EOS. The stop set (run config
``rollout.stop-tokens = "auto"``) is therefore the union of the EOS ids that the student and the
teacher declare in their tokenizers, ``config.json`` and ``generation_config.json``. Everything
here reads tokenizers and configs only: no weights are loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedopd.core.errors import ModelLoadError

LOG = logging.getLogger("fedopd")
STOP_TOKENS_KEY = "rollout.stop-tokens"
_NOTED: set[tuple] = set()


@dataclass(frozen=True)
class ModelFiles:
    """What a model declares about its tokens, without its weights."""

    name: str
    tokenizer: Any
    config: Any = None  # transformers PretrainedConfig (config.json)
    generation_config: Any = None  # transformers GenerationConfig (generation_config.json), if any

    @classmethod
    def of(cls, lm) -> ModelFiles:
        """From a loaded :class:`fedopd.models.CausalLM`."""
        model = lm.causal_lm
        return cls(lm.name, lm.tokenizer, model.config, getattr(model, "generation_config", None))

    @classmethod
    def load(cls, name: str) -> ModelFiles:
        """Tokenizer, config and generation config of a hub id, local folder or built-in name."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from fedopd.models.paths import resolve_model_path

        path = resolve_model_path(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"could not read the tokenizer and config of model '{name}' (resolved to '{path}'): {err}") from err
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: nothing more declared
            generation = None
        return cls(name, tokenizer, config, generation)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def declared_eos(files: ModelFiles) -> dict[str, list[int]]:
    """The EOS ids a model declares, by source: ``tokenizer``, ``config``, ``generation_config``."""
    out = {"tokenizer": _ids(getattr(files.tokenizer, "eos_token_id", None))}
    if files.config is not None:
        out["config"] = _ids(getattr(files.config, "eos_token_id", None))
    if files.generation_config is not None:
        out["generation_config"] = _ids(getattr(files.generation_config, "eos_token_id", None))
    return out


def eos_ids(files: ModelFiles) -> list[int]:
    """The union of :func:`declared_eos`, sorted."""
    return sorted({i for ids in declared_eos(files).values() for i in ids})


def token_names(tokenizer, ids: Iterable[int]) -> list[str]:
    return [str(tokenizer.convert_ids_to_tokens(int(i))) for i in ids]


def check_same_vocabulary(student: ModelFiles, teacher: ModelFiles) -> None:
    """Refuse a pair whose vocabularies (token → id) differ; note different EOS conventions once.

    Different EOS tokens over one vocabulary are the normal Base-student / instruct-teacher pair:
    not an error (the stop set takes both, :func:`resolve_stop_tokens`).
    """
    s, t = student.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    if s != t:
        only_s = sorted(set(s) - set(t))
        only_t = sorted(set(t) - set(s))
        moved = sorted(k for k in set(s) & set(t) if s[k] != t[k])
        detail = []
        if only_s:
            detail.append(f"{len(only_s)} tokens only in the student's (e.g. {only_s[0]!r})")
        if only_t:
            detail.append(f"{len(only_t)} tokens only in the teacher's (e.g. {only_t[0]!r})")
        if moved:
            detail.append(f"{len(moved)} tokens with other ids (e.g. {moved[0]!r}: {s[moved[0]]} vs {t[moved[0]]})")
        raise ModelLoadError(
            f"student '{student.name}' and teacher '{teacher.name}' must share a vocabulary (the same token -> id map; "
            f"{len(s)} vs {len(t)} tokens): " + "; ".join(detail)
        )
    note = eos_conventions(student, teacher)
    key = (student.name, teacher.name)
    if note and key not in _NOTED:
        _NOTED.add(key)
        LOG.info("%s", note)


def eos_conventions(student: ModelFiles, teacher: ModelFiles) -> str | None:
    """A line saying that the pair declares different EOS tokens, or None when they agree."""
    s_eos, t_eos = eos_ids(student), eos_ids(teacher)
    if s_eos == t_eos:
        return None
    return (
        f"student '{student.name}' declares EOS {token_names(student.tokenizer, s_eos)} and teacher '{teacher.name}' "
        f"declares EOS {token_names(teacher.tokenizer, t_eos)}: one vocabulary, different conventions; "
        f"with rollout.stop-tokens = 'auto' responses end at any of them"
    )


@dataclass(frozen=True)
class StopTokens:
    """The token ids at which a response ends (kept as its last token), with their strings."""

    ids: tuple[int, ...]
    tokens: tuple[str, ...]

    def as_record(self) -> dict[str, list]:
        return {"ids": list(self.ids), "tokens": list(self.tokens)}


def parse_stop_tokens(setting: str, tokenizer, key: str = STOP_TOKENS_KEY) -> tuple[int, ...]:
    """Ids of a comma-separated list of token strings; each must be one token of the vocabulary."""
    vocab = tokenizer.get_vocab()
    names = [t.strip() for t in str(setting).split(",")]
    if not names or any(not n for n in names):
        raise ModelLoadError(f"run config '{key}' = {setting!r} is invalid: empty entry; allowed: 'auto' or a comma-separated list of tokens")
    unknown = [n for n in names if n not in vocab]
    if unknown:
        special = ", ".join(repr(t) for t in list(dict.fromkeys(getattr(tokenizer, "all_special_tokens", [])))[:12])
        raise ModelLoadError(
            f"run config '{key}' = {setting!r} is invalid: {unknown[0]!r} is not a token of the vocabulary; "
            f"allowed: 'auto' or tokens of the vocabulary, e.g. its special tokens {special}"
        )
    return tuple(sorted({int(vocab[n]) for n in names}))


def resolve_stop_tokens(setting: str, student: ModelFiles, teacher: ModelFiles | None = None) -> StopTokens:
    """The stop set for ``rollout.stop-tokens``: ``auto`` = the EOS ids that the student and the
    teacher declare (tokenizers, configs, generation configs); else the listed tokens."""
    if str(setting).strip() == "auto":
        ids = set(eos_ids(student)) | (set(eos_ids(teacher)) if teacher is not None else set())
        if not ids:
            raise ModelLoadError(
                f"student '{student.name}' declares no EOS token in its tokenizer, config or generation config; "
                f"set run config '{STOP_TOKENS_KEY}' to the token(s) that end an assistant turn"
            )
        ids = tuple(sorted(ids))
    else:
        ids = parse_stop_tokens(setting, student.tokenizer)
    return StopTokens(ids, tuple(token_names(student.tokenizer, ids)))


def end_of_turn_token(tokenizer) -> int | None:
    """The token the chat template writes right after an assistant message's text, or None.

    Rendered with a marker message, so it works for any template (``<|im_end|>`` for Qwen,
    ``<|eot_id|>`` for Llama 3); None when the tokenizer has no chat template or the text after the
    marker starts with no special token.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "FEDTOPS_END_OF_TURN_MARKER"
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    except Exception:  # noqa: BLE001 - a template that cannot render an assistant turn has no answer here
        return None
    if marker not in text:
        return None
    after = text[text.rindex(marker) + len(marker) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    for i in ids:
        if int(i) in special:
            return int(i)
        if tokenizer.decode([i]).strip():
            return None  # ordinary text before any special token: no end-of-turn token
    return None


def run_stop_tokens(student: str, teacher: str, setting: str) -> StopTokens:
    """Check a run's model pair and resolve its stop set from their files (no weights): what the
    ServerApp does before round 1, and what ``config.json`` records."""
    s, t = ModelFiles.load(student), ModelFiles.load(teacher)
    check_same_vocabulary(s, t)
    return resolve_stop_tokens(setting, s, t)
