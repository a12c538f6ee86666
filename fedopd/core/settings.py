"""The run configuration's shape: one frozen dataclass per key group, with the app's defaults,
and the run-config keys, each declared once: a field made by :func:`setting` (its default, type,
check, what it allows, one line of help) is the key of its dashed path (``train.mini_batch`` is
``train.mini-batch``). The key table (:data:`_KEYS`), the help (:data:`HELP`), pyproject's
``[tool.flwr.app.config]`` and docs/configuration.md's reference are derived from these fields
(``python -m fedopd.config.reference --write``; ``tests/test_config_reference.py`` checks both files).

Engine code receives the group it needs (``cfg.train``, ``cfg.cache``), never the flat dict.
Parsing a run-config dict into a :class:`RunConfig`, the checks across keys and against the
registries (prompt sets, divergences, strategies), live above every registry in :mod:`fedopd.config`; this module imports
nothing of the project, so every layer may use the settings' types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any

BACKENDS = ("auto", "hf", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
OPTIMIZER_STATES = ("persistent", "reset")
PACKING = ("auto", "packed", "padded")
PARTITIONERS = ("groups", "iid", "dirichlet", "natural")
AGGREGATORS = ("fedavg", "median", "trimmed-mean", "krum", "multikrum")  # fedtops_strategy/aggregators.py
SCORE_AGGREGATES = ("mean", "median", "trimmed-mean")  # fedtops_strategy/selection.py
PRIVACY_CLIPPING = ("off", "fixed", "adaptive")  # fedtops_strategy/privacy.py: Flower's DP wrappers
PRIVACY_SIDES = ("server", "client")
UNSET_MULTIPLIER = -1.0  # strategy.multiplier's default: 'fixed' must be given one
UNSET_SERVER_LR = -1.0  # strategy.server-lr's default: each server optimizer's own (Flower's)


# ---------------------------------------------------------------------------------------------
# The run-config keys: type, check and what is allowed (fedopd.config.parse applies them)
# ---------------------------------------------------------------------------------------------

Check = Callable[[Any], bool]
Spec = tuple[type, Check, str]  # a key's type, its check, and what it allows (for error messages)
SPEC, HELP_TEXT = "run-config spec", "run-config help"


def setting(default: Any, spec: Spec, help: str) -> Any:
    """A field that is a run-config key: its default, its :data:`Spec` and one line of help (the
    meaning column of docs/configuration.md). The key is the field's path with dashes: field
    ``mini_batch`` of ``RunConfig.train`` is ``train.mini-batch``."""
    return field(default=default, metadata={SPEC: spec, HELP_TEXT: help})


def _int(lo: int | None = None, hi: int | None = None) -> Spec:
    desc = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
    return int, lambda v: (lo is None or v >= lo) and (hi is None or v <= hi), desc


def _float(lo: float, *, strict: bool, hi: float | None = None) -> Spec:
    op = ">" if strict else ">="
    desc = f"a finite number {op} {lo}" + (f" and <= {hi}" if hi is not None else "")
    return float, lambda v: math.isfinite(v) and (v > lo if strict else v >= lo) and (hi is None or v <= hi), desc


def _bool() -> Spec:
    return bool, lambda v: True, "true or false"


def _choice(options: tuple[str, ...]) -> Spec:
    return str, lambda v: v in options, "one of " + ", ".join(repr(o) for o in options)


def _nonempty() -> Spec:
    return str, lambda v: bool(v.strip()), "a non-empty string"


# Defaults are the sandbox preset ([tool.flwr.app.config] in pyproject.toml is generated from them);
# the tiny preset and the paper's settings are presets in configs/.


@dataclass(frozen=True)
class ModelSettings:
    student: str = setting("builtin:sandbox-student", _nonempty(), "hub id, local folder, or built-in model (`builtin:sandbox-*`, `builtin:tiny-*`)")
    teacher: str = setting("builtin:sandbox-teacher", _nonempty(), "hub id, local folder, or built-in model (`builtin:sandbox-*`, `builtin:tiny-*`)")
    dtype: str = setting("auto", _choice(DTYPES), "`auto` (bf16 on GPU, fp32 on CPU), `float32`, `bfloat16`, `float16`")
    teacher_batch: int = setting(4, _int(1), "sequences per teacher forward (GPU memory beside the student and vLLM)")


@dataclass(frozen=True)
class LoraSettings:
    rank: int = setting(8, _int(1), "LoRA on q/k/v/o/gate/up/down, dropout 0, PEFT default init")
    alpha: float = setting(16.0, _float(0.0, strict=True), "LoRA on q/k/v/o/gate/up/down, dropout 0, PEFT default init")
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@dataclass(frozen=True)
class DataSettings:
    name: str = setting(
        "sandbox",
        (str, lambda v: bool(v.strip()), "a registered prompt set"),
        "client prompt set: `sandbox`, `tiny-arith`, `math` (MATH), or `prompts` (your own files or hub dataset)",
    )
    prompts_per_client: int = setting(
        256,
        _int(1),
        "`groups`: prompts each client holds; `iid` / `dirichlet` / `natural`: the pool is at most this × the number of clients, so it is the clients' mean size. A client's `num-examples` (its weight) is its partition's size",
    )
    max_prompt_tokens: int = setting(
        384,
        _int(1),
        "longer chat-formatted prompts are dropped, not truncated; plus the longer response cap, at most the models' positions (checked before round 1)",
    )
    path: str = setting(
        "",
        (str, lambda v: True, "a local file or folder, a hub dataset id, or '' for the set's own source"),
        "`math`: local MATH files instead of the hub; `prompts`: a JSONL, JSON, Parquet or CSV file, a folder of them, or a hub dataset id",
    )
    seed: int = setting(
        42,
        _int(0),
        "the partition, the prompt pool and the held-out problems (the paper's MATH partition uses 42); runs with other `seed`s keep them, so seeds differ only in training randomness",
    )
    partitioner: str = setting(
        "auto",
        _choice(("auto", *PARTITIONERS)),
        "`auto`: the data set's own first choice (`groups` for `sandbox`, `math` and `tiny-arith`, `iid` for `prompts`; the run folder's `config.json` records the choice); `groups` (the set's own fixed groups: the paper's three MATH subject groups, the sandbox's three skill groups), or a Flower Datasets partitioner: `iid`, `dirichlet`, `natural` (one client per value of `data.partition-by`). `sandbox` and `math` take all four, `prompts` the last three, `tiny-arith` only `groups`",
    )
    partition_by: str = setting(
        "group",
        _nonempty(),
        "the column `dirichlet` and `natural` split by, and the mix `describe` prints (`group`: the sandbox skill group, the MATH subject)",
    )
    dirichlet_alpha: float = setting(0.5, _float(0.0, strict=True), "Dirichlet concentration; small values give skewed clients of unequal sizes")
    split: str = setting("train", _nonempty(), "`prompts`: the split of `data.path`")
    problem_column: str = setting(
        "problem",
        _nonempty(),
        "`prompts`: the problem text and the gold answer (plain, or a solution whose last `\\boxed{}` is the answer; math-verify must parse every one)",
    )
    answer_column: str = setting(
        "answer",
        _nonempty(),
        "`prompts`: the problem text and the gold answer (plain, or a solution whose last `\\boxed{}` is the answer; math-verify must parse every one)",
    )
    eval_path: str = setting(
        "",
        (str, lambda v: True, "a local file or folder, a hub dataset id, or '' for a seeded split of data.path"),
        '`prompts`: held-out problems; `""` = a seeded one-in-five split of `data.path` that never overlaps the training prompts. Each client\'s held-out problems follow its own mix over `data.partition-by`',
    )
    eval_split: str = setting(
        "",
        (str, lambda v: True, "a split name, or '' for data.split"),
        '`prompts`: held-out problems; `""` = a seeded one-in-five split of `data.path` that never overlaps the training prompts. Each client\'s held-out problems follow its own mix over `data.partition-by`',
    )


@dataclass(frozen=True)
class RolloutSettings:
    backend: str = setting(
        "auto",
        _choice(BACKENDS),
        "`hf`, `vllm`, or `auto` (vLLM where it is importable and CUDA is present, else HF); `vllm` also runs vLLM's CPU build (docs/vllm.md)",
    )
    per_round: int = setting(32, _int(1), "rollouts per client and round (one per prompt)")
    max_new_tokens: int = setting(128, _int(1), "response cap (paper: 4096)")
    temperature: float = setting(
        1.0,
        _float(0.0, strict=True),
        "training sampling, exactly (no top-k, no penalties, whatever the model's generation config ships); with `rollout.backend` `vllm` or `auto` a temperature is at most 2 (vLLM's bound)",
    )
    top_p: float = setting(
        1.0,
        _float(0.0, strict=True, hi=1.0),
        "training sampling, exactly (no top-k, no penalties, whatever the model's generation config ships); with `rollout.backend` `vllm` or `auto` a temperature is at most 2 (vLLM's bound)",
    )
    gpu_memory_utilization: float = setting(
        0.3, _float(0.0, strict=True, hi=1.0), "vLLM's share of the GPU (its CPU build: of the host's memory; 0.1 suits the sandbox models)"
    )
    stop_tokens: str = setting(
        "auto",
        (
            str,
            lambda v: v.strip() == "auto" or all(t.strip() for t in v.split(",")),
            "'auto' (the student's and the teacher's EOS ids) or a comma-separated list of token strings, e.g. '<|im_end|>,<|endoftext|>'",
        ),
        "where a response ends, on both engines: `auto` = every EOS id the student or the teacher declares (tokenizers, `config.json`, `generation_config.json`), so a Base student stops where the instruct teacher's chat turn ends (`<|im_end|>`); or a comma-separated list of tokens of the vocabulary",
    )


@dataclass(frozen=True)
class TrainSettings:
    lr: float = setting(3e-3, _float(0.0, strict=True), "AdamW peak learning rate, cosine decay over the run's local steps (paper: 3e-6 / 9e-6)")
    mini_batch: int = setting(4, _int(1), "rollouts per optimizer step / per forward pass (paper: 8, 4)")
    micro_batch: int = setting(4, _int(1), "rollouts per optimizer step / per forward pass (paper: 8, 4)")
    optimizer_state: str = setting("persistent", _choice(OPTIMIZER_STATES), "keep AdamW state across rounds (`persistent`) or `reset` it")
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    gradient_checkpointing: bool = setting(False, _bool(), "recompute the student's layers in backward (on in the paper presets)")
    loss_chunk: int = 256  # positions per chunk of the OPD loss: its peak is ~7 fp32 (chunk × vocabulary) arrays (docs/performance.md)
    packing: str = setting(
        "auto",
        _choice(PACKING),
        "micro-batches `packed` (padding-free rows, position ids restarting per sequence) or `padded`; `auto` = packed exactly when the attention is flash-attention 2",
    )
    exact_kl: bool = setting(
        False,
        _bool(),
        "also report `kl_before` / `kl_after`, the exact KL over all rollouts before and after the epoch (two extra student passes; the round line then shows it)",
    )
    loss: str = setting(
        "reverse_kl",
        (str, lambda v: bool(v.strip()), "a registered divergence"),
        "the per-token divergence of local OPD: `reverse_kl` (the paper's), `forward_kl`, or `jsd` (GKD's generalized JSD, β = `train.loss-beta`; TRL's definition); the scoring cache's Ĵ and K̂ stay reverse KLs",
    )
    loss_beta: float = setting(
        0.5,
        _float(0.0, strict=False, hi=1.0),
        "β of `train.loss = 'jsd'` (GKD's generalized JSD, TRL's definition): 0 = forward KL, 1 = reverse KL; no effect on the other divergences",
    )


@dataclass(frozen=True)
class StrategySettings:
    name: str = setting(
        "fedtops",
        (str, lambda v: bool(v.strip()), "a registered strategy"),
        "`fedavg`, `fixed`, `fedtops`, the server optimizers `fedexp`, `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad` ([docs/strategies.md](strategies.md)), and the references `local`, `centralized`; `fedtops-se` and `fedtops-heldout-cache` are variants of the lr study ([docs/sandbox.md](sandbox.md#why-fedtops-trails-fedavg-at-the-large-learning-rate-pre-registered-study)), off by default",
    )
    multiplier: float = setting(
        -1.0,
        (
            float,
            lambda v: math.isfinite(v) and (v >= 0 or v == UNSET_MULTIPLIER),
            "a finite number >= 0 (the multiplier a of 'fixed'), or -1 = not set",
        ),
        "a for `fixed`, which requires it (>= 0)",
    )
    candidates: tuple[float, ...] = setting(
        (0.5, 1.0, 2.0, 3.0, 5.0, 10.0),
        (str, lambda v: True, "a comma-separated list of distinct finite numbers >= 0, e.g. '0.5,1,2,3,5,10'"),
        "FedTOPS candidates, in tie-breaking order",
    )
    trust_budget: float = setting(
        0.05,
        (float, lambda v: v >= 0, "a number >= 0, or inf for no trust constraint (the lowest Ĵ wins)"),
        "δ (the paper's; the tiny preset uses 0.01); `inf`: no constraint, the lowest Ĵ wins. How to choose it: [docs/sandbox.md](sandbox.md#choosing-the-trust-budget-δ)",
    )
    fraction_train: float = setting(
        1.0,
        _float(0.0, strict=True, hi=1.0),
        "Flower's `fraction_train`: the share of connected nodes each round samples to train (FedTOPS queries and weighs only those that trained; Centralized takes their combined rollouts; a Local client trains only when sampled). The draw depends only on `seed`, the round and the node ids",
    )
    min_train_clients: int = setting(1, _int(1), "Flower's `min_train_nodes`: the fewest nodes a round trains")
    # Robustness to clients the server does not control (docs/robustness.md); the defaults are the paper's.
    aggregator: str = setting(
        "fedavg",
        _choice(AGGREGATORS),
        "the average of client updates under `fedavg`, `fixed` and `fedtops`: `fedavg` (the num-examples-weighted mean, the paper's), or Flower's robust `median` (FedMedian), `trimmed-mean` (FedTrimmedAvg), `krum`, `multikrum`; what changes meaning: [docs/robustness.md](robustness.md#robust-aggregation)",
    )
    trim_fraction: float = setting(
        0.2,
        (float, lambda v: 0.0 <= v < 0.5, "a number >= 0 and < 0.5"),
        "the share of values cut at each end by `trimmed-mean` (the aggregator's β, and the score aggregate's)",
    )
    num_malicious: int = setting(
        0, _int(0), "f of `krum` / `multikrum`: the nodes assumed malicious (MultiKrum averages the n − f best-scored updates)"
    )
    clip_norm: float = setting(
        0.0,
        (float, lambda v: v == 0 or (math.isfinite(v) and v >= 1), "0 (off), or a finite number >= 1 (a multiple of the round's median update norm)"),
        "0 = off; c >= 1: each client's update θ_i − θ_t (in LoRA-factor coordinates) is scaled down to at most c × the round's median update norm before averaging",
    )
    max_weight: float = setting(
        0.0,
        (
            float,
            lambda v: v == 0 or (math.isfinite(v) and v >= 1),
            "0 (off), or a finite number >= 1 (a multiple of the round's median num-examples)",
        ),
        "0 = off; c >= 1: each client's `num-examples` weight (in the average and in Ĵ) is at most c × the round's median",
    )
    # The server optimizers (their rules: fedopd.config.server_rules); each key acts only on the
    # strategies whose Capabilities.server_keys name it.
    server_lr: float = setting(
        UNSET_SERVER_LR,
        (float, lambda v: math.isfinite(v) and (v > 0 or v == UNSET_SERVER_LR), "a finite number > 0, or -1 = the rule's default"),
        "η, the server learning rate of `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad`; -1 = Flower's default for the rule (FedAvgM 1, FedAdam 0.1, FedYogi 0.01, FedAdagrad 0.1)",
    )
    server_momentum: float = setting(
        0.9,
        (float, lambda v: 0.0 <= v < 1.0, "a number >= 0 and < 1"),
        "β, `fedavgm`'s server momentum (Hsu et al., 2019; Flower's FedAvgM defaults to 0, which is FedAvg)",
    )
    beta1: float = setting(
        0.9, (float, lambda v: 0.0 <= v < 1.0, "a number >= 0 and < 1"), "β₁ of `fedadam` and `fedyogi` (the first moment; FedAdagrad has none)"
    )
    beta2: float = setting(0.99, (float, lambda v: 0.0 <= v < 1.0, "a number >= 0 and < 1"), "β₂ of `fedadam` and `fedyogi` (the second moment)")
    tau: float = setting(
        1e-3,
        (float, lambda v: math.isfinite(v) and v >= 1e-30, "a finite number >= 1e-30 (smaller is 0 in fp32: 0/0 where Δ stays 0)"),
        "τ of `fedadam`, `fedyogi`, `fedadagrad`: the adaptivity, added to √v",
    )
    fedexp_epsilon: float = setting(
        1e-3, _float(0.0, strict=True), "ε of `fedexp`: η_g = max(1, Σ w_i‖Δ_i‖² / (2(‖Δ̄‖² + ε))), w_i the normalized weights"
    )
    fedexp_average: bool = setting(
        False,
        _bool(),
        "`fedexp`: evaluate (and save as `round-NNN/evaluated`) the average of the last two iterates, as the FedExP paper reports; training continues from the last iterate",
    )
    max_vetoes: int = setting(
        0, _int(0), "FedTOPS: a candidate stays feasible while at most this many clients' K̂ exceed δ; 0 = every client must agree (the paper's rule)"
    )
    score_aggregate: str = setting(
        "mean",
        _choice(SCORE_AGGREGATES),
        "FedTOPS's Ĵ across clients: `mean` (num-examples-weighted, the paper's), `median`, or `trimmed-mean` (cut `strategy.trim-fraction` at each end)",
    )


@dataclass(frozen=True)
class PrivacySettings:
    """Central differential privacy of the released adapters and FedTOPS's score channel
    (docs/privacy.md). ``clipping = 'off'``: none, and the other keys must keep their defaults."""

    clipping: str = setting(
        "off",
        _choice(PRIVACY_CLIPPING),
        "central differential privacy (add-or-remove-one client) of the released adapters (docs/privacy.md): `off`, or `fixed` / `adaptive` clipping (Andrew et al.) of each client's LoRA-factor update with Gaussian noise on their sum over a fixed n; needs `num-clients`; fedavg, fixed and fedtops with `strategy.aggregator = 'fedavg'`",
    )
    side: str = setting(
        "server",
        _choice(PRIVACY_SIDES),
        "where updates are clipped: `server`, or `client` (the ClientApp's clipping mod; the server clips again at C, and under adaptive clipping leaves out a reply whose norm bit its update's norm contradicts)",
    )
    clip_norm: float = setting(
        1.0,
        _float(0.0, strict=True),
        "C, the L2 bound of one client's update θ_i − θ_t over all LoRA factors (adaptive: the first round's C); the noise on the mean has std noise-multiplier × C / n, n the clients a round asks when `num-clients` are connected",
    )
    noise_multiplier: float = setting(
        1.0,
        _float(0.0, strict=False),
        "z, the Gaussian noise multiplier of the update (adaptive: of the update and the centred clipped count together, z⁻² = z_Δ⁻² + (2σ_b)⁻²); 0 = clipping only, ε = ∞",
    )
    target_quantile: float = setting(0.5, _float(0.0, strict=False, hi=1.0), "adaptive clipping: the share of updates meant to fall under C")
    clip_norm_lr: float = setting(
        0.2, _float(0.0, strict=True), "adaptive clipping: C moves by exp(−lr × (noisy unclipped share − target)) per round"
    )
    clipped_count_stddev: float = setting(
        0.0,
        _float(0.0, strict=False),
        "adaptive clipping: σ_b, the noise std on the centred count of unclipped updates; 0 = n/20 (Andrew et al.); it must exceed noise-multiplier / 2",
    )
    score_noise: float = setting(
        1.0,
        _float(0.0, strict=False),
        "FedTOPS: σ_s, the noise multiplier of the score channel: one row per client asked (a fixed public row for one without valid scores), its clipped Ĵ_i(a) and K̂_i(a) with noise of std σ_s·√(2k)·(their range), k candidates; 0 = unprotected scores, ε = ∞",
    )
    teacher_score_max: float = setting(
        1.0, _float(0.0, strict=True), "FedTOPS under privacy: Ĵ_i(a) is clipped to [0, this] (nats per cached position) before its noise"
    )
    change_score_max: float = setting(
        0.1,
        _float(0.0, strict=True),
        "FedTOPS under privacy: K̂_i(a) is clipped to [0, this] before its noise; must exceed `strategy.trust-budget` (values above δ are infeasible anyway)",
    )
    delta: float = setting(
        1e-5,
        (float, lambda v: 0.0 < v < 1.0, "a number > 0 and < 1"),
        "δ_DP at which ε is reported after every round (round record `privacy`, the stream, the summary)",
    )
    max_epsilon: float = setting(
        0.0,
        (float, lambda v: v == 0 or (v > 0 and math.isfinite(v)), "0 (no budget), or a finite number > 0"),
        "a privacy budget: the run stops (status `budget-spent`) before a round whose releases would take ε at `privacy.delta` above this (the tighter of RDP and PLD); 0 = none; may change on resume",
    )


CACHE_SOURCES = ("round", "untrained")  # where a scoring cache's rollouts come from (fedopd.engine.round.RoundPlan.cache_source)


@dataclass(frozen=True)
class CacheSettings:
    rollouts: int = setting(4, _int(1), "scoring cache per client (built only for FedTOPS)")
    positions: int = setting(16, _int(1), "scoring cache per client (built only for FedTOPS)")
    top_k: int = setting(16, _int(1), "scoring cache per client (built only for FedTOPS)")


@dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation inside the round: greedy accuracy and Avg@k / Pass@k."""

    every: int = setting(4, _int(0), "held-out evaluation in rounds 0, every, 2·every, … and the last; 0 = never (paper presets)")
    prompts_per_client: int = setting(32, _int(1), "held-out problems per client")
    samples: int = setting(8, _int(1), "k of Avg@k / Pass@k and the paper's evaluation sampling (greedy accuracy is separate)")
    temperature: float = setting(
        1.0, _float(0.0, strict=True), "k of Avg@k / Pass@k and the paper's evaluation sampling (greedy accuracy is separate)"
    )
    top_p: float = setting(
        0.8, _float(0.0, strict=True, hi=1.0), "k of Avg@k / Pass@k and the paper's evaluation sampling (greedy accuracy is separate)"
    )
    max_new_tokens: int = setting(128, _int(1), "evaluation response cap")
    fraction: float = setting(
        1.0,
        _float(0.0, strict=True, hi=1.0),
        "share of the connected nodes that evaluate in an evaluation round (sampled per round; the aggregate stays `num-examples`-weighted)",
    )


