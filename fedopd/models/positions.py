"""How many positions a model has, and whether a run's prompts and responses fit in them.

A rollout is a prompt of at most ``data.max-prompt-tokens`` tokens followed by at most
``rollout.max-new-tokens`` (training) or ``eval.max-new-tokens`` (held-out evaluation) response
tokens; the student generates them and the teacher scores them, so both models must have that
many positions. vLLM refuses an engine whose ``max_model_len`` exceeds the model's; Hugging Face
runs past them silently (RoPE extrapolates). So a run that cannot fit is refused before round 1,
naming the keys, whatever the engine.

The model's positions are read as vLLM derives them (``vllm/transformers_utils/
model_arch_config_convertor.py`` ``derive_max_model_len_and_key`` and ``vllm/config/model.py``
``_get_and_verify_max_len``, vLLM 0.32): the smallest of the keys in :data:`POSITION_KEYS` in the
text config, ``model_max_length`` where present, times the RoPE scaling factor unless the RoPE
type already states scaled positions (:data:`PRESCALED_ROPE_TYPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vLLM's possible_keys, in its order (derive_max_model_len_and_key).
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length (_get_and_verify_max_len).
PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    return config.to_dict()


def _rope_parameters(text: dict) -> list[dict]:
    """Every RoPE parameter dict of a text config (transformers 5 ``rope_parameters``, possibly one
    per layer type; transformers 4 ``rope_scaling``)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, Mapping):
        return []
    if "rope_type" in rope or "type" in rope or "factor" in rope:
        return [dict(rope)]
    return [dict(v) for v in rope.values() if isinstance(v, Mapping)]  # per layer type


def model_positions(config: Any) -> tuple[int | None, str | None]:
    """``(positions, key)``: how many tokens of context the model's ``config.json`` declares, and the
    key it came from; ``(None, None)`` if it declares none. ``config``: a ``PretrainedConfig`` or its dict."""
    data = _as_dict(config)
    text = data.get("text_config") if isinstance(data.get("text_config"), Mapping) else data
    positions, key = float("inf"), None
    for name in POSITION_KEYS:
        value = text.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < positions:
            positions, key = value, name
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        positions, key = text["model_max_length"], "model_max_length"
    if key is None:
        return None, None
    factor = 1.0
    for rope in _rope_parameters(text):
        if rope.get("rope_type", rope.get("type")) not in PRESCALED_ROPE_TYPES and rope.get("factor") is not None:
            factor = float(rope["factor"])
    return int(positions * factor), key if factor == 1.0 else f"{key} x rope factor {factor:g}"


def needed_positions(max_prompt_tokens: int, max_new_tokens: int, eval_max_new_tokens: int = 0) -> int:
    """Positions of the longest rollout a run can make: the longest prompt plus the longer response cap."""
    return int(max_prompt_tokens) + max(int(max_new_tokens), int(eval_max_new_tokens))


def position_problem(role: str, name: str, config: Any, *, max_prompt_tokens: int, max_new_tokens: int, eval_max_new_tokens: int = 0) -> str | None:
    """Why a run's rollouts cannot fit model ``name`` (the ``role`` key, e.g. ``model.student``), or
    None if they fit. ``eval_max_new_tokens``: 0 when the run does not evaluate."""
    positions, key = model_positions(config)
    need = needed_positions(max_prompt_tokens, max_new_tokens, eval_max_new_tokens)
    if positions is None or need <= positions:
        return None
    longest = max(max_new_tokens, eval_max_new_tokens)
    cap = "eval.max-new-tokens" if eval_max_new_tokens > max_new_tokens else "rollout.max-new-tokens"
    fix = f"lower data.max-prompt-tokens to at most {positions - longest}, or {cap}" if positions > longest else f"lower {cap} below {positions}"
    return f"data.max-prompt-tokens ({max_prompt_tokens}) + {cap} ({longest}) = {need} positions, but {role} '{name}' has {positions} ({key} in its config.json); {fix}"


UNDECLARED_POSITIONS = 2048  # what vLLM assumes for a config.json that declares none (_get_and_verify_max_len)


def engine_context(config: Any, needed: int | None) -> int:
    """The context an engine is started with: what the run needs (None: as much as the model has),
    never more than the model has."""
    positions, _ = model_positions(config)
    if needed is None:
        return positions if positions is not None else UNDECLARED_POSITIONS
    return int(needed) if positions is None else min(int(needed), positions)


def check_run_positions(cfg, student_config: Any, teacher_config: Any) -> None:
    """Refuse a run (:class:`~fedopd.config.ConfigError`) whose rollouts cannot fit the student or the
    teacher: both see every prompt and response. ``cfg``: the :class:`~fedopd.config.RunConfig`."""
    from fedopd.core.errors import ConfigError

    lengths = dict(
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eval_max_new_tokens=cfg.eval.max_new_tokens if cfg.eval.every else 0,
    )
    for role, name, config in (("model.student", cfg.model.student, student_config), ("model.teacher", cfg.model.teacher, teacher_config)):
        problem = position_problem(role, name, config, **lengths)
        if problem:
            raise ConfigError(problem)


def load_model_config(name: str):
    """The ``config.json`` of a hub id, local folder or built-in model (no weights, no tokenizer)."""
    from transformers import AutoConfig

    from fedopd.core.errors import ModelLoadError
    from fedopd.models.paths import resolve_model_path

    path = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not read the config of model '{name}' (resolved to '{path}'): {err}") from err
