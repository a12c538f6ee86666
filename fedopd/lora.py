"""LoRA factor arithmetic in the coordinates that cross the wire.

θ is an ordered list of fp32 numpy arrays: every LoRA A and B factor of the student, in the order
of :meth:`fedopd.models.CausalLM.lora_names`. Aggregation and server scaling act on these factors
directly (paper App. "Coordinate-level meaning for LoRA"): no merging, no re-factorization.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Arrays = list[np.ndarray]


def check_compatible(reference: Sequence[np.ndarray], other: Sequence[np.ndarray]) -> str | None:
    """Why ``other`` cannot be combined with ``reference`` (count, shape, non-finite), or None."""
    if len(other) != len(reference):
        return f"{len(other)} arrays, expected {len(reference)}"
    for i, (r, o) in enumerate(zip(reference, other)):
        if o.shape != r.shape:
            return f"array {i} has shape {tuple(o.shape)}, expected {tuple(r.shape)}"
        if not np.all(np.isfinite(o)):
            return f"array {i} has non-finite values"
    return None


def weighted_mean(updates: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> Arrays:
    """Σ_i w_i θ_i / Σ_i w_i, in float64 then cast to fp32."""
    if not updates:
        raise ValueError("weighted_mean of no updates")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    w = w / w.sum()
    return [
        sum(wi * np.asarray(u[k], dtype=np.float64) for wi, u in zip(w, updates)).astype(np.float32)
        for k in range(len(updates[0]))
    ]


def increment(new: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> Arrays:
    """Δ = new − old, per factor."""
    return [np.asarray(n, dtype=np.float32) - np.asarray(o, dtype=np.float32) for n, o in zip(new, old)]


def apply_increment(theta: Sequence[np.ndarray], delta: Sequence[np.ndarray], multiplier: float) -> Arrays:
    """θ + aΔ, per factor, in fp32."""
    a = np.float32(multiplier)
    return [np.asarray(t, dtype=np.float32) + a * np.asarray(d, dtype=np.float32) for t, d in zip(theta, delta)]
