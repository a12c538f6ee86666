"""One factory from the validated run config to a strategy."""

from __future__ import annotations

import logging

from fedopd.config import StrategyConfig
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining


def make_strategy(cfg: StrategyConfig, *, num_clients: int, score_timeout: float = 600.0):
    """The strategy named by ``strategy.name``: all ``num_clients`` clients train every round
    (Centralized: one learner, with all of them connected)."""
    # Flower warns that fraction_evaluate = 0 skips its evaluation round; here that is the design
    # (held-out evaluation is the app's own phase), so the warning is not passed on.
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.ERROR)
    try:
        return _make(cfg, num_clients=num_clients, score_timeout=score_timeout)
    finally:
        flwr_logger.setLevel(level)


def _make(cfg: StrategyConfig, *, num_clients: int, score_timeout: float):
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=0.0,  # no federated evaluation round: scoring is part of training
        min_train_nodes=num_clients,
        min_available_nodes=num_clients,
    )
    if cfg.name == "fedavg":
        return LoRAFedAvg(**common)
    if cfg.name == "fixed":
        return FixedMultiplier(cfg.multiplier, **common)
    if cfg.name == "fedtops":
        return FedTOPS(candidates=cfg.candidates, trust_budget=cfg.trust_budget, score_timeout=score_timeout, **common)
    if cfg.name == "local":
        return LocalTraining(**common)
    if cfg.name == "centralized":
        return Centralized(**common)
    raise ValueError(f"strategy.name = {cfg.name!r}; allowed: 'fedavg', 'fixed', 'fedtops', 'local', 'centralized'")
