"""FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2), by Flower's
``FedAdam``: per coordinate of the LoRA factors,

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t,   v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²,
    θ_{t+1} = θ_t + η_t m_t / (√v_t + τ),   η_t = η √(1 − β₂^{t+1}) / (1 − β₁^{t+1}),

m_0 = v_0 = 0. The bias correction η_t is Flower's (Algorithm 2 has none; its exponent t + 1 is
Flower's too). ``strategy.server-lr`` η (default Flower's 0.1), ``beta1``, ``beta2``, ``tau``.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAdam

from fedtops_strategy.server_step import FlowerFedOptStep

DEFAULT_SERVER_LR = 0.1  # Flower's FedAdam


class LoRAFedAdam(FlowerFedOptStep):
    strategy_name = "fedadam"
    FLOWER = FedAdam
