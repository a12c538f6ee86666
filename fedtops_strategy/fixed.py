"""FedAvg and the fixed multiplier, on the server side shared by every strategy (base.py).

Both average the checked updates (Flower's FedAvg mean, or the robust or private average) and
move θ_{t+1} = θ_t + aΔ_t in the one place every strategy uses
(:func:`fedtops_strategy.round.apply_step`): a = 1 for FedAvg, a constant for the fixed
multiplier. That is the update of Flower's FedAvgM with ``server_learning_rate = a`` and no
momentum, without FedAvgM's own copy of the model between rounds (a round that holds must not
leave a non-finite model behind).
"""

from __future__ import annotations

import math

from fedtops_strategy.base import ServerStrategy


class LoRAFedAvg(ServerStrategy):
    """FedAvg (a = 1 every round) on the LoRA factors."""

    strategy_name = "fedavg"


class FixedMultiplier(ServerStrategy):
    """θ_{t+1} = θ_t + aΔ_t for a constant a >= 0."""

    strategy_name = "fixed"

    def __init__(self, multiplier: float, **kwargs) -> None:
        if not (math.isfinite(multiplier) and multiplier >= 0):
            raise ValueError(f"the fixed multiplier must be a finite number >= 0, got {multiplier!r}")
        super().__init__(**kwargs)
        self.multiplier = float(multiplier)

    @property
    def default_multiplier(self) -> float:
        return self.multiplier
