"""What a client's metrics may hold, per phase: the gate every reply passes before the server uses it.

Replies come from hosts the server does not control (another version of the app, a broken GPU, a
hostile participant). A reply whose metrics break the phase's schema is left out of the round
with the reason; nothing here raises. Flower's ``MetricRecord`` already limits values to ints,
floats and lists of them; on top of that:

* every value is finite (a JSON record holds no NaN, an average no inf);
* ``num-examples`` is a positive integer (an int, or a float with an integer value), no larger
  than what a client can hold (``max_examples``: train, the whole prompt pool,
  ``data.prompts-per-client`` × clients; evaluate, ``eval.prompts-per-client``);
* ``partition-id``, where present (this app's clients always send it), is an integer in [0, n)
  for n partitions (n unknown: >= 0);
* the metrics the server reads as numbers (:data:`TRAIN_SCALARS`, :data:`EVALUATE_SCALARS`) are
  scalars, not lists; percentages of an evaluation are in [0, 100];
* keys the schema does not know (a client one version ahead) are allowed: finite scalars or lists
  of them, kept in the round record and never handed to Flower's aggregation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

WEIGHT_KEY = "num-examples"
PARTITION_KEY = "partition-id"

# What a train reply's metrics hold today (client_app/handlers.py); the ones present must be scalars.
TRAIN_SCALARS = frozenset(
    {
        WEIGHT_KEY,
        PARTITION_KEY,
        "loss",
        "loss_first",
        "loss_last",
        "kl_before",
        "kl_after",
        "response_length",
        "cap_hit_rate",
        "accuracy",
        "cache_teacher_score",
        "steps",
        "tokens",
        "lr_first",
        "lr_last",
        "rollout_s",
        "grade_s",
        "teacher_s",
        "cache_s",
        "opd_s",
        "train_s",
        "total_s",
        "worker-pid",
        "worker-model-loads",
        "worker-rss-mb",
    }
)
# An evaluate reply's metrics are averaged key by key (server_app/evaluation.py): all scalars.
EVALUATE_PERCENT_PREFIXES = ("accuracy", "avg@", "pass@")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    if _real(value):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_real(v) and math.isfinite(v) for v in value)
    return False


def _integer(value: Any) -> bool:
    return _real(value) and math.isfinite(value) and float(value).is_integer()


def common_problem(metrics: Mapping[str, Any], num_partitions: int | None, max_examples: int | None = None) -> str | None:
    """The checks every phase shares: finite values, the weight and the partition id."""
    for key, value in metrics.items():
        if not _finite(value):
            return f"metric '{key}' is {_show(value)}: expected a finite number or a list of them"
    weight = metrics.get(WEIGHT_KEY)
    if not (_integer(weight) and weight > 0):
        return f"'{WEIGHT_KEY}' is {_show(weight)}: expected a positive integer"
    if max_examples and weight > max_examples:
        return f"'{WEIGHT_KEY}' is {_show(weight)}: more than a client can hold ({max_examples})"
    if PARTITION_KEY in metrics:
        pid = metrics[PARTITION_KEY]
        upper = f", < {num_partitions}" if num_partitions else ""
        if not (_integer(pid) and pid >= 0 and (not num_partitions or pid < num_partitions)):
            return f"'{PARTITION_KEY}' is {_show(pid)}: expected an integer >= 0{upper}"
    return None


def train_metrics_problem(metrics: Mapping[str, Any], num_partitions: int | None = None, max_examples: int | None = None) -> str | None:
    """Why a train reply's metrics break the schema, or None."""
    problem = common_problem(metrics, num_partitions, max_examples)
    if problem:
        return problem
    for key in sorted(TRAIN_SCALARS & set(metrics)):
        if isinstance(metrics[key], list):
            return f"metric '{key}' is a list: expected a number"
    return None


def evaluate_metrics_problem(metrics: Mapping[str, Any], num_partitions: int | None = None, max_examples: int | None = None) -> str | None:
    """Why an evaluate reply's metrics break the schema, or None."""
    if "accuracy" not in metrics:
        return "'accuracy' is missing"
    problem = common_problem(metrics, num_partitions, max_examples)
    if problem:
        return problem
    for key, value in metrics.items():
        if isinstance(value, list):
            return f"metric '{key}' is a list: evaluation metrics are averaged over clients, expected a number"
        if key.startswith(EVALUATE_PERCENT_PREFIXES) and not 0.0 <= value <= 100.0:
            return f"metric '{key}' is {_show(value)}: expected a percentage in [0, 100]"
    return None


def _show(value: Any) -> str:
    """A value as a reason shows it: short, whatever it is."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