@dataclass(frozen=True)
class TimeoutSettings:
    """How long the server waits for the clients' replies in each phase, in seconds. A client
    that has not answered by then is left out of that phase of the round (recorded in
    ``excluded``); the round goes on with the others."""

    train: float = setting(
        3600.0,
        _float(0.0, strict=True),
        "seconds the server waits for the clients' replies in each phase, and each message's time to live (Flower's TTL: a node that gets it later does not run it); a client that has not answered is left out of that phase of the round (recorded in `excluded`), the round goes on with the others",
    )
    score: float = setting(
        600.0,
        _float(0.0, strict=True),
        "seconds the server waits for the clients' replies in each phase, and each message's time to live (Flower's TTL: a node that gets it later does not run it); a client that has not answered is left out of that phase of the round (recorded in `excluded`), the round goes on with the others",
    )
    evaluate: float = setting(
        3600.0,
        _float(0.0, strict=True),
        "seconds the server waits for the clients' replies in each phase, and each message's time to live (Flower's TTL: a node that gets it later does not run it); a client that has not answered is left out of that phase of the round (recorded in `excluded`), the round goes on with the others",
    )
    start: float = setting(
        3600.0,
        _float(0.0, strict=True),
        "seconds a round waits for the nodes it needs (round 1: `num-clients`; later: `strategy.min-train-clients`) to be connected; then the run fails, saying how many it saw (Flower alone waits forever)",
    )
    skip_after: int = setting(
        2,
        _int(0),
        "a node that did not answer in time (train, score or evaluate) in k = this many of the last 2k rounds it was asked in, consecutive or not, sits out k rounds of sampling and evaluation, then is asked again; set out again before 2k answered rounds clear it, twice as long each time (at most 32k). Recorded as `skipped-node-ids`. 0 = never skip",
    )


