"""What one message may make this node do: bounds its operator sets, checked before any work.

The run config and the messages come from the server, which a node trusts no more than the server
trusts it. Every count that sets a client's work or memory (rollouts, response and prompt lengths,
samples, the pooled clients, the scoring cache, the prompt pool) multiplies into one estimate,
:func:`message_tokens`: the tokens one message makes the node generate, run through the models, or
read into its prompt pool. A message whose estimate exceeds the node's bound, a LoRA rank above its
bound, or a model its operator did not allow, is refused before anything is loaded or run, naming
the run-config keys and the node config key.

Node config keys (``flower-supernode --node-config``):

=====================  =================  =================================================
key                    default            meaning
=====================  =================  =================================================
``max-tokens``         :data:`MAX_TOKENS` the most tokens one message may cost (about 5x the
                                          paper presets' largest message: 6.5 million)
``max-lora-rank``      :data:`MAX_RANK`   the largest ``lora.rank`` this node trains
``allowed-models``     ``""``             space-separated model ids or paths this node loads
                                          as ``model.student`` or ``model.teacher``; ``""``:
                                          any on a simulation's node, built-in models and hub
                                          ids on a deployment node
=====================  =================  =================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fedopd.core.errors import LocalError, RequestError
from fedopd.core.settings import RunConfig
from fedopd.models.paths import is_hub_id

MAX_TOKENS = 1 << 25  # 33.6 million
MAX_RANK = 256
ROW_OVERHEAD = 128  # tokens of the chat template and the instruction every row is rendered with, before its length is known


def message_tokens(cfg: RunConfig, kind: str, *, partitions: int = 1, prompt_pool: int = 0, candidates: int = 0) -> int:
    """The tokens one ``kind`` message (``train``, ``score``, ``evaluate``) makes a client process:

    - train: its rollouts generated (``rollout.per-round`` x ``partitions`` x ``rollout.max-new-tokens``)
      and run through the student and the teacher (x 2 x (``data.max-prompt-tokens`` +
      ``rollout.max-new-tokens``)), the scoring cache's ``cache.rollouts`` sequences (generated as
      well when they come from untrained prompts) and its stored values (:func:`cache_entries`),
      and its prompt pool read (``prompt_pool`` rows x (``data.max-prompt-tokens`` +
      :data:`ROW_OVERHEAD`): each row is made, rendered with the chat template and tokenized
      before its length is known; a far longer row is dropped before it is rendered,
      :func:`fedopd.data.prompts.encode_prompts`);
    - score: ``candidates`` passes over the scoring cache;
    - evaluate: ``eval.prompts-per-client`` x (1 greedy + ``eval.samples``) responses of
      (``data.max-prompt-tokens`` + ``eval.max-new-tokens``), and its prompt pool read.
    """
    prompt, new = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    cache = cfg.cache.rollouts * (prompt + new) + cache_entries(cfg)
    if kind == "train":
        rollouts = cfg.rollout.per_round * partitions
        return rollouts * new + 2 * rollouts * (prompt + new) + 2 * cache + prompt_pool * (prompt + ROW_OVERHEAD)
    if kind == "score":
        return candidates * 2 * cache
    return cfg.eval.prompts_per_client * (1 + cfg.eval.samples) * (prompt + cfg.eval.max_new_tokens) + prompt_pool * (prompt + ROW_OVERHEAD)


def cache_entries(cfg: RunConfig) -> int:
    """The scoring cache's stored values: per cached position its teacher's and student's top-k
    (ids and log-probabilities) and the sampled token's, ``cache.rollouts`` x ``cache.positions``
    x (2 ``cache.top-k`` + 1); it travels in the client's state with every message."""
    return cfg.cache.rollouts * cfg.cache.positions * (2 * cfg.cache.top_k + 1)


def _positive_int(node_config: Mapping[str, Any], key: str, default: int) -> int:
    value = node_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LocalError(f"node config {key!r} = {value!r}: expected an integer >= 1", f"node config {key!r}", "not an integer >= 1")
    return value


@dataclasses.dataclass(frozen=True)
class NodeLimits:
    """The node's bounds (module docstring)."""

    max_tokens: int = MAX_TOKENS
    max_lora_rank: int = MAX_RANK
    allowed_models: tuple[str, ...] = ()

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeLimits:
        models = node_config.get("allowed-models", "")
        if not isinstance(models, str):
            raise LocalError(f"node config 'allowed-models' = {models!r}: expected a string", "node config 'allowed-models'", "not a string")
        return cls(_positive_int(node_config, "max-tokens", MAX_TOKENS), _positive_int(node_config, "max-lora-rank", MAX_RANK), tuple(models.split()))

    def check(self, cfg: RunConfig, kind: str, *, partitions: int = 1, prompt_pool: int = 0, candidates: int = 0, deployment: bool = False) -> None:
        """Refuse (:class:`RequestError`) a message this node does not take on (module docstring).
        ``deployment`` (:func:`fedopd.data.node_data.deployment_node`): without ``allowed-models``,
        only built-in models and hub ids (``org/name``), never a path the server names. The
        errors name the node config keys, not their values."""
        for key, model in (("model.student", cfg.model.student), ("model.teacher", cfg.model.teacher)):
            if self.allowed_models and model not in self.allowed_models:
                raise RequestError(f"the run config's {key} = {model[:200]!r} is not among this node's allowed models (node config 'allowed-models')")
            if deployment and not self.allowed_models and not (model.startswith("builtin:") or is_hub_id(model)):
                raise RequestError(
                    f"the run config's {key} = {model[:200]!r} is neither a built-in model nor a hub id ('org/name'); a deployment node "
                    "loads a local model folder only when its node config 'allowed-models' lists it"
                )
        if cfg.lora.rank > self.max_lora_rank:
            raise RequestError(f"the run config's lora.rank = {cfg.lora.rank} is above this node's bound (node config 'max-lora-rank')")
        tokens = message_tokens(cfg, kind, partitions=partitions, prompt_pool=prompt_pool, candidates=candidates)
        if tokens > self.max_tokens:
            keys = {
                "train": "rollout.per-round, rollout.max-new-tokens, data.max-prompt-tokens, data.prompts-per-client, cache.*",
                "score": "cache.*, data.max-prompt-tokens, rollout.max-new-tokens and the candidates",
                "evaluate": "eval.prompts-per-client, eval.samples, eval.max-new-tokens, data.max-prompt-tokens",
            }[kind]
            raise RequestError(f"this {kind} message would cost about {tokens:,} tokens ({keys}), above this node's bound (node config 'max-tokens')")
