"""The run configuration's shape: one frozen dataclass per key group, with the app's defaults,
and the table of run-config keys with each one's type and allowed values.

Engine code receives the group it needs (``cfg.train``, ``cfg.cache``), never the flat dict.
Parsing a run-config dict into a :class:`RunConfig`, the checks across keys and against the
registries (prompt sets, divergences, strategies), live above every registry in :mod:`fedopd.config`; this module imports
nothing of the project, so every layer may use the settings' types.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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


# Defaults are the sandbox preset, identical to [tool.flwr.app.config] in pyproject.toml (a test
# keeps them equal); the tiny preset and the paper's settings are presets in configs/.


@dataclass(frozen=True)
class ModelSettings:
    student: str = "builtin:sandbox-student"
    teacher: str = "builtin:sandbox-teacher"
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    teacher_batch: int = 4  # sequences per teacher forward (memory beside the student and vLLM)


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
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
    name: str = "sandbox"
    prompts_per_client: int = 256
    max_prompt_tokens: int = 384  # the sandbox models have 512 positions (fedopd.positions); the paper: 2048
    path: str = ""  # math: a local copy of EleutherAI/hendrycks_math ("" = the hub)
    seed: int = 42  # the partition, the prompt pool and the held-out selection; never the training seed
    partitioner: str = "groups"  # PARTITIONERS: groups = the set's own fixed groups (the paper's)
    partition_by: str = "group"  # the column of dirichlet / natural partitioning
    dirichlet_alpha: float = 0.5
    split: str = "train"  # prompts: the split of data.path
    problem_column: str = "problem"  # prompts: the problem text
    answer_column: str = "answer"  # prompts: the gold answer (plain, or a solution with \\boxed{})
    eval_path: str = ""  # prompts: held-out problems ("" = a seeded split of data.path)
    eval_split: str = ""  # the split of eval_path ("" = split)


@dataclass(frozen=True)
class RolloutSettings:
    backend: str = "auto"
    per_round: int = 32
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU
    stop_tokens: str = "auto"  # auto: the student's and the teacher's EOS ids; else comma-separated token strings


@dataclass(frozen=True)
class TrainSettings:
    lr: float = 3e-3
    mini_batch: int = 4
    micro_batch: int = 4
    optimizer_state: str = "persistent"
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    gradient_checkpointing: bool = False  # recompute the student's layer activations in backward
    loss_chunk: int = 256  # positions per chunk of the OPD loss: its peak is ~7 fp32 (chunk × vocabulary) arrays (docs/performance.md)
    packing: str = "auto"  # micro-batches packed (padding-free) or padded; auto: packed with flash-attention 2
    exact_kl: bool = False  # also report kl_before / kl_after over all rollouts (two extra student passes)
    loss: str = "reverse_kl"  # the per-token divergence (fedopd.distill.loss.DIVERGENCES); the paper's reverse KL
    loss_beta: float = 0.5  # β of train.loss = 'jsd' (0 = forward KL, 1 = reverse KL)


@dataclass(frozen=True)
class StrategySettings:
    name: str = "fedtops"
    multiplier: float = -1.0  # UNSET_MULTIPLIER: 'fixed' needs an explicit a >= 0
    candidates: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
    trust_budget: float = 0.05
    fraction_train: float = 1.0  # Flower's fraction_train: the share of connected nodes sampled per round
    min_train_clients: int = 1  # Flower's min_train_nodes: the fewest nodes a round trains
    # Robustness to clients the server does not control (docs/robustness.md); the defaults are the paper's.
    aggregator: str = "fedavg"  # the average under fedavg, fixed and fedtops: Flower's FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum
    trim_fraction: float = 0.2  # trimmed-mean (aggregator and score-aggregate): the share cut at each end
    num_malicious: int = 0  # krum / multikrum: f, the nodes assumed malicious
    clip_norm: float = 0.0  # 0 = off; else each update's norm is at most this × the round's median
    max_weight: float = 0.0  # 0 = off; else each num-examples weight is at most this × the round's median
    max_vetoes: int = 0  # a candidate stays feasible while at most this many clients' K̂ exceed δ (0: the paper's rule)
    score_aggregate: str = "mean"  # Ĵ across clients: the num-examples-weighted mean (the paper's), median, trimmed-mean


@dataclass(frozen=True)
class PrivacySettings:
    """Central differential privacy of the released adapters and FedTOPS's score channel
    (docs/privacy.md). ``clipping = 'off'``: none, and the other keys must keep their defaults."""

    clipping: str = "off"  # off | fixed | adaptive: Flower's DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping
    side: str = "server"  # where updates are clipped: the server, or each client (Flower's clipping mod on the ClientApp)
    clip_norm: float = 1.0  # C: the L2 bound of one client's update in LoRA-factor space (adaptive: the initial C)
    noise_multiplier: float = 1.0  # z: Gaussian noise of std z·C/m on the mean of the m clipped updates
    target_quantile: float = 0.5  # adaptive: the share of updates meant to fall under C
    clip_norm_lr: float = 0.2  # adaptive: the geometric step of C per round
    clipped_count_stddev: float = 0.0  # adaptive: the noise on the count of unclipped updates; 0 = Flower's m/20
    score_noise: float = 1.0  # FedTOPS: the noise multiplier of the score channel (Ĵ_i, K̂_i)
    teacher_score_max: float = 1.0  # FedTOPS: Ĵ_i(a) is clipped to [0, this] (nats per cached position)
    change_score_max: float = 0.1  # FedTOPS: K̂_i(a) is clipped to [0, this]; must exceed strategy.trust-budget
    delta: float = 1e-5  # δ_DP at which ε is reported
    max_epsilon: float = 0.0  # 0 = no budget; else the run stops before a round whose releases would take ε above this


@dataclass(frozen=True)
class CacheSettings:
    rollouts: int = 4
    positions: int = 16
    top_k: int = 16


@dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation inside the round: greedy accuracy and Avg@k / Pass@k."""

    every: int = 4  # 0 = never; else rounds 0, every, 2*every, ... and the last round
    prompts_per_client: int = 32
    samples: int = 8  # k of Avg@k and Pass@k
    temperature: float = 1.0  # the paper's evaluation sampling
    top_p: float = 0.8
    max_new_tokens: int = 128
    fraction: float = 1.0  # share of the connected nodes that evaluate (sampled per evaluation round)


