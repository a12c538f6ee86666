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

from fedopd.core.errors import ConfigError
from fedopd.core.settings import _KEYS, RUN_CONFIG_KEYS, UNSET_MULTIPLIER, RunConfig
from fedopd.core.strategies import CAPABILITIES, aggregator_problem, capabilities, clients_per_round
from fedopd.data.registry import DATASETS as PROMPT_SETS
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
    _check_robustness(cfg)
    _check_privacy(cfg)
    if cfg.cache.rollouts > cfg.rollout.per_round:
        raise ConfigError(
            f"run config 'cache.rollouts' = {cfg.cache.rollouts} exceeds 'rollout.per-round' = "
            f"{cfg.rollout.per_round}; allowed: at most the number of rollouts per round"
        )


def _registered(what: str) -> str:
    """The registered strategy names that declare ``what`` (fedopd.core.strategies.Capabilities)."""
    return ", ".join(repr(n) for n in CAPABILITIES if getattr(capabilities(n), what))


def _only_defaults(settings: Any, keys: tuple[tuple[str, str], ...], why: str, instead: str) -> None:
    """Refuse any of ``keys`` ((run-config key, attribute)) that ``settings`` sets away from its
    default: ``why`` it has no effect here, and what would give it one (``instead``)."""
    base = type(settings)()
    for key, attr in keys:
        if getattr(settings, attr) != getattr(base, attr):
            raise ConfigError(f"run config '{key}' = {getattr(settings, attr)!r} {why}; allowed: its default {getattr(base, attr)!r}, or {instead}")


