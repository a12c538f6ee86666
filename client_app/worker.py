"""What a worker process loads once and shares with every logical client it serves.

In a simulation one process serves several logical clients, one message at a time: they share
one student, one teacher and one rollout engine (the student's LoRA factors are loaded from the
message before each use). Per-client state (θ_t, the scoring cache, the optimizer state) lives
in each client's ``context.state``, never here.
"""

from __future__ import annotations

from functools import lru_cache

from fedopd.config import DataConfig, LoraSettings, ModelConfig, RunConfig
from fedopd.data import MATH_CLIENT_GROUPS, Prompt, encode_prompts, load_math_rows, partition_math, tiny_arith_partition
from fedopd.round import ClientModels, load_client_models

_PROMPTS: dict[tuple, tuple[Prompt, ...]] = {}


@lru_cache(maxsize=1)
def worker_models(
    model: ModelConfig, lora: LoraSettings, backend: str, max_model_len: int, gpu_memory_utilization: float
) -> ClientModels:
    """One student, teacher and rollout engine per process (a new config replaces the old).

    The LoRA init seed is irrelevant here: every message brings the factors to use.
    """
    return load_client_models(
        model.student,
        model.teacher,
        lora=lora,
        backend=backend,
        dtype=model.dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
    )


@lru_cache(maxsize=1)
def math_partitions(path: str, prompts_per_client: int, seed: int) -> tuple[tuple[dict, ...], ...]:
    """The three MATH client partitions, computed once per process (every client reads its own)."""
    return tuple(tuple(p) for p in partition_math(load_math_rows(path), prompts_per_client, seed))


def partition_rows(data: DataConfig, partition_id: int, num_partitions: int, seed: int) -> list[dict]:
    if data.name == "tiny-arith":
        return tiny_arith_partition(partition_id, num_partitions, data.prompts_per_client, seed)
    if data.name == "math":
        if num_partitions != len(MATH_CLIENT_GROUPS):
            raise ValueError(f"data.name = 'math' has {len(MATH_CLIENT_GROUPS)} subject-group clients; num-partitions is {num_partitions}")
        return list(math_partitions(data.path, data.prompts_per_client, seed)[partition_id])
    raise ValueError(f"data.name = {data.name!r} has no loader; allowed: 'tiny-arith', 'math'")


def setup(cfg: RunConfig, partition_id: int, num_partitions: int) -> tuple[ClientModels, tuple[Prompt, ...]]:
    """The worker's models and this client's tokenized prompts, each loaded once per process."""
    r = cfg.rollout
    models = worker_models(cfg.model, cfg.lora, r.backend, cfg.data.max_prompt_tokens + r.max_new_tokens, r.gpu_memory_utilization)
    key = (cfg.data, partition_id, num_partitions, cfg.seed, cfg.model.student)
    if key not in _PROMPTS:
        rows = partition_rows(cfg.data, partition_id, num_partitions, cfg.seed)
        source = f"client partition {partition_id} of {num_partitions} ('{cfg.data.name}')"
        _PROMPTS[key] = tuple(encode_prompts(models.student.tokenizer, rows, cfg.data.max_prompt_tokens, source=source))
    return models, _PROMPTS[key]
