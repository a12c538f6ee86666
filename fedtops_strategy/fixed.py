"""FedAvg and the fixed multiplier, with FedTOPS's reply screening and round records.

A fixed multiplier a is Flower's own FedAvgM with ``server_learning_rate = a`` and no momentum:
θ_{t+1} = θ_t − a(θ_t − θ̄_t) = θ_t + aΔ_t. Nothing new is implemented here.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg, FedAvgM

from fedtops_strategy.screening import ReplyScreening


class LoRAFedAvg(ReplyScreening, FedAvg):
    """FedAvg (a = 1 every round) on the LoRA factors."""

    strategy_name = "fedavg"


class FixedMultiplier(ReplyScreening, FedAvgM):
    """θ_{t+1} = θ_t + aΔ_t for a constant a (FedAvgM, ``server_momentum = 0``)."""

    strategy_name = "fixed"

    def __init__(self, multiplier: float, **kwargs) -> None:
        super().__init__(server_learning_rate=float(multiplier), server_momentum=0.0, **kwargs)

    @property
    def default_multiplier(self) -> float:
        return self.server_learning_rate