def _clients_per_round(cfg: RunConfig) -> int:
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
    mean (:func:`_check_privacy` says so), nor for a strategy that forms no average."""
    if not capabilities(cfg.strategy.name).averages or cfg.privacy.clipping != "off":
        return
    problem = aggregator_problem(cfg.strategy.aggregator, per_round, cfg.strategy.num_malicious)
    if problem is not None:
        key, why = problem
        value = cfg.strategy.aggregator if key == "strategy.aggregator" else cfg.strategy.num_malicious
        raise ConfigError(f"run config '{key}' = {value!r} is invalid: {why}")


def _check_robustness(cfg: RunConfig) -> None:
    """The robustness keys make sense only where updates are averaged, or scored (FedTOPS)."""
    s = cfg.strategy
    supports = capabilities(s.name)
    if not supports.averages:
        _only_defaults(
            s,
            (("strategy.aggregator", "aggregator"), ("strategy.clip-norm", "clip_norm"), ("strategy.max-weight", "max_weight")),
            f"acts on the average of client updates, which 'strategy.name' = {s.name!r} does not form",
            f"strategy.name one of {_registered('averages')}",
        )
    if not supports.score_phase:
        _only_defaults(
            s,
            (("strategy.max-vetoes", "max_vetoes"), ("strategy.score-aggregate", "score_aggregate")),
            "acts on FedTOPS's score replies",
            f"strategy.name one of {_registered('score_phase')}",
        )
    if cfg.num_clients:
        check_per_round(cfg, _clients_per_round(cfg))
    if s.num_malicious and s.aggregator not in ("krum", "multikrum"):
        raise ConfigError(
            f"run config 'strategy.num-malicious' = {s.num_malicious} is used only by Krum; allowed: 0, or "
            f"'strategy.aggregator' one of 'krum', 'multikrum' (now {s.aggregator!r})"
        )


# The privacy keys besides privacy.clipping, as (run-config key, attribute); those of FedTOPS's
# score channel; those that tune adaptive clipping.
_PRIVACY_KEYS = tuple((k, p[1]) for k, (p, _) in _KEYS.items() if p[0] == "privacy" and k != "privacy.clipping")
_SCORE_CHANNEL_KEYS = (
    ("privacy.score-noise", "score_noise"),
    ("privacy.teacher-score-max", "teacher_score_max"),
    ("privacy.change-score-max", "change_score_max"),
)
_ADAPTIVE_KEYS = (
    ("privacy.target-quantile", "target_quantile"),
    ("privacy.clip-norm-lr", "clip_norm_lr"),
    ("privacy.clipped-count-stddev", "clipped_count_stddev"),
)


def _check_privacy(cfg: RunConfig) -> None:
    """Differential privacy (docs/privacy.md) wraps the average of client updates: only where one
    is formed, by Flower's FedAvg mean (the sensitivity C/m assumes it), without the robustness
    settings that depend on the round's other updates; FedTOPS's K̂ clip must sit above δ."""
    p, s = cfg.privacy, cfg.strategy
    if p.clipping == "off":
        _only_defaults(
            p,
            _PRIVACY_KEYS,
            "has no effect while 'privacy.clipping' = 'off' (no differential privacy)",
            "'privacy.clipping' one of 'fixed', 'adaptive'",
        )
        return
    what = f"'privacy.clipping' = {p.clipping!r}"
    for key in ("logging.wandb", "logging.mlflow"):
        if getattr(cfg.logging, key.split(".", 1)[1]):
            raise ConfigError(
                f"run config '{key}' = true with {what} would send the round's diagnostics (client losses, held-out "
                f"accuracy, timings, traffic), which the privacy guarantee does not cover, to a tracking service "
                f"(docs/privacy.md: only published.jsonl and the adapters may be published); allowed: '{key}' = false "
                f"(logging.tensorboard writes to the run folder, the curator's own records)"
            )
    supports = capabilities(s.name)
    if not (supports.averages and supports.private):
        raise ConfigError(
            f"run config {what} privatizes the average of client updates and the scores, which 'strategy.name' = {s.name!r} "
            f"does not release that way; allowed: strategy.name one of {_registered('private')}, "
            f"or 'privacy.clipping' = 'off'"
        )
    if not cfg.num_clients:
        raise ConfigError(
            f"run config {what} needs 'num-clients', the federation's declared size: the private mean divides by a fixed "
            f"n computed from it and 'strategy.fraction-train', never by a count of who connected or replied; "
            f"allowed: 'num-clients' >= 1 (now 0)"
        )
    if not supports.score_phase:  # the score channel
        _only_defaults(
            p,
            _SCORE_CHANNEL_KEYS,
            f"acts on FedTOPS's score channel, which 'strategy.name' = {s.name!r} does not have",
            f"strategy.name one of {_registered('score_phase')}",
        )
    if p.clipping != "adaptive":
        _only_defaults(p, _ADAPTIVE_KEYS, f"tunes adaptive clipping, which {what} does not use", "'privacy.clipping' = 'adaptive'")
    else:
        from fedtops_strategy.privacy import adaptive_multipliers, count_stddev

        n = _clients_per_round(cfg)
        sigma_b = count_stddev(p, n)
        try:
            adaptive_multipliers(p.noise_multiplier, sigma_b)
        except ValueError:
            raise ConfigError(
                f"run config 'privacy.noise-multiplier' = {p.noise_multiplier!r} with 'privacy.clipping' = 'adaptive' needs the "
                f"count's noise σ_b > z/2, and σ_b = {sigma_b:g} ('privacy.clipped-count-stddev' = {p.clipped_count_stddev!r}"
                f"{f', which means n/20 for n = {n}' if not p.clipped_count_stddev else ''}); allowed: "
                f"'privacy.clipped-count-stddev' > {p.noise_multiplier / 2:g}, or a smaller noise multiplier"
            ) from None
    if s.aggregator != "fedavg":
        raise ConfigError(
            f"run config 'strategy.aggregator' = {s.aggregator!r} cannot be combined with {what}: the noise is "
            f"calibrated to the mean of the clipped updates (sensitivity C/m); allowed: 'fedavg'"
        )
    for key, attr in (("strategy.clip-norm", "clip_norm"), ("strategy.max-weight", "max_weight")):
        if getattr(s, attr):
            raise ConfigError(
                f"run config '{key}' = {getattr(s, attr)!r} cannot be combined with {what}: it bounds each update "
                f"by the round's median, which depends on the other clients' data (privacy clips at privacy.clip-norm "
                f"and weighs every update equally); allowed: 0"
            )
    if p.max_epsilon and (p.noise_multiplier == 0 or (supports.score_phase and p.score_noise == 0)):
        key, value = ("privacy.noise-multiplier", p.noise_multiplier) if p.noise_multiplier == 0 else ("privacy.score-noise", p.score_noise)
        raise ConfigError(
            f"run config 'privacy.max-epsilon' = {p.max_epsilon!r} cannot be met with '{key}' = {value!r}: a release without "
            f"noise has ε = ∞; allowed: 'privacy.max-epsilon' = 0, or '{key}' > 0"
        )
    if supports.score_phase and math.isfinite(s.trust_budget) and p.change_score_max <= s.trust_budget:
        raise ConfigError(
            f"run config 'privacy.change-score-max' = {p.change_score_max!r} must exceed 'strategy.trust-budget' = "
            f"{s.trust_budget!r}: with K̂ clipped at or below δ every candidate would be feasible; allowed: a number > {s.trust_budget!r}"
        )


# (run-config key, the module it imports, the pyproject extra that installs it)
TRACKER_PACKAGES = (
    ("logging.tensorboard", "tensorboard", "tensorboard"),
    ("logging.wandb", "wandb", "wandb"),
    ("logging.mlflow", "mlflow", "mlflow"),
)


def check_server_requirements(cfg: RunConfig) -> None:
    """What the ServerApp's host needs beyond the core install, checked before round 1."""
    import importlib.util

    for key, module, extra in TRACKER_PACKAGES:
        if getattr(cfg.logging, key.split(".", 1)[1]) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"run config '{key}' = true needs the {module} package on the ServerApp's host; "
                f"allowed: false, or install it with pip install -e '.[{extra}]'"
            )
