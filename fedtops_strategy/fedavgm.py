"""FedAvgM: server momentum on the average (Hsu, Qi and Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", 2019), by Flower's
``FedAvgM``: with the pseudo-gradient g_t = θ_t − average = −Δ_t,

    v_t = β v_{t−1} + g_t   (v_1 = g_1),    θ_{t+1} = θ_t − η v_t,

``strategy.server-lr`` η (default Flower's 1) and ``strategy.server-momentum`` β (default 0.9,
Hsu et al.'s; Flower's default 0 is FedAvg). A long run of equal Δ moves η/(1 − β) Δ per round.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAvgM

from fedtops_strategy.server_step import FlowerOptimizerStep

DEFAULT_SERVER_LR = 1.0  # Flower's FedAvgM


class LoRAFedAvgM(FlowerOptimizerStep):
    strategy_name = "fedavgm"
    STATE = ("momentum_vector",)

    def __init__(self, server_lr: float, server_momentum: float, **kwargs) -> None:
        super().__init__(lambda: FedAvgM(fraction_evaluate=0.0, server_learning_rate=server_lr, server_momentum=server_momentum), **kwargs)

    def current_arrays(self, theta):
        return ArrayRecord({k: Array(v) for k, v in theta.items()})  # FedAvgM keeps θ_t as an ArrayRecord
