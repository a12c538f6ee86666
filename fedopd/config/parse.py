"""Parsing and validation: a flat run-config dict becomes one frozen :class:`RunConfig`.

Flower hands the ClientApp and the ServerApp a flat ``run_config`` dict whose keys are grouped
by prefix (docs/configuration.md): ``model.student``, ``train.lr``, ``strategy.trust-budget``, ... This module
turns that dict into a frozen :class:`RunConfig` (its groups and key table: :mod:`fedopd.core.settings`),
and rejects any bad value before work starts with a :class:`ConfigError` that names the key, the value
and what is allowed. Names chosen from a registry (``data.name``: :data:`fedopd.data.DATASETS`) are
checked against it here, above every registry (the prompt sets, the divergences, the strategies), so that a registered name is valid wherever it was added.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from fedopd.config.privacy_rules import check_privacy
from fedopd.config.robustness_rules import check_robustness
from fedopd.config.server_rules import check_server_rule
from fedopd.core.errors import ConfigError
from fedopd.core.settings import _KEYS, RUN_CONFIG_KEYS, UNSET_MULTIPLIER, RunConfig
from fedopd.core.strategies import CAPABILITIES
from fedopd.data.registry import DATASETS as PROMPT_SETS
from fedopd.data.registry import resolve_partitioner
from fedopd.distill.loss import DIVERGENCES
from fedopd.rollout.vllm_engine import check_vllm_sampling

# Keys whose allowed values are a registry's names, read at validation time (a registry may grow):
# the registries live below this module, and registering a name makes it valid everywhere.
REGISTERED = {"data.name": PROMPT_SETS, "train.loss": DIVERGENCES, "strategy.name": CAPABILITIES}


def allowed_values(key: str) -> str:
    """What ``key`` allows, as error messages and the generated reference say it."""
    if key in REGISTERED:
        return "one of " + ", ".join(repr(n) for n in REGISTERED[key])
    return str(_KEYS[key][1][2])


def _fail(key: str, value: Any, allowed: str, why: str = "") -> ConfigError:
    return ConfigError(f"run config '{key}' = {value!r} is invalid{': ' + why if why else ''}; allowed: {allowed}")


def _coerce(key: str, value: Any, typ: type) -> Any:
    """``value`` as ``typ``; what ``key`` allows is computed only for the error."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _fail(key, value, allowed_values(key))
    if isinstance(value, bool):  # bool is an int subclass; never a valid number or string here
        raise _fail(key, value, allowed_values(key))
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _fail(key, value, allowed_values(key))
    if typ is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise _fail(key, value, allowed_values(key))
    if not isinstance(value, str):
        raise _fail(key, value, allowed_values(key))
    return value


def parse_candidates(text: str, key: str = "strategy.candidates") -> tuple[float, ...]:
    """Parse ``'0.5,1,2'`` into ``(0.5, 1.0, 2.0)``; order is kept (it breaks ties)."""
    allowed = _KEYS[key][1][2]
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise _fail(key, text, allowed, "empty entry")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError as err:
        raise _fail(key, text, allowed, str(err)) from None
    if any(not math.isfinite(a) or a < 0 for a in values):
        raise _fail(key, text, allowed, "every candidate must be finite and >= 0")
    if len(set(values)) != len(values):
        raise _fail(key, text, allowed, "duplicate candidates")
    return values


