"""On-policy distillation: the teacher's pass, the per-token divergences, the local OPD epoch and
the scoring cache that gives Ĵ and K̂. It imports :mod:`fedopd.core` and :mod:`fedopd.models`."""
