"""The robustness layer's rules across keys (docs/robustness.md): bounded updates, robust
aggregators and robust Ĵ make sense only where updates are averaged (or scored), and each keeps its
breakdown point with the clients a round averages. :func:`fedopd.config.parse_run_config` calls
:func:`check_robustness`; the ServerApp calls :func:`check_per_round` with the nodes connected when
``num-clients`` = 0."""

from __future__ import annotations

import math
from typing import Any

from fedopd.core.errors import ConfigError
from fedopd.core.settings import RunConfig
from fedopd.core.strategies import CAPABILITIES, aggregator_problem, capabilities, clients_per_round


def registered(what: str) -> str:
    """The registered strategy names that declare ``what`` (fedopd.core.strategies.Capabilities)."""
    return ", ".join(repr(n) for n in CAPABILITIES if getattr(capabilities(n), what))


def only_defaults(settings: Any, keys: tuple[tuple[str, str], ...], why: str, instead: str) -> None:
    """Refuse any of ``keys`` ((run-config key, attribute)) that ``settings`` sets away from its
    default: ``why`` it has no effect here, and what would give it one (``instead``)."""
    base = type(settings)()
    for key, attr in keys:
        if getattr(settings, attr) != getattr(base, attr):
            raise ConfigError(f"run config '{key}' = {getattr(settings, attr)!r} {why}; allowed: its default {getattr(base, attr)!r}, or {instead}")


def round_clients(cfg: RunConfig) -> int:
    """The clients a round trains when ``num-clients`` are connected: Flower's FedAvg sample size
    (as ``fedtops_strategy.factory.make_strategy`` sets it up)."""
    return clients_per_round(cfg.num_clients, cfg.strategy.fraction_train, cfg.strategy.min_train_clients)


def check_per_round(cfg: RunConfig, per_round: int) -> None:
    """The robustness settings that depend on how many clients a round averages (``per_round``):
    a bound relative to the round's median needs 3, a trimmed mean must cut one at each end, a
    robust aggregator must keep its breakdown point (:func:`check_aggregator`). Checked here when
    ``num-clients`` is set, and by the ServerApp from the nodes connected at its start otherwise."""
    s = cfg.strategy
    if (s.clip_norm or s.max_weight) and per_round < 3:
        key, value = ("strategy.clip-norm", s.clip_norm) if s.clip_norm else ("strategy.max-weight", s.max_weight)
        raise ConfigError(
            f"run config '{key}' = {value!r} bounds each update by the round's median, which needs at least 3 clients "
            f"per round (with {per_round}, either one sets the bar: a zero update would scale the other to 0); "
            f"allowed: 0, or at least 3 clients per round"
        )
    uses_trim = [k for k, v in (("strategy.aggregator", s.aggregator), ("strategy.score-aggregate", s.score_aggregate)) if v == "trimmed-mean"]
    if uses_trim and int(s.trim_fraction * per_round) == 0:
        fix = (
            f"a value with floor(value × {per_round}) >= 1 (one client cut at each end), e.g. {math.ceil(100 / per_round) / 100:g}"
            if per_round >= 3
            else f"none below 0.5 cuts any of {per_round} clients: 'median' instead, or more clients"
        )
        raise ConfigError(
            f"run config 'strategy.trim-fraction' = {s.trim_fraction!r} cuts floor({s.trim_fraction!r} × {per_round}) = 0 of the "
            f"{per_round} clients a round averages, so '{uses_trim[0]}' = 'trimmed-mean' would be the plain mean; allowed: {fix}"
        )
    check_aggregator(cfg, per_round)


def check_aggregator(cfg: RunConfig, per_round: int) -> None:
    """``strategy.aggregator`` keeps its breakdown point with ``per_round`` clients per round
    (:func:`fedopd.core.strategies.aggregator_problem`). Not under privacy, which allows only the
    mean (:func:`fedopd.config.privacy_rules.check_privacy` says so), nor for a strategy that forms no average."""
    if not capabilities(cfg.strategy.name).averages or cfg.privacy.clipping != "off":
        return
    problem = aggregator_problem(cfg.strategy.aggregator, per_round, cfg.strategy.num_malicious)
    if problem is not None:
        key, why = problem
        value = cfg.strategy.aggregator if key == "strategy.aggregator" else cfg.strategy.num_malicious
        raise ConfigError(f"run config '{key}' = {value!r} is invalid: {why}")


def check_robustness(cfg: RunConfig) -> None:
    """The robustness keys make sense only where updates are averaged, or scored (FedTOPS)."""
    s = cfg.strategy
    supports = capabilities(s.name)
    if not supports.averages:
        only_defaults(
            s,
            (("strategy.aggregator", "aggregator"), ("strategy.clip-norm", "clip_norm"), ("strategy.max-weight", "max_weight")),
            f"acts on the average of client updates, which 'strategy.name' = {s.name!r} does not form",
            f"strategy.name one of {registered('averages')}",
        )
    if not supports.score_phase:
        only_defaults(
            s,
            (("strategy.max-vetoes", "max_vetoes"), ("strategy.score-aggregate", "score_aggregate")),
            "acts on FedTOPS's score replies",
            f"strategy.name one of {registered('score_phase')}",
        )
    if cfg.num_clients:
        check_per_round(cfg, round_clients(cfg))
    if s.num_malicious and s.aggregator not in ("krum", "multikrum"):
        raise ConfigError(
            f"run config 'strategy.num-malicious' = {s.num_malicious} is used only by Krum; allowed: 0, or "
            f"'strategy.aggregator' one of 'krum', 'multikrum' (now {s.aggregator!r})"
        )