WANDB_MODES = ("", "offline", "online")
ARTIFACTS = ("none", "records", "adapters")
_USERINFO_URI = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s@]*@", re.I)


def _plain_text() -> Spec:
    return str, lambda v: "\n" not in v and "\r" not in v, "a string on one line ('': unset)"


def _no_credentials(uri: str) -> bool:
    """No whitespace or control character anywhere (URL parsers drop some), no ``user@`` before the host."""
    from urllib.parse import urlsplit

    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in uri):
        return False
    return not _USERINFO_URI.match(uri) and "@" not in urlsplit(uri).netloc


def _uri_without_credentials() -> Spec:
    return (
        str,
        _no_credentials,
        "'' (unset) or a tracking URI without credentials (they go in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, "
        "never in the run config, which the run folder and the trackers keep)",
    )


@dataclass(frozen=True)
class LoggingSettings:
    tensorboard: bool = setting(
        False,
        _bool(),
        "also write the round scalars, each client's series and the run config (as hyperparameters) as TensorBoard events to the run folder's `tensorboard/` (needs the `tensorboard` package)",
    )
    wandb: bool = setting(
        False,
        _bool(),
        "also send the round scalars and each client's series (step = round), the run config, the run's final status and `logging.artifacts` to Weights & Biases, run name = `logging.run-name`, else the run folder's name; where to: the `logging.wandb-*` keys, else the `WANDB_*` variables, else offline files in the run folder; a tracker that fails is warned about and dropped, the run goes on (needs the `wandb` extra; docs/tracking.md)",
    )
    run_name: str = setting(
        "",
        _plain_text(),
        "the run's name in W&B and MLflow; '': the run folder's name (`python -m eval.variants` sets the variant, its values and the seed)",
    )
    wandb_project: str = setting("", _plain_text(), "W&B project; '': `WANDB_PROJECT`, else `fedtops`")
    wandb_mode: str = setting(
        "",
        _choice(WANDB_MODES),
        "W&B mode: `online` (needs credentials: `WANDB_API_KEY` or `wandb login`), `offline` (files only); '': `WANDB_MODE`, else `offline`",
    )
    wandb_dir: str = setting("", _plain_text(), "where W&B's `wandb/` folder goes; '': `WANDB_DIR`, else the run folder")
    mlflow: bool = setting(
        False,
        _bool(),
        "also send the round scalars and each client's series (step = round), the run config (params), the run's final status and `logging.artifacts` to MLflow, run name = `logging.run-name`, else the run folder's name; where to: the `logging.mlflow-*` keys, else the `MLFLOW_*` variables, else `sqlite:///RUN_FOLDER/mlflow.db`; a tracker that fails is warned about and dropped, the run goes on (needs the `mlflow` extra; docs/tracking.md)",
    )
    mlflow_uri: str = setting(
        "",
        _uri_without_credentials(),
        "MLflow tracking URI (`sqlite:///runs/mlflow.db`, `http://host:5000`); '': `MLFLOW_TRACKING_URI`, else `sqlite:///RUN_FOLDER/mlflow.db`",
    )
    mlflow_experiment: str = setting("", _plain_text(), "MLflow experiment; '': `MLFLOW_EXPERIMENT_NAME`, else `fedtops`")
    artifacts: str = setting(
        "records",
        _choice(ARTIFACTS),
        "what W&B and MLflow also get at the end of the run: `records` (`config.json`, `rounds.jsonl`, `status.json`, `progress.png`), `adapters` (those and every saved adapter), `none`",
    )


