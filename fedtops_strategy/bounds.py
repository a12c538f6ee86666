"""Bounds on what one client can do to the average: update norms and weights, relative to the round.

Pure functions on plain arrays. Off by default (the paper averages every screened update with its
``num-examples``); ``strategy.clip-norm`` and ``strategy.max-weight`` turn them on
(docs/robustness.md):

* an update Δ_i = θ_i − θ_t whose norm exceeds c × the lower median norm of the round's updates
  is scaled down to that norm;
* a ``num-examples`` weight above c × the round's lower median weight is cut to it.

The lower median (:func:`lower_median`: the middle value, or for an even count the smaller of the
two middle ones), not the mean: from three updates on, one node alone can neither raise the bar
(a huge update) nor lower it (a zero one). With fewer than three updates the bounds are not
applied (:data:`MIN_BOUNDED`; the round record says so): with two, any relative bar is one of
the two (numpy's median, their mean, let an update 1e4 × the other's keep half its norm; the
lower median let a zero update scale the other to 0).

Norms are over all arrays of the adapter together, in the coordinates the clients send (LoRA
factors), computed in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def lower_median(values: Sequence[float]) -> float:
    """The ⌈n/2⌉-th smallest of n values: the median for odd n, the lower middle value for even n."""
    ordered = sorted(float(v) for v in values)
    return ordered[(len(ordered) - 1) // 2]


def update_norm(theta: Mapping[str, np.ndarray], client: Mapping[str, np.ndarray]) -> float:
    """‖θ_i − θ_t‖ over all arrays together, in float64."""
    return float(np.sqrt(sum(np.sum((np.asarray(client[k], np.float64) - np.asarray(theta[k], np.float64)) ** 2) for k in theta)))


def clip_scales(norms: Sequence[float], clip_norm: float) -> list[float]:
    """The factor s_i ∈ [0, 1] that each update is multiplied by: min(1, c·lower median / ‖Δ_i‖).

    ``clip_norm`` 0 is off (every s_i = 1). An update of norm 0 keeps s = 1.
    """
    if not clip_norm or not norms:
        return [1.0] * len(norms)
    bound = clip_norm * lower_median(norms)
    return [1.0 if n <= bound else bound / n for n in norms]


def clipped(theta: Mapping[str, np.ndarray], client: Mapping[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """θ_t + s (θ_i − θ_t), in the client's dtype (the arrays unchanged when s = 1)."""
    if scale == 1.0:
        return dict(client)
    out = {}
    for k, x in client.items():
        t = np.asarray(theta[k], np.float64)
        out[k] = (t + scale * (np.asarray(x, np.float64) - t)).astype(np.asarray(x).dtype)
    return out


def capped_weights(weights: Sequence[float], max_weight: float) -> list[float]:
    """Each weight cut to at most c × the lower median weight; ``max_weight`` 0 is off (unchanged)."""
    if not max_weight or not weights:
        return list(weights)
    cap = max_weight * lower_median(weights)
    return [min(float(w), cap) for w in weights]


def all_finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether every value of every array is finite."""
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in arrays.values())


# With two updates, no bound relative to the round can tell which one is out of line: the lower
# median of two is the smaller one, so a zero update would scale the other to 0 (and numpy's median,
# their mean, lets a huge one raise its own bar). From three, one node alone never sets the bar.
MIN_BOUNDED = 3


@dataclass(frozen=True)
class UpdateBounds:
    """``strategy.clip-norm`` and ``strategy.max-weight`` (0: off) on one round's updates."""

    clip_norm: float = 0.0
    max_weight: float = 0.0

    @property
    def on(self) -> bool:
        return bool(self.clip_norm or self.max_weight)

    def apply(
        self, theta: Mapping[str, np.ndarray], updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
    ) -> tuple[list[Mapping[str, np.ndarray]], list[float], list[dict[str, Any]], str | None]:
        """(the updates clipped, the weights capped, one diagnostic per update: ``update-norm``,
        ``scale``, ``weight``; why the bounds were not applied, or None). With both bounds off,
        or fewer than :data:`MIN_BOUNDED` updates, the updates and weights as they are."""
        if not self.on:
            return list(updates), list(weights), [], None
        if len(updates) < MIN_BOUNDED:
            return list(updates), list(weights), [], f"{len(updates)} update(s): bounds relative to the round need at least {MIN_BOUNDED}"
        capped = capped_weights(weights, self.max_weight)
        norms = [update_norm(theta, u) for u in updates]
        scales = clip_scales(norms, self.clip_norm)
        out = [clipped(theta, u, s) for u, s in zip(updates, scales)]
        return out, capped, [{"update-norm": n, "scale": s, "weight": w} for n, s, w in zip(norms, scales, capped)], None
