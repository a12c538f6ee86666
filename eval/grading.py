"""Grading for evaluation: the last ``\\boxed{}`` answer, checked against the gold with math-verify.

The implementation lives in :mod:`fedopd.data.grading` (clients grade their rollouts with it too):
timeouts work from any thread and can never hang a run; a pathological expression counts as wrong.
"""

from fedopd.data.grading import GradingError, is_correct, last_boxed

__all__ = ["GradingError", "is_correct", "last_boxed"]
