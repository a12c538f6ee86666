"""What a worker process loads once and shares with every logical client it serves.

In a simulation one process serves several logical clients, one message at a time: they share
one student, one teacher and one rollout engine (the student's LoRA factors are loaded from the
message before each use). Per-client state (θ_t, the scoring cache, the optimizer state) lives
in each client's ``context.state``, never here.

The models have a lifecycle: a run config that needs other models (another
``rollout.gpu-memory-utilization``, say) closes the old ones first, so that vLLM's engine process
and its memory are gone before the new engine asks for them; :func:`close_worker_models` does the
same when the worker stops, and at the interpreter's exit.
"""

from __future__ import annotations

import atexit
import gc
from logging import INFO

from flwr.common.logger import log

from fedopd.config import LoraSettings, ModelSettings, RunConfig
from fedopd.core.errors import LocalError
from fedopd.data import Prompt, encode_prompts, heldout_rows, partition_rows
from fedopd.data.node_data import NodeData, in_node_terms
from fedopd.engine.round import ClientModels, load_client_models
from fedopd.models.positions import needed_positions
from fedopd.models.vocab import ModelFiles, eos_conventions
from fedopd.rollout.vllm_engine import run_max_num_seqs

_PROMPTS: dict[tuple, tuple[Prompt, ...]] = {}  # the encoded pools of one run's data settings (a new run's replace them)
_LOADS = [0]
_MODELS: dict[tuple, ClientModels] = {}  # at most one entry: the models of the last config


def model_loads() -> int:
    """How many times this process has loaded base models (a resident worker: once)."""
    return _LOADS[0]


def worker_models(
    model: ModelSettings,
    lora: LoraSettings,
    backend: str,
    max_model_len: int,
    gpu_memory_utilization: float,
    stop_tokens: str = "auto",
    max_num_seqs: int | None = None,
) -> ClientModels:
    """One student, teacher and rollout engine per process; a new config closes the old ones
    (:func:`close_worker_models`) before it loads its own.

    The LoRA init seed is irrelevant here: every message brings the factors to use.
    """
    key = (model, lora, backend, max_model_len, gpu_memory_utilization, stop_tokens, max_num_seqs)
    if key in _MODELS:
        return _MODELS[key]
    close_worker_models()
    _LOADS[0] += 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 'Loading weights' bar per model and process is noise in a run's log
    models = load_client_models(
        model.student,
        model.teacher,
        lora=lora,
        backend=backend,
        dtype=model.dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        stop_tokens=stop_tokens,
        max_num_seqs=max_num_seqs,
    )
    note = eos_conventions(ModelFiles.of(models.student), ModelFiles.of(models.teacher))
    log(INFO, "rollouts stop at %s%s", list(models.stop_tokens.tokens), f" ({note})" if note else "")
    engine = "vLLM" if type(models.rollout).__name__ == "VLLMRolloutEngine" else "HF"
    log(INFO, "rollouts on %s; the student runs in %s (training and rollouts alike)", engine, str(models.student.dtype).removeprefix("torch."))
    _MODELS[key] = models
    return models


def close_worker_models() -> None:
    """Close this process's models: stop the rollout engine (vLLM's engine process) and free the
    HF models' memory. The next :func:`worker_models` loads anew."""
    while _MODELS:
        _, models = _MODELS.popitem()
        models.rollout.close()
        del models
    _PROMPTS.clear()  # encoded with the old student's tokenizer
    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


atexit.register(close_worker_models)  # an interpreter that exits normally leaves no engine behind


def _models(cfg: RunConfig) -> ClientModels:
    r = cfg.rollout
    max_len = needed_positions(cfg.data.max_prompt_tokens, r.max_new_tokens, cfg.eval.max_new_tokens if cfg.eval.every else 0)
    return worker_models(cfg.model, cfg.lora, r.backend, max_len, r.gpu_memory_utilization, r.stop_tokens, run_max_num_seqs(cfg))


