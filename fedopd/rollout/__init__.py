"""Rollout engines: sample one response per prompt from the student with its current adapter.

Every engine honours one request contract (:mod:`~fedopd.rollout.interface`: prompt token ids in,
:class:`Rollouts` out), so the client round and the evaluation runner do not care which one runs:
:mod:`~fedopd.rollout.hf` (Hugging Face ``generate``), :mod:`~fedopd.rollout.vllm_engine` (vLLM),
and :mod:`~fedopd.rollout.factory`, the one that ``rollout.backend`` names on this host. It imports
:mod:`fedopd.core` and :mod:`fedopd.models`.
"""

from fedopd.rollout.factory import make_rollout_engine, resolve_backend
from fedopd.rollout.hf import GenerationProgress, HFRolloutEngine, split_response
from fedopd.rollout.interface import RolloutEngine, Rollouts, SamplingParams

__all__ = [
    "GenerationProgress",
    "HFRolloutEngine",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "make_rollout_engine",
    "resolve_backend",
    "split_response",
]
