"""The rollout request contract that every engine honours: :class:`SamplingParams` in,
:class:`Rollouts` out, through a :class:`RolloutEngine`. The engines live in
:mod:`fedopd.rollout` (Hugging Face) and :mod:`fedopd.rollout.vllm_engine` (vLLM); both import this
module, and neither imports the other at module level.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one generation request."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Rollouts:
    """Prompt and response token ids of a batch of rollouts, one response per prompt.

    ``response_ids[i]`` ends with the EOS token unless ``capped[i]`` (the response reached
    ``max_new_tokens`` without one). ``finish_reasons[i]``: as the engine reports it (vLLM's
    ``"stop"`` / ``"length"``; the HF engine says the same from the stop set and the cap), None if
    the engine does not say. ``logprobs[i][j]``: log-probability of ``response_ids[i][j]`` under the
    engine's model distribution, where the engine was asked for it, else None.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    capped: list[bool]
    finish_reasons: list[str] | None = None
    logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> np.ndarray:
        return np.asarray([len(r) for r in self.response_ids], dtype=np.int64)

    @property
    def cap_hit_rate(self) -> float:
        return float(np.mean(self.capped)) if self.capped else 0.0


class RolloutEngine(ABC):
    """Generates rollouts from the student with the LoRA factors it was last given."""

    @abstractmethod
    def set_adapter(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Use these LoRA factors (named fp32 arrays) for the following requests."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollouts:
        """One sampled response per prompt."""

    def close(self) -> None:
        """Release what the engine holds beyond Python objects (vLLM: its engine process). Called
        when the worker's models are replaced and when the worker stops; a no-op by default."""
