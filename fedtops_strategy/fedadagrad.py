"""FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2), by
Flower's ``FedAdagrad``: per coordinate of the LoRA factors,

    v_t = v_{t−1} + Δ_t²,   θ_{t+1} = θ_t + η Δ_t / (√v_t + τ),

v_0 = 0; Flower's FedAdagrad has no first moment (β₁ = 0: m_t = Δ_t). ``strategy.server-lr`` η
(default Flower's 0.1), ``tau``.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAdagrad

from fedtops_strategy.server_step import FlowerFedOptStep

DEFAULT_SERVER_LR = 0.1  # Flower's FedAdagrad


class LoRAFedAdagrad(FlowerFedOptStep):
    strategy_name = "fedadagrad"
    FLOWER = FedAdagrad