@dataclass(frozen=True)
class RunConfig:
    num_server_rounds: int = setting(8, _int(1), "rounds of the run")
    num_clients: int = setting(
        0,
        _int(0),
        "clients in the run; 0 = every node connected when the run starts, n = wait for n nodes before round 1 (set it when deploying). Each round trains the `strategy.fraction-train` share of them",
    )
    seed: int = setting(
        42,
        _int(0),
        "every training random choice (initial adapter, prompt order, sampling, cache rollouts) derives from it, the round and the partition id",
    )
    max_failed_rounds: int = setting(
        3,
        _int(0),
        "the run stops as `failed` when no client returns a valid update in round 1 or in this many consecutive rounds, with the clients' own error messages; 0 = never; no effect under privacy, where the run's length must not depend on who answered (docs/privacy.md)",
    )
    max_held_rounds: int = setting(
        0,
        _int(0),
        "the run stops as `failed` after this many consecutive rounds that held (a = 0: no feasible candidate, or a non-finite adapter), naming the nodes that vetoed a = 1; 0 = never (the paper's rule may hold as long as it needs)",
    )
    output_dir: str = setting("runs", _nonempty(), "where run folders go")
    resume_from: str = setting(
        "",
        (str, lambda v: True, "a run folder to continue, or '' for a new run"),
        'a run folder to continue ([docs/run-folder.md](run-folder.md#resuming-a-stopped-run)); `""` = a new run',
    )
    preset: str = setting("sandbox", _nonempty(), "a label recorded with the run")
    model: ModelSettings = ModelSettings()
    lora: LoraSettings = LoraSettings()
    data: DataSettings = DataSettings()
    rollout: RolloutSettings = RolloutSettings()
    train: TrainSettings = TrainSettings()
    strategy: StrategySettings = StrategySettings()
    cache: CacheSettings = CacheSettings()
    eval: EvalSettings = EvalSettings()
    timeout: TimeoutSettings = TimeoutSettings()
    logging: LoggingSettings = LoggingSettings()
    privacy: PrivacySettings = PrivacySettings()

    def to_run_config(self) -> dict[str, Any]:
        """The flat run-config dict (run-config key names) that this object was parsed from."""
        out: dict[str, Any] = {}
        for key, (path, _) in _KEYS.items():
            value = _get(self, path)
            if key == "strategy.candidates":
                value = ",".join(_fmt_float(a) for a in value)
            out[key] = value
        return out

    @property
    def local_steps_per_round(self) -> int:
        """Optimizer steps one client takes per round."""
        return self.learner_budget(1)[1]

    @property
    def total_local_steps(self) -> int:
        """Optimizer steps one client takes over the whole run (the cosine schedule's length)."""
        return self.learner_budget(1)[2]

    def learner_budget(self, pooled_partitions: int = 1) -> tuple[int, int, int]:
        """(rollouts per round, optimizer steps per round, steps over the run) of one learner on
        the prompts of ``pooled_partitions`` partitions.

        A client learns from its own ``rollout.per-round`` rollouts (1). The Centralized reference
        is one learner on the pooled prompts of all clients (its train message says so) with the
        same total rollouts per round and the same mini-batch, so its sequential depth is the
        clients' combined steps (the paper: 3 x 32 rollouts per round, 600 consecutive steps over
        50 rounds).
        """
        per_round = self.rollout.per_round * pooled_partitions
        steps = math.ceil(per_round / self.train.mini_batch)
        return per_round, steps, steps * self.num_server_rounds


