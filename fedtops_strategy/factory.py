"""Strategies by name: ``strategy.name`` looks its builder up in :data:`STRATEGIES`, and what it
supports in :data:`CAPABILITIES` (declared in :mod:`fedopd.core.strategies`, which
imports no Flower, so that the run config validates on a host without it).

A builder turns the validated ``strategy.*`` settings and the arguments that every strategy shares
(``common``: Flower's ``fraction_train``, ``min_train_nodes``, ..., and the server-side parts'
settings of :class:`~fedtops_strategy.base.ServerStrategy`: seed, bounds, averager,
timeouts) into a strategy built on ``ServerStrategy``. A new variant is one builder registered
under a new name, with a declaration of what it supports; what its clients must do differently
travels in its train messages' config (``learner``, ``build-scoring-cache``), never as its name::

    from fedtops_strategy.factory import Capabilities, register_strategy

    register_strategy("fedavgm-half", lambda cfg, common: FixedMultiplier(0.5, **common), Capabilities())

``fedopd.config`` validates ``strategy.name`` against the names registered here and reads the
declaration to refuse settings a strategy does not support; the ServerApp reads it to save
per-client adapters and to check the data; :func:`make_strategy` refuses a strategy whose score
phase its declaration does not state. Nothing looks at a strategy's class or name for that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedopd.core.settings import UNSET_SERVER_LR, PrivacySettings, StrategySettings, TimeoutSettings
from fedopd.core.strategies import CAPABILITIES, Capabilities, capabilities
from fedtops_strategy import fedadagrad, fedadam, fedavgm, fedyogi
from fedtops_strategy.aggregators import make_aggregator
from fedtops_strategy.base import ServerStrategy
from fedtops_strategy.fedexp import FedExP
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fedtops_se import FedTOPSHeldoutCache, FedTOPSStandardError
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining

__all__ = ["CAPABILITIES", "STRATEGIES", "Capabilities", "capabilities", "make_strategy", "register_strategy"]

StrategyBuilder = Callable[[StrategySettings, dict[str, Any]], ServerStrategy]


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


def _server_lr(cfg: StrategySettings, rule) -> float:
    """``strategy.server-lr``, or the rule's module's default (Flower's) when it is not set."""
    return rule.DEFAULT_SERVER_LR if cfg.server_lr == UNSET_SERVER_LR else cfg.server_lr


STRATEGIES: dict[str, StrategyBuilder] = {
    "fedavg": lambda cfg, common: LoRAFedAvg(**common),
    "fixed": lambda cfg, common: FixedMultiplier(cfg.multiplier, **common),
    "fedtops": _fedtops(FedTOPS),
    # The lr study's variants (docs/sandbox.md, "Why FedTOPS trails FedAvg at the large learning rate")
    "fedtops-se": _fedtops(FedTOPSStandardError),
    "fedtops-heldout-cache": _fedtops(FedTOPSHeldoutCache),
    # Server optimizers on the average (issue "Does the teacher need to choose the step?")
    "fedexp": lambda cfg, common: FedExP(cfg.fedexp_epsilon, cfg.fedexp_average, **common),
    "fedavgm": lambda cfg, common: fedavgm.LoRAFedAvgM(_server_lr(cfg, fedavgm), cfg.server_momentum, **common),
    "fedadam": lambda cfg, common: fedadam.LoRAFedAdam(_server_lr(cfg, fedadam), cfg.tau, cfg.beta1, cfg.beta2, **common),
    "fedyogi": lambda cfg, common: fedyogi.LoRAFedYogi(_server_lr(cfg, fedyogi), cfg.tau, cfg.beta1, cfg.beta2, **common),
    "fedadagrad": lambda cfg, common: fedadagrad.LoRAFedAdagrad(_server_lr(cfg, fedadagrad), cfg.tau, **common),
    "local": lambda cfg, common: LocalTraining(**common),
    "centralized": lambda cfg, common: Centralized(**common),
}


def register_strategy(name: str, builder: StrategyBuilder, capabilities: Capabilities | None = None) -> StrategyBuilder:
    """Make ``strategy.name = name`` build ``builder(cfg, common)`` and declare what it supports
    (default: an averaging strategy without a score phase); returns ``builder``."""
    STRATEGIES[name] = builder
    CAPABILITIES[name] = capabilities or Capabilities()
    return builder


def make_strategy(
    cfg: StrategySettings,
    *,
    num_clients: int,
    seed: int = 0,
    timeouts: TimeoutSettings | None = None,
    privacy: PrivacySettings | None = None,
    max_examples: int | None = None,
    num_partitions: int | None = -1,
) -> ServerStrategy:
    """The strategy registered as ``strategy.name``.

    Sampling is Flower's ``FedAvg``: each round trains ``max(int(fraction_train × connected),
    min_train_nodes)`` nodes drawn at random (``strategy.fraction-train``,
    ``strategy.min-train-clients``; Centralized: one learner with the rollouts of that many). The
    first round waits until ``num_clients`` nodes are connected. The draw of round t depends only
    on ``seed``, t and the connected node ids (:class:`fedtops_strategy.sampling.NodeSampler`).

    Every setting goes to the constructor (``common``): the robustness settings
    (``strategy.aggregator``, ``clip-norm``, ``max-weight``; ``timeouts``'s ``start`` and
    ``skip-after``; docs/robustness.md; ``timeouts`` None: no start deadline, no skipping), the
    boundary's ranges (a reply's ``partition-id`` below ``num_partitions``, default
    ``num_clients``, None: any >= 0; its ``num-examples`` at most ``max_examples``), and
    ``privacy`` with ``clipping`` on: the average is the private mean over a fixed denominator n,
    the clients a round asks when ``num_clients`` are connected
    (:class:`fedtops_strategy.privacy.UpdatePrivacy`); a round then asks at most n.
    """
    if cfg.name not in STRATEGIES:
        allowed = ", ".join(repr(n) for n in STRATEGIES)
        raise ValueError(f"strategy.name = {cfg.name!r}; allowed: {allowed}")
    min_train = min(cfg.min_train_clients, num_clients)
    update_privacy = None
    if privacy is not None and privacy.clipping != "off":
        from fedtops_strategy.privacy import UpdatePrivacy, private_denominator

        update_privacy = UpdatePrivacy(privacy, private_denominator(num_clients, cfg.fraction_train, cfg.min_train_clients))
    common = dict(
        fraction_train=cfg.fraction_train,
        min_train_nodes=min_train,
        min_available_nodes=num_clients,
        sampling_seed=seed,
        num_partitions=num_clients if num_partitions == -1 else num_partitions,
        max_examples=max_examples,
        clip_norm=cfg.clip_norm,
        max_weight=cfg.max_weight,
        aggregator=make_aggregator(cfg),
        privacy=update_privacy,
        start_timeout=timeouts.start if timeouts is not None else float("inf"),
        # Under privacy who is asked must not depend on who answered (a silent node that sat out
        # would change the schedule): timeout.skip-after has no effect (docs/privacy.md).
        skip_after=timeouts.skip_after if timeouts is not None and update_privacy is None else 0,
    )
    strategy = STRATEGIES[cfg.name](cfg, common)
    declared = capabilities(cfg.name).score_phase
    if strategy.score_phase != declared:  # the run config's checks and privacy's accounting read the declaration
        raise ValueError(
            f"strategy.name = {cfg.name!r} builds a {type(strategy).__name__}, which {'has' if strategy.score_phase else 'has no'} score phase, "
            f"but is registered with Capabilities(score_phase={declared}); register it with score_phase={strategy.score_phase}"
        )
    return strategy
