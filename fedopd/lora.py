"""LoRA factor arithmetic in the coordinates that cross the wire, and PEFT adapter folders.

θ is a mapping from factor name to fp32 numpy array: every LoRA A and B factor of the student,
named as in PEFT's saved state dict (:meth:`fedopd.models.CausalLM.lora_names`) and as the keys of
the ``ArrayRecord`` that carries it. Factors are matched by name, never by position (several
factors share a shape). Aggregation and server scaling act on these factors directly (paper App.
"Coordinate-level meaning for LoRA"): no merging, no re-factorization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

Named = dict[str, np.ndarray]


def from_record(record: Mapping[str, Any]) -> Named:
    """Named fp32 arrays from an ``ArrayRecord`` (or any mapping of array-likes), in its key order."""
    return {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float32) for k, v in record.items()}


def name_mismatch(expected: Sequence[str], got: Sequence[str]) -> str | None:
    """The first difference between two ordered name lists, as a sentence, or None."""
    expected_set, got_set = set(expected), set(got)
    missing = [n for n in expected if n not in got_set]
    unexpected = [n for n in got if n not in expected_set]
    if missing:
        return f"factor '{missing[0]}' is missing ({len(missing)} missing in all)"
    if unexpected:
        return f"factor '{unexpected[0]}' is not in the adapter ({len(unexpected)} unknown in all)"
    return None


def check_compatible(reference: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray]) -> str | None:
    """Why ``other`` cannot be combined with ``reference`` (names, shapes, non-finite), or None."""
    problem = name_mismatch(list(reference), list(other))
    if problem:
        return problem
    for name, r in reference.items():
        o = np.asarray(other[name])
        if o.shape != r.shape:
            return f"factor '{name}' has shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        if not np.all(np.isfinite(o)):
            return f"factor '{name}' has non-finite values"
    return None


def _require_same_names(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    problem = name_mismatch(list(a), list(b))
    if problem:
        raise ValueError(f"LoRA factors do not match: {problem}")


def increment(new: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray]) -> Named:
    """Δ = new − old, per named factor (in ``old``'s order)."""
    _require_same_names(old, new)
    return {k: np.asarray(new[k], dtype=np.float32) - np.asarray(o, dtype=np.float32) for k, o in old.items()}


def apply_increment(theta: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], multiplier: float) -> Named:
    """θ + aΔ, per named factor, in fp32 (in ``theta``'s order)."""
    _require_same_names(theta, delta)
    a = np.float32(multiplier)
    return {k: np.asarray(t, dtype=np.float32) + a * np.asarray(delta[k], dtype=np.float32) for k, t in theta.items()}


# ---------------------------------------------------------------------------------------------
# Adapter folders (PEFT format)
# ---------------------------------------------------------------------------------------------


def save_adapter(path: str | Path, arrays: Mapping[str, np.ndarray], config) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).

    Needs no model: the server writes the global adapter from the named arrays it aggregated.
    ``config`` is the ``peft.LoraConfig`` (:func:`lora_config`).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: np.ascontiguousarray(a, dtype=np.float32) for n, a in arrays.items()}, str(path / ADAPTER_WEIGHTS))
    config.save_pretrained(str(path))
    return path


def load_adapter(path: str | Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Read a PEFT adapter folder into named fp32 arrays, in ``names`` order when given."""
    from safetensors.numpy import load_file

    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"adapter folder '{path}' has no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(weights))
    names = list(names) if names is not None else list(tensors)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"adapter '{path}' lacks {len(missing)} factors, e.g. '{missing[0]}'")
    return {n: tensors[n].astype(np.float32) for n in names}
