"""The server optimizers' rules across keys (docs/strategies.md): each ``strategy.*`` key of a
server rule acts only on the strategies that declare it (``Capabilities.server_keys``); a rule
that reads every client's update (FedExP) takes the plain mean only; a rule whose state lives in
the ServerApp's memory cannot be resumed. :func:`fedopd.config.parse_run_config` calls
:func:`check_server_rule`."""

from __future__ import annotations

from fedopd.config.robustness_rules import only_defaults
from fedopd.core.errors import ConfigError
from fedopd.core.settings import RunConfig
from fedopd.core.strategies import CAPABILITIES, capabilities


def server_keys() -> tuple[tuple[str, str], ...]:
    """Every registered server optimizer's key, as a (run-config key, StrategySettings attribute)
    pair (read when checked: a strategy registered later declares its own)."""
    keys = dict.fromkeys(k for c in CAPABILITIES.values() for k in c.server_keys)
    return tuple((key, key.split(".", 1)[1].replace("-", "_")) for key in keys)


def users(key: str) -> str:
    """The registered strategies that ``key`` acts on."""
    return ", ".join(repr(n) for n, c in CAPABILITIES.items() if key in c.server_keys)


def check_server_rule(cfg: RunConfig) -> None:
    s = cfg.strategy
    supports = capabilities(s.name)
    for key, attr in server_keys():
        if key not in supports.server_keys:
            only_defaults(s, ((key, attr),), f"has no effect with 'strategy.name' = {s.name!r}", f"strategy.name one of {users(key)}")
    if supports.update_norms and s.aggregator != "fedavg":
        robust = ", ".join(repr(n) for n, c in CAPABILITIES.items() if c.averages and not c.update_norms)
        raise ConfigError(
            f"run config 'strategy.aggregator' = {s.aggregator!r} cannot protect 'strategy.name' = {s.name!r}: its step reads every "
            f"client's update norm, so one client sets how far the robust average moves; allowed: 'fedavg' (with "
            f"'strategy.clip-norm' to bound each update), or strategy.name one of {robust}"
        )
    if supports.server_state and cfg.resume_from:
        raise ConfigError(
            f"run config 'resume-from' = {cfg.resume_from!r} cannot resume 'strategy.name' = {s.name!r}: its optimizer state "
            f"(momentum, moment estimates) lives only in the ServerApp's memory and is not in the run folder; allowed: '' "
            f"(a new run), or a strategy without server state"
        )
