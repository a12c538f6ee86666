"""FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2), by Flower's
``FedYogi``: per coordinate of the LoRA factors,

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t,   v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²),
    θ_{t+1} = θ_t + η m_t / (√v_t + τ),

m_0 = v_0 = 0 (Flower's; Algorithm 2 starts v at τ² or above, the authors' released Yogi at 1.0).
``strategy.server-lr`` η (default Flower's 0.01), ``beta1``, ``beta2``, ``tau``.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedYogi

from fedtops_strategy.server_step import FlowerFedOptStep

DEFAULT_SERVER_LR = 0.01  # Flower's FedYogi


class LoRAFedYogi(FlowerFedOptStep):
    strategy_name = "fedyogi"
    FLOWER = FedYogi
