"""Evaluation metrics (Avg@k, Pass@k, cap-hit rate, macro average, Local mean): they live in
:mod:`fedopd.engine.metrics`, where the client's held-out evaluation uses them; re-exported here for the
evaluation commands."""

from fedopd.engine.metrics import avg_at_k, cap_hit_rate, local_mean, macro_average, pass_at_k

__all__ = ["avg_at_k", "cap_hit_rate", "local_mean", "macro_average", "pass_at_k"]
