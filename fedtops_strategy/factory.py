"""Strategies by name: ``strategy.name`` looks its builder up in :data:`STRATEGIES`.

A builder turns the validated ``strategy.*`` settings and the sampling arguments that every
strategy shares (``common``: Flower's ``fraction_train``, ``min_train_nodes``, ...) into a
Flower strategy built on :class:`~fedtops_strategy.screening.ReplyScreening`. A new variant is one
builder registered under a new name; what its clients must do differently travels in its train
messages' config (``learner``, ``build-scoring-cache``), never as its name::

    from fedtops_strategy.factory import register_strategy

    register_strategy("fedavgm-half", lambda cfg, common: FixedMultiplier(0.5, **common))

``fedopd.config`` validates ``strategy.name`` against the names registered here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedopd.core.settings import PrivacySettings, StrategySettings, TimeoutSettings
from fedtops_strategy.aggregators import make_aggregator
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fedtops_se import FedTOPSHeldoutCache, FedTOPSStandardError
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining

StrategyBuilder = Callable[[StrategySettings, dict[str, Any]], Strategy]


def _fedtops(cls: type[FedTOPS]) -> StrategyBuilder:
    """The builder of FedTOPS or one of its variants from the ``strategy.*`` settings."""
    return lambda cfg, common: cls(
        candidates=cfg.candidates,
        trust_budget=cfg.trust_budget,
        max_vetoes=cfg.max_vetoes,
        score_aggregate=cfg.score_aggregate,
        trim_fraction=cfg.trim_fraction,
        **common,
    )


STRATEGIES: dict[str, StrategyBuilder] = {
    "fedavg": lambda cfg, common: LoRAFedAvg(**common),
    "fixed": lambda cfg, common: FixedMultiplier(cfg.multiplier, **common),
    "fedtops": _fedtops(FedTOPS),
    # The lr study's variants (docs/sandbox.md, "Why FedTOPS trails FedAvg at the large learning rate")
    "fedtops-se": _fedtops(FedTOPSStandardError),
    "fedtops-heldout-cache": _fedtops(FedTOPSHeldoutCache),
    "local": lambda cfg, common: LocalTraining(**common),
    "centralized": lambda cfg, common: Centralized(**common),
}


def register_strategy(name: str, builder: StrategyBuilder) -> StrategyBuilder:
    """Make ``strategy.name = name`` build ``builder(cfg, common)``; returns ``builder``."""
    STRATEGIES[name] = builder
    return builder


def make_strategy(
    cfg: StrategySettings,
    *,
    num_clients: int,
    seed: int = 0,
    timeouts: TimeoutSettings | None = None,
    privacy: PrivacySettings | None = None,
) -> Strategy:
    """The strategy registered as ``strategy.name``.

    Sampling is Flower's ``FedAvg``: each round trains ``max(int(fraction_train × connected),
    min_train_nodes)`` nodes drawn at random (``strategy.fraction-train``,
    ``strategy.min-train-clients``; Centralized: one learner with the rollouts of that many). The
    first round waits until ``num_clients`` nodes are connected. The draw of round t depends only
    on ``seed``, t and the connected node ids (:meth:`ReplyScreening.configure_train`).

    The robustness settings (``strategy.aggregator``, ``clip-norm``, ``max-weight``; ``timeouts``'s
    ``start`` and ``skip-after``) are set on every strategy built on ReplyScreening
    (docs/robustness.md); ``timeouts`` None: no start deadline, no skipping. A reply's
    ``partition-id`` must be below ``num_clients`` (``num_partitions``); the ServerApp also sets
    ``max_examples``, the most ``num-examples`` a train reply may claim.

    ``privacy`` with ``clipping`` on: the average is Flower's DP wrapper around an equal-weight
    FedAvg (:class:`fedtops_strategy.privacy.UpdatePrivacy`), sized for the round's sample.
    """
    if cfg.name not in STRATEGIES:
        allowed = ", ".join(repr(n) for n in STRATEGIES)
        raise ValueError(f"strategy.name = {cfg.name!r}; allowed: {allowed}")
    common = dict(
        fraction_train=cfg.fraction_train,
        fraction_evaluate=0.0,  # no federated evaluation round: held-out evaluation is the app's own phase
        min_train_nodes=min(cfg.min_train_clients, num_clients),
        min_available_nodes=num_clients,
    )
    # Flower warns that fraction_evaluate = 0 skips its evaluation round; here that is the design,
    # so the warning is not passed on.
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.ERROR)
    try:
        strategy = STRATEGIES[cfg.name](cfg, common)
        strategy.sampling_seed = seed
        strategy.num_partitions = num_clients  # a reply's partition-id is in [0, num_clients) (fedtops_strategy/schema.py)
        strategy.aggregator = make_aggregator(cfg)
        strategy.clip_norm, strategy.max_weight = cfg.clip_norm, cfg.max_weight
        if timeouts is not None:
            strategy.start_timeout, strategy.skip_after = timeouts.start, timeouts.skip_after
        if privacy is not None and privacy.clipping != "off":
            from fedtops_strategy.privacy import UpdatePrivacy

            sampled = max(int(cfg.fraction_train * num_clients), common["min_train_nodes"])
            strategy.privacy = UpdatePrivacy(privacy, num_sampled=sampled, population=num_clients)
        return strategy
    finally:
        flwr_logger.setLevel(level)
