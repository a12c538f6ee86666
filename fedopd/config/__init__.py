"""The run configuration, parsed and validated once: run-config dicts, presets, the generated key
reference and ``python -m fedopd.config``. It sits above the registries it validates names against
(:mod:`fedopd.data`, :mod:`fedopd.rollout`) and imports nothing above them.

The settings' types live in :mod:`fedopd.core.settings` (every layer reads them); they are
importable from here too, the path that users and the apps use.
"""

from fedopd.config.parse import (
    REGISTERED,
    allowed_values,
    check_server_requirements,
    parse_candidates,
    parse_run_config,
)
from fedopd.config.robustness_rules import check_aggregator, check_per_round
from fedopd.core.errors import ConfigError
from fedopd.core.settings import (
    _KEYS,
    AGGREGATORS,
    BACKENDS,
    DTYPES,
    HELP,
    OPTIMIZER_STATES,
    PACKING,
    PARTITIONERS,
    RESUME_FREE_KEYS,
    RUN_CONFIG_KEYS,
    SCORE_AGGREGATES,
    UNSET_MULTIPLIER,
    CacheSettings,
    DataSettings,
    EvalSettings,
    LoggingSettings,
    LoraSettings,
    ModelSettings,
    RolloutSettings,
    RunConfig,
    StrategySettings,
    TimeoutSettings,
    TrainSettings,
)

__all__ = [
    "_KEYS",
    "HELP",
    "AGGREGATORS",
    "BACKENDS",
    "DTYPES",
    "OPTIMIZER_STATES",
    "PACKING",
    "PARTITIONERS",
    "REGISTERED",
    "RESUME_FREE_KEYS",
    "RUN_CONFIG_KEYS",
    "SCORE_AGGREGATES",
    "UNSET_MULTIPLIER",
    "CacheSettings",
    "ConfigError",
    "DataSettings",
    "EvalSettings",
    "LoggingSettings",
    "LoraSettings",
    "ModelSettings",
    "RolloutSettings",
    "RunConfig",
    "StrategySettings",
    "TimeoutSettings",
    "TrainSettings",
    "allowed_values",
    "check_aggregator",
    "check_per_round",
    "check_server_requirements",
    "parse_candidates",
    "parse_run_config",
]
