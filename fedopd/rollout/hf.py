"""The Hugging Face rollout engine: batched ``generate`` with KV cache, the CPU path and the
fallback on GPU (:mod:`fedopd.rollout.vllm_engine` implements the same interface for paper-scale runs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from fedopd.models.vocab import ModelFiles, eos_ids
from fedopd.rollout.interface import RolloutEngine, Rollouts, SamplingParams


def own_eos_ids(student) -> list[int]:
    """The student's own EOS ids (where responses end when no stop set is given)."""
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


BATCH = 32  # rollouts per generate call (HFRolloutEngine's default): its KV cache is one batch's


class HFRolloutEngine(RolloutEngine):
    """Batched ``generate`` on the student :class:`fedopd.models.CausalLM` (LoRA unmerged).

    ``progress``: when set, a long generation reports its decoding step every ``progress_every_s``.
    """

    progress: Callable[[str], None] | None = None
    progress_every_s: float = 10.0

    def __init__(self, student, batch_size: int = BATCH, stop_token_ids: Sequence[int] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.student = student
        self.batch_size = batch_size
        tok = student.tokenizer
        if stop_token_ids is None:  # the student's own EOS ids (a run passes the pair's stop set)
            stop_token_ids = own_eos_ids(student)
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