def _schema(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field]]:
    """(attribute path, field) of every run-config key under ``cls``, in declaration order."""
    for f in fields(cls):
        if SPEC in f.metadata:
            yield (*prefix, f.name), f
        elif is_dataclass(f.default):
            yield from _schema(type(f.default), (*prefix, f.name))


def _dashed(path: tuple[str, ...]) -> str:
    return ".".join(part.replace("_", "-") for part in path)


# run-config key -> (attribute path, (type, check, allowed)), and its one line of help (the
# meaning column of docs/configuration.md), from the fields' declarations above
_KEYS: dict[str, tuple[tuple[str, ...], Spec]] = {_dashed(path): (path, f.metadata[SPEC]) for path, f in _schema(RunConfig)}
HELP: dict[str, str] = {_dashed(path): f.metadata[HELP_TEXT] for path, f in _schema(RunConfig)}

RUN_CONFIG_KEYS = tuple(_KEYS)

# Keys that may differ between a run and its resumption: they change no adapter and no record.
# num-server-rounds may grow (the remaining rounds then follow the longer cosine schedule).
RESUME_FREE_KEYS = (
    "num-server-rounds",
    "resume-from",
    "output-dir",
    "timeout.train",
    "timeout.score",
    "timeout.evaluate",
    "timeout.start",
    "logging.tensorboard",
    "logging.wandb",
    "logging.run-name",
    "logging.wandb-project",
    "logging.wandb-mode",
    "logging.wandb-dir",
    "logging.mlflow",
    "logging.mlflow-uri",
    "logging.mlflow-experiment",
    "logging.artifacts",
    "privacy.max-epsilon",  # a resumed run may get more (or less) budget: the journal keeps what was spent
)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def _fmt_float(a: float) -> str:
    return str(int(a)) if float(a).is_integer() else repr(float(a))