@dataclass(frozen=True)
class TimeoutSettings:
    """How long the server waits for the clients' replies in each phase, in seconds. A client
    that has not answered by then is left out of that phase of the round (recorded in
    ``excluded``); the round goes on with the others."""

    train: float = 3600.0
    score: float = 600.0
    evaluate: float = 3600.0
    start: float = 3600.0  # the longest a round waits for the nodes it needs to be connected; then the run fails
    skip_after: int = 2  # a node that timed out in this many consecutive rounds sits out as many rounds; 0 = never


@dataclass(frozen=True)
class LoggingSettings:
    tensorboard: bool = False  # also write the per-round scalars to <run folder>/tensorboard
    wandb: bool = False  # also send them, the config and the final status to Weights & Biases (WANDB_* env vars)
    mlflow: bool = False  # also send them, the config and the final status to MLflow (MLFLOW_* env vars)


@dataclass(frozen=True)
class RunConfig:
    num_server_rounds: int = 8
    num_clients: int = 0  # 0: every node connected when the run starts
    max_failed_rounds: int = 3  # stop the run (failed) after this many consecutive rounds without a valid update; 0 = never
    max_held_rounds: int = 0  # stop the run (failed) after this many consecutive held rounds (a = 0); 0 = never
    seed: int = 42
    output_dir: str = "runs"
    resume_from: str = ""  # a run folder to continue; "" = a new run
    preset: str = "sandbox"
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


# ---------------------------------------------------------------------------------------------
# The run-config keys: type, check and what is allowed (fedopd.config.parse applies them)
# ---------------------------------------------------------------------------------------------

Check = Callable[[Any], bool]


def _int(lo: int | None = None, hi: int | None = None) -> tuple[type, Check, str]:
    desc = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
    return int, lambda v: (lo is None or v >= lo) and (hi is None or v <= hi), desc


def _float(lo: float, *, strict: bool, hi: float | None = None) -> tuple[type, Check, str]:
    op = ">" if strict else ">="
    desc = f"a finite number {op} {lo}" + (f" and <= {hi}" if hi is not None else "")
    return float, lambda v: math.isfinite(v) and (v > lo if strict else v >= lo) and (hi is None or v <= hi), desc


def _bool() -> tuple[type, Check, str]:
    return bool, lambda v: True, "true or false"


def _choice(options: tuple[str, ...]) -> tuple[type, Check, str]:
    return str, lambda v: v in options, "one of " + ", ".join(repr(o) for o in options)