def _encoded(
    cfg: RunConfig, models: ClientModels, kind: str, partition_id: int, num_partitions: int, node: NodeData | None = None
) -> tuple[Prompt, ...]:
    # The partition, the prompt pool and the held-out problems depend on data.seed (cfg.data), never
    # on the training seed: runs with seeds 0, 1, 2 differ only in training randomness.
    run = (cfg.data, cfg.eval.prompts_per_client, num_partitions, cfg.model.student, node)
    key = (run, kind, partition_id)
    if key not in _PROMPTS:
        for other in [k for k in _PROMPTS if k[0] != run]:  # another run's pools: one run's at a time stay
            del _PROMPTS[other]
        _PROMPTS[key] = _load(cfg, models, kind, partition_id, num_partitions, node)
    return _PROMPTS[key]


def node_rows(cfg: RunConfig, kind: str, partition_id: int, num_partitions: int, node: NodeData | None = None) -> list[dict]:
    """This client's ``kind`` (``train``, ``heldout``) rows: a node with data of its own (node
    config ``data-path``) reads it as the one partition of its own set; any other reads partition
    ``partition_id`` of the run config's set. Any failure is a :class:`LocalError` naming the key."""
    data = cfg.data
    if node is not None:
        data, partition_id, num_partitions = node.settings(cfg.data), 0, 1
    try:
        if kind == "train":
            return partition_rows(data, partition_id, num_partitions)
        return heldout_rows(data, partition_id, num_partitions, cfg.eval.prompts_per_client)
    except LocalError as err:
        raise (in_node_terms(err) if node is not None else err) from err
    except Exception as err:  # noqa: BLE001 - any other failure on the node's rows: its text may quote them
        where = "node config 'data-path'" if node is not None else "the run config's data.* keys"
        raise LocalError(
            f"{kind} prompts: {type(err).__name__}: {err}", where, f"its {kind} prompts could not be loaded ({type(err).__name__})"
        ) from err


def _load(cfg: RunConfig, models: ClientModels, kind: str, partition_id: int, num_partitions: int, node: NodeData | None) -> tuple[Prompt, ...]:
    rows = node_rows(cfg, kind, partition_id, num_partitions, node)
    source = "this node's own" if node is not None else f"client partition {partition_id} of {num_partitions} ('{cfg.data.name}')"
    try:
        return tuple(encode_prompts(models.student.tokenizer, rows, cfg.data.max_prompt_tokens, source=f"{kind} prompts of {source}"))
    except ValueError as err:  # e.g. no prompt fits data.max-prompt-tokens: the text may quote the rows
        raise LocalError(str(err), "data.max-prompt-tokens", f"its {kind} prompts could not be encoded") from err


def setup(
    cfg: RunConfig, partition_id: int, num_partitions: int, *, pooled: bool = False, node: NodeData | None = None
) -> tuple[ClientModels, tuple[Prompt, ...]]:
    """The worker's models and this client's tokenized training prompts, loaded once per process.

    ``pooled`` (the Centralized learner, ``learner = 'centralized'`` in its train message): the
    prompts of every partition, in partition order. ``node``: the node's own data
    (:class:`~fedopd.data.node_data.NodeData`), in place of its partition of the run's set.
    """
    models = _models(cfg)
    if pooled:
        return models, sum((_encoded(cfg, models, "train", i, num_partitions) for i in range(num_partitions)), ())
    return models, _encoded(cfg, models, "train", partition_id, num_partitions, node)


def setup_heldout(cfg: RunConfig, partition_id: int, num_partitions: int, node: NodeData | None = None) -> tuple[ClientModels, tuple[Prompt, ...]]:
    """The worker's models and this client's tokenized held-out prompts."""
    models = _models(cfg)
    return models, _encoded(cfg, models, "heldout", partition_id, num_partitions, node)