def parse_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """Validate a flat run-config dict (missing keys take the dataclass defaults)."""
    unknown = sorted(set(run_config) - set(_KEYS))
    if unknown:
        named = []
        for key in unknown:
            close = difflib.get_close_matches(key, RUN_CONFIG_KEYS, n=1, cutoff=0.6)
            named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"unknown run config key(s) {', '.join(named)}; allowed keys: {', '.join(RUN_CONFIG_KEYS)}")
    values: dict[tuple[str, ...], Any] = {}
    for key, raw in run_config.items():
        path, (typ, check, _) = _KEYS[key]
        if key == "strategy.candidates":
            values[path] = parse_candidates(raw) if isinstance(raw, str) else _candidates_from_seq(raw)
            continue
        value = _coerce(key, raw, typ)
        if not check(value) or (key in REGISTERED and value not in REGISTERED[key]):
            raise _fail(key, raw, allowed_values(key))
        values[path] = value

    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for path, value in values.items():
        if len(path) == 1:
            top[path[0]] = value
        else:
            groups.setdefault(path[0], {})[path[1]] = value
    base = RunConfig()
    for group, fields in groups.items():
        top[group] = dataclasses.replace(getattr(base, group), **fields)
    cfg = dataclasses.replace(base, **top)
    cfg = dataclasses.replace(cfg, data=resolve_partitioner(cfg.data))  # 'auto': the set's own default (an unknown name is refused below)
    _check_cross(cfg)
    return cfg


def _candidates_from_seq(raw: Any) -> tuple[float, ...]:
    if isinstance(raw, (list, tuple)):
        return parse_candidates(",".join(str(a) for a in raw))
    raise _fail("strategy.candidates", raw, _KEYS["strategy.candidates"][1][2])


def _check_cross(cfg: RunConfig) -> None:
    if cfg.strategy.name == "fixed" and cfg.strategy.multiplier == UNSET_MULTIPLIER:
        raise ConfigError(
            "run config 'strategy.multiplier' is not set, and 'strategy.name' = 'fixed' needs it; "
            "allowed: a finite number >= 0, e.g. --run-config \"strategy.name='fixed' strategy.multiplier=3.0\""
        )
    t = cfg.train
    if t.mini_batch % t.micro_batch:
        raise ConfigError(
            f"run config 'train.mini-batch' = {t.mini_batch} is not a multiple of "
            f"'train.micro-batch' = {t.micro_batch}; allowed: a mini-batch that the micro-batch divides"
        )
    if cfg.eval.every and PROMPT_SETS[cfg.data.name].heldout_rows is None:
        with_heldout = [name for name, prompt_set in PROMPT_SETS.items() if prompt_set.heldout_rows is not None]
        raise ConfigError(
            f"run config 'eval.every' = {cfg.eval.every} needs held-out problems per client, which "
            f"'data.name' = {cfg.data.name!r} does not have; allowed: 0 (evaluate with python -m eval.run), "
            f"or data.name one of {', '.join(repr(d) for d in with_heldout)}"
        )
    prompt_set = PROMPT_SETS[cfg.data.name]
    if cfg.data.partitioner not in prompt_set.partitioners:
        raise ConfigError(
            f"run config 'data.partitioner' = {cfg.data.partitioner!r} is not defined for 'data.name' = "
            f"{cfg.data.name!r}; allowed: {', '.join(repr(p) for p in prompt_set.partitioners)}"
        )
    if cfg.num_clients and cfg.strategy.min_train_clients > cfg.num_clients:
        raise ConfigError(
            f"run config 'strategy.min-train-clients' = {cfg.strategy.min_train_clients} exceeds 'num-clients' = "
            f"{cfg.num_clients}; allowed: at most the number of clients"
        )
    if cfg.rollout.backend in ("vllm", "auto"):  # auto may pick vLLM on a GPU host
        for key, value in (("rollout.temperature", cfg.rollout.temperature), ("eval.temperature", cfg.eval.temperature)):
            try:
                check_vllm_sampling(value, key)
            except ValueError as err:
                raise ConfigError(f"run config '{key}' = {value!r} is invalid with 'rollout.backend' = {cfg.rollout.backend!r}: {err}") from None
    check_robustness(cfg)  # the robustness layer's rules (robustness_rules.py)
    check_privacy(cfg)  # the privacy layer's (privacy_rules.py)
    check_server_rule(cfg)  # the server optimizers' (server_rules.py)
    if cfg.cache.rollouts > cfg.rollout.per_round:
        raise ConfigError(
            f"run config 'cache.rollouts' = {cfg.cache.rollouts} exceeds 'rollout.per-round' = "
            f"{cfg.rollout.per_round}; allowed: at most the number of rollouts per round"
        )


