"""The privacy layer's rules across keys (docs/privacy.md): differential privacy wraps the average
of client updates only where one is formed by the plain mean, needs the federation's declared
size, excludes the settings that read the round's other updates, and keeps FedTOPS's K̂ clip above
δ. :func:`fedopd.config.parse_run_config` calls :func:`check_privacy`."""

from __future__ import annotations

import math

from fedopd.config.robustness_rules import only_defaults, registered, round_clients
from fedopd.core.errors import ConfigError
from fedopd.core.settings import _KEYS, RunConfig
from fedopd.core.strategies import capabilities

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


def check_privacy(cfg: RunConfig) -> None:
    """Differential privacy (docs/privacy.md) wraps the average of client updates: only where one
    is formed, by Flower's FedAvg mean (the sensitivity C/m assumes it), without the robustness
    settings that depend on the round's other updates; FedTOPS's K̂ clip must sit above δ."""
    p, s = cfg.privacy, cfg.strategy
    if p.clipping == "off":
        only_defaults(
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
            f"does not release that way; allowed: strategy.name one of {registered('private')}, "
            f"or 'privacy.clipping' = 'off'"
        )
    if not cfg.num_clients:
        raise ConfigError(
            f"run config {what} needs 'num-clients', the federation's declared size: the private mean divides by a fixed "
            f"n computed from it and 'strategy.fraction-train', never by a count of who connected or replied; "
            f"allowed: 'num-clients' >= 1 (now 0)"
        )
    if not supports.score_phase:  # the score channel
        only_defaults(
            p,
            _SCORE_CHANNEL_KEYS,
            f"acts on FedTOPS's score channel, which 'strategy.name' = {s.name!r} does not have",
            f"strategy.name one of {registered('score_phase')}",
        )
    if p.clipping != "adaptive":
        only_defaults(p, _ADAPTIVE_KEYS, f"tunes adaptive clipping, which {what} does not use", "'privacy.clipping' = 'adaptive'")
    else:
        from fedtops_strategy.privacy import adaptive_multipliers, count_stddev

        n = round_clients(cfg)
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
