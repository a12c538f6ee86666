"""vLLM rollout engine: the paper-scale path (``rollout.backend = "vllm"``).

The base student is loaded once into ``vllm.LLM(..., enable_lora=True, max_lora_rank=r)``. Each
new set of factors is written as a PEFT adapter folder and served through a **fresh**
``LoRARequest`` name and integer id: vLLM caches adapters by id and prefix-cache blocks by name, so
reusing either would serve stale weights. Prompts go in as token ids, token ids come out, and a
response hit the cap when its finish reason is ``"length"``.

Every request gets its own seed derived from the call's seed and its position, so repeated
prompts (8 samples of one problem) are independent draws and a call is reproducible.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from fedopd.lora import name_mismatch
from fedopd.models import save_adapter
from fedopd.rollout import RolloutEngine, Rollouts, SamplingParams


def vllm_available() -> bool:
    """vLLM is importable and a CUDA device is present."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def request_seeds(seed: int, count: int) -> list[int]:
    """Distinct, reproducible per-request seeds."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count)]


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM for a student whose LoRA factors change every round.

    Parameters
    ----------
    model : str
        Hub id or local folder of the base student (resolved by ``fedopd.models``).
    names, lora_config
        The adapter's factor names (wire order) and ``peft.LoraConfig``, to write adapter folders.
    max_model_len : int
        Prompt plus response tokens (``data.max-prompt-tokens + rollout.max-new-tokens``).
    gpu_memory_utilization : float
        vLLM's share of the GPU (weights + KV cache), leaving the rest to the HF student and teacher.
    """

    def __init__(
        self,
        model: str,
        names: Sequence[str],
        lora_config,
        *,
        max_model_len: int,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "bfloat16",
        seed: int = 0,
        workdir: str | Path | None = None,
    ) -> None:
        from vllm import LLM

        self.names = list(names)
        self.lora_config = lora_config
        self.llm = LLM(
            model=model,
            enable_lora=True,
            max_lora_rank=int(lora_config.r),
            max_loras=1,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
        )
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedtops-vllm-adapters-"))
        self._next_id = 0
        self._request = None

    def set_adapter(self, arrays: Mapping[str, np.ndarray]) -> None:
        from vllm.lora.request import LoRARequest

        problem = name_mismatch(self.names, list(arrays))
        if problem:
            raise ValueError(f"LoRA arrays do not match the student's adapter: {problem}")

        self._next_id += 1  # never reuse a name or an id: vLLM would serve the cached weights
        folder = save_adapter(self.workdir / f"adapter-{self._next_id:06d}", {n: arrays[n] for n in self.names}, self.lora_config)
        previous = self.workdir / f"adapter-{self._next_id - 2:06d}"
        if previous.exists():  # vLLM has loaded it long ago; keep only the last two folders
            shutil.rmtree(previous, ignore_errors=True)
        self._request = LoRARequest(f"fedtops-{self._next_id}", self._next_id, str(folder))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollouts:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self._request is None:
            raise RuntimeError("VLLMRolloutEngine.generate before set_adapter: which student weights?")
        sampling = [
            VLLMSamplingParams(
                n=1, temperature=params.temperature, top_p=params.top_p, top_k=-1, min_p=0.0,
                max_tokens=params.max_new_tokens, seed=s,
            )
            for s in request_seeds(params.seed, len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, lora_request=self._request, use_tqdm=False
        )
        responses, capped = [], []
        for out in outputs:
            completion = out.outputs[0]
            responses.append(list(completion.token_ids))
            capped.append(completion.finish_reason == "length")
        return Rollouts([list(p) for p in prompts], responses, capped)

    def close(self) -> None:
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