# (run-config key, the module it imports, the pyproject extra that installs it)
TRACKER_PACKAGES = (
    ("logging.tensorboard", "tensorboard", "tensorboard"),
    ("logging.wandb", "wandb", "wandb"),
    ("logging.mlflow", "mlflow", "mlflow"),
)


def check_server_requirements(cfg: RunConfig) -> None:
    """What the ServerApp's host needs beyond the core install, checked before round 1, and the
    data files a simulation's clients read from this host: a ``data.path`` or ``data.eval-path``
    written as a local path must exist here (a SuperNode never reads them: docs/deployment.md)."""
    import importlib.util
    from pathlib import Path

    from fedopd.data.prompt_files import looks_local

    for key, value in (("data.path", cfg.data.path), ("data.eval-path", cfg.data.eval_path)):
        if value and cfg.data.name in ("prompts", "math") and looks_local(value) and not Path(value).expanduser().exists():
            raise ConfigError(
                f"run config '{key}' = {value!r} is a local path that does not exist on this host; allowed: an existing file or "
                "folder, a hub dataset id ('owner/name'), or '' (in a deployment each SuperNode names its own: node config 'data-path')"
            )

    for key, module, extra in TRACKER_PACKAGES:
        if getattr(cfg.logging, key.split(".", 1)[1]) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"run config '{key}' = true needs the {module} package on the ServerApp's host; "
                f"allowed: false, or install it with pip install -e '.[{extra}]'"
            )


def check_local_prompts(cfg: RunConfig, num_partitions: int, *, fetch: bool = False) -> str | None:
    """The prompt set and its partition over ``num_partitions`` clients (:func:`fedopd.data.check_prompt_set`:
    empty partitions, files without their columns or rows, gold answers math-verify cannot parse, a
    held-out scoring cache without enough prompts); a :class:`ConfigError` names the file, the key and
    the problem. A ``prompts`` set that is not a local path here (a hub id, files only the clients
    hold) is left to the clients, and so, unless ``fetch`` (the ServerApp), is MATH from the hub:
    the reason it was not checked is returned instead."""
    from pathlib import Path

    from fedopd.core.strategies import capabilities
    from fedopd.data import check_prompt_set

    def here(path: str) -> bool:  # what the loader reads from this file system (fedopd.data.prompt_files)
        return bool(path) and Path(path).expanduser().exists()

    data = cfg.data
    if data.name == "prompts" and not here(data.path):
        return f"data.path = {data.path!r} is not a path on this host, so its prompts were not read here; each client checks them when it loads them"
    if not fetch and data.name == "math" and not here(data.path):
        if data.partitioner == "groups":
            from fedopd.data.hendrycks_math import check_math_groups

            try:
                check_math_groups(num_partitions)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        return (
            "data.name = 'math' comes from the hub: its problems were not downloaded for this offline check (the ServerApp reads them before round 1)"
        )
    if not fetch and data.eval_path and not here(data.eval_path):
        return f"data.eval-path = {data.eval_path!r} is not a path on this host: the prompts were not read offline (the ServerApp and each client read them)"
    need = None
    if capabilities(cfg.strategy.name).scoring_cache == "untrained":
        need = (
            cfg.rollout.per_round + cfg.cache.rollouts,
            f"strategy.name = {cfg.strategy.name!r} scores on prompts outside the round's batch: rollout.per-round + cache.rollouts "
            f"= {cfg.rollout.per_round} + {cfg.cache.rollouts}",
        )
    try:
        check_prompt_set(cfg.data, num_partitions, cfg.eval.prompts_per_client if cfg.eval.every else 0, need)
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from None
    return None