def _nonempty() -> tuple[type, Check, str]:
    return str, lambda v: bool(v.strip()), "a non-empty string"


# run-config key -> (attribute path, (type, check, allowed))
_KEYS: dict[str, tuple[tuple[str, ...], tuple[type, Check, str]]] = {}


def _key(key: str, path: str, spec: tuple[type, Check, str]) -> None:
    _KEYS[key] = (tuple(path.split(".")), spec)


_key("num-server-rounds", "num_server_rounds", _int(1))
_key("num-clients", "num_clients", _int(0))
_key("seed", "seed", _int(0))
_key("max-failed-rounds", "max_failed_rounds", _int(0))
_key("max-held-rounds", "max_held_rounds", _int(0))
_key("output-dir", "output_dir", _nonempty())
_key("resume-from", "resume_from", (str, lambda v: True, "a run folder to continue, or '' for a new run"))
_key("preset", "preset", _nonempty())
_key("model.student", "model.student", _nonempty())
_key("model.teacher", "model.teacher", _nonempty())
_key("model.dtype", "model.dtype", _choice(DTYPES))
_key("model.teacher-batch", "model.teacher_batch", _int(1))
_key("lora.rank", "lora.rank", _int(1))
_key("lora.alpha", "lora.alpha", _float(0.0, strict=True))
_key("data.name", "data.name", (str, lambda v: bool(v.strip()), "a registered prompt set"))  # fedopd.config checks the registry
_key("data.prompts-per-client", "data.prompts_per_client", _int(1))
_key("data.max-prompt-tokens", "data.max_prompt_tokens", _int(1))
_key("data.path", "data.path", (str, lambda v: True, "a local file or folder, a hub dataset id, or '' for the set's own source"))
_key("data.seed", "data.seed", _int(0))
_key("data.partitioner", "data.partitioner", _choice(PARTITIONERS))
_key("data.partition-by", "data.partition_by", _nonempty())
_key("data.dirichlet-alpha", "data.dirichlet_alpha", _float(0.0, strict=True))
_key("data.split", "data.split", _nonempty())
_key("data.problem-column", "data.problem_column", _nonempty())
_key("data.answer-column", "data.answer_column", _nonempty())
_key("data.eval-path", "data.eval_path", (str, lambda v: True, "a local file or folder, a hub dataset id, or '' for a seeded split of data.path"))
_key("data.eval-split", "data.eval_split", (str, lambda v: True, "a split name, or '' for data.split"))
_key("rollout.backend", "rollout.backend", _choice(BACKENDS))
_key("rollout.per-round", "rollout.per_round", _int(1))
_key("rollout.max-new-tokens", "rollout.max_new_tokens", _int(1))
_key("rollout.temperature", "rollout.temperature", _float(0.0, strict=True))
_key("rollout.top-p", "rollout.top_p", _float(0.0, strict=True, hi=1.0))
_key("rollout.gpu-memory-utilization", "rollout.gpu_memory_utilization", _float(0.0, strict=True, hi=1.0))
_key(
    "rollout.stop-tokens",
    "rollout.stop_tokens",
    (
        str,
        lambda v: v.strip() == "auto" or all(t.strip() for t in v.split(",")),
        "'auto' (the student's and the teacher's EOS ids) or a comma-separated list of token strings, e.g. '<|im_end|>,<|endoftext|>'",
    ),
)
_key("train.lr", "train.lr", _float(0.0, strict=True))
_key("train.mini-batch", "train.mini_batch", _int(1))
_key("train.micro-batch", "train.micro_batch", _int(1))
_key("train.optimizer-state", "train.optimizer_state", _choice(OPTIMIZER_STATES))
_key("train.gradient-checkpointing", "train.gradient_checkpointing", _bool())
_key("train.packing", "train.packing", _choice(PACKING))
_key("train.exact-kl", "train.exact_kl", _bool())
_key("train.loss", "train.loss", (str, lambda v: bool(v.strip()), "a registered divergence"))  # fedopd.config checks the registry
_key("train.loss-beta", "train.loss_beta", _float(0.0, strict=False, hi=1.0))
_key("strategy.name", "strategy.name", (str, lambda v: bool(v.strip()), "a registered strategy"))  # fedopd.config checks the registry
_key(
    "strategy.multiplier",
    "strategy.multiplier",
    (float, lambda v: math.isfinite(v) and (v >= 0 or v == UNSET_MULTIPLIER), "a finite number >= 0 (the multiplier a of 'fixed'), or -1 = not set"),
)
_key(
    "strategy.candidates",
    "strategy.candidates",
    (str, lambda v: True, "a comma-separated list of distinct finite numbers >= 0, e.g. '0.5,1,2,3,5,10'"),
)
_key("strategy.trust-budget", "strategy.trust_budget", (float, lambda v: v >= 0, "a number >= 0, or inf for no trust constraint (the lowest Ĵ wins)"))
_key("strategy.fraction-train", "strategy.fraction_train", _float(0.0, strict=True, hi=1.0))
_key("strategy.min-train-clients", "strategy.min_train_clients", _int(1))
_key("strategy.aggregator", "strategy.aggregator", _choice(AGGREGATORS))
_key("strategy.trim-fraction", "strategy.trim_fraction", (float, lambda v: 0.0 <= v < 0.5, "a number >= 0 and < 0.5"))
_key("strategy.num-malicious", "strategy.num_malicious", _int(0))
_key(
    "strategy.clip-norm",
    "strategy.clip_norm",
    (float, lambda v: v == 0 or (math.isfinite(v) and v >= 1), "0 (off), or a finite number >= 1 (a multiple of the round's median update norm)"),
)
_key(
    "strategy.max-weight",
    "strategy.max_weight",
    (float, lambda v: v == 0 or (math.isfinite(v) and v >= 1), "0 (off), or a finite number >= 1 (a multiple of the round's median num-examples)"),
)
_key("strategy.max-vetoes", "strategy.max_vetoes", _int(0))
_key("strategy.score-aggregate", "strategy.score_aggregate", _choice(SCORE_AGGREGATES))
_key("cache.rollouts", "cache.rollouts", _int(1))
_key("cache.positions", "cache.positions", _int(1))
_key("cache.top-k", "cache.top_k", _int(1))
_key("eval.every", "eval.every", _int(0))
_key("eval.prompts-per-client", "eval.prompts_per_client", _int(1))
_key("eval.samples", "eval.samples", _int(1))
_key("eval.temperature", "eval.temperature", _float(0.0, strict=True))
_key("eval.top-p", "eval.top_p", _float(0.0, strict=True, hi=1.0))
_key("eval.max-new-tokens", "eval.max_new_tokens", _int(1))
_key("eval.fraction", "eval.fraction", _float(0.0, strict=True, hi=1.0))
_key("timeout.train", "timeout.train", _float(0.0, strict=True))
_key("timeout.score", "timeout.score", _float(0.0, strict=True))
_key("timeout.evaluate", "timeout.evaluate", _float(0.0, strict=True))
_key("timeout.start", "timeout.start", _float(0.0, strict=True))
_key("timeout.skip-after", "timeout.skip_after", _int(0))
_key("logging.tensorboard", "logging.tensorboard", _bool())
_key("logging.wandb", "logging.wandb", _bool())
_key("logging.mlflow", "logging.mlflow", _bool())
_key("privacy.clipping", "privacy.clipping", _choice(PRIVACY_CLIPPING))
_key("privacy.side", "privacy.side", _choice(PRIVACY_SIDES))
_key("privacy.clip-norm", "privacy.clip_norm", _float(0.0, strict=True))
_key("privacy.noise-multiplier", "privacy.noise_multiplier", _float(0.0, strict=False))
_key("privacy.target-quantile", "privacy.target_quantile", _float(0.0, strict=False, hi=1.0))
_key("privacy.clip-norm-lr", "privacy.clip_norm_lr", _float(0.0, strict=True))
_key("privacy.clipped-count-stddev", "privacy.clipped_count_stddev", _float(0.0, strict=False))
_key("privacy.score-noise", "privacy.score_noise", _float(0.0, strict=False))
_key("privacy.teacher-score-max", "privacy.teacher_score_max", _float(0.0, strict=True))
_key("privacy.change-score-max", "privacy.change_score_max", _float(0.0, strict=True))
_key("privacy.delta", "privacy.delta", (float, lambda v: 0.0 < v < 1.0, "a number > 0 and < 1"))
_key("privacy.max-epsilon", "privacy.max_epsilon", (float, lambda v: v == 0 or (v > 0 and math.isfinite(v)), "0 (no budget), or a finite number > 0"))

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
    "logging.mlflow",
    "privacy.max-epsilon",  # a resumed run may get more (or less) budget: the journal keeps what was spent
)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def _fmt_float(a: float) -> str:
    return str(int(a)) if float(a).is_integer() else repr(float(a))
