"""Check a host in seconds before a multi-hour run: ``python -m fedopd.preflight [PRESET.toml] [--run-config ...]``.

Loads no weights: it reads the run config, the models' tokenizers and configs, and their
safetensors headers. It checks, in order:

1. the run config (as ``flwr run`` would receive it, over the app's defaults);
2. that both models resolve (a local folder, the hub cache, or a reachable hub);
3. that the pair is compatible (one vocabulary; logit rows cover the tokenizer);
4. that the chat template renders the paper's prompt with ``enable_thinking=False`` and that the
   token ending an assistant turn is in the stop set; that the teacher's template renders the
   prompt as the student's does (:mod:`fedopd.engine.templates`: a different generation prompt fails);
5. the resolved stop set (``rollout.stop-tokens``);
6. how many prompts per client survive the ``data.max-prompt-tokens`` filter, and whether the
   longest prompt plus the longest response fits both models' positions (:mod:`fedopd.models.positions`);
7. torch's version and CUDA build against the NVIDIA driver (a driver too old for that CUDA fails),
   whether vLLM, flash-attention (its compiled extension loads) and CUDA are present, which engine ``rollout.backend = auto``
   picks, and whether packed micro-batches stay isolated under this host's attention;
8. an estimate of GPU memory against the card's free memory: what stays for the whole round
   (teacher, HF student with LoRA and AdamW, vLLM's share and its engine process, the teacher's
   kept hidden states, CUDA context) plus the largest of the round's phases (HF generation's KV
   cache, the teacher pass, the scoring pass, local OPD's loss chunk and activations) (``--gpu-free-gib`` simulates a card, e.g. to plan for another host).

It prints one table and exits 1 on any problem; each failing row names the fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedopd.config import ConfigError, RunConfig, check_server_requirements, parse_run_config
from fedopd.config.presets import add_run_config_option, app_defaults, load_preset, overrides_from_args
from fedopd.core.errors import ModelLoadError
from fedopd.models.head import HEAD_BLOCK_BYTES
from fedopd.rollout.hf import BATCH as HF_BATCH

GIB = 1024**3
OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
# Bytes per parameter of the compute dtype on a GPU (model.dtype = auto is bf16 there).
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
# fp32 (positions x vocabulary) arrays alive at the peak of one chunk of the reverse-KL loss: the
# student's and teacher's logits, their log-softmaxes, the student's probabilities and the
# gradient. Measured (benchmarks/opd_training.py, bf16 on CPU, student 1,024 / teacher 4,096 wide,
# V = 151,936, 1,024 positions): 4.18 GiB with chunks of 1,024 and 1.17 GiB with chunks of 256,
# each 7.0-7.2 such arrays beside the head's two 64 MiB upcast blocks.
LOSS_CHUNK_ARRAYS = 7
# Activation bytes per token, per layer and per unit of hidden size kept for the backward pass of a
# 16-bit transformer layer with a fused attention kernel: 34 (Korthikanti et al., "Reducing
# Activation Recomputation in Large Transformer Models", 2022, eq. 1 without the attention-score
# term that flash/SDPA kernels do not store). With gradient checkpointing a layer keeps only its
# 16-bit input (2 bytes) and one layer at a time is recomputed in full.
ACTIVATION_BYTES, CHECKPOINTED_BYTES = 34, 2
CUDA_CONTEXT_GIB = 0.75  # CUDA context and allocator slack per process


@dataclass
class Row:
    check: str
    status: str
    detail: str


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, check: str, status: str, detail: str) -> None:
        self.rows.append(Row(check, status, detail))

    @property
    def failed(self) -> bool:
        return any(r.status == FAIL for r in self.rows)

    def table(self) -> str:
        width = max(len(r.check) for r in self.rows)
        lines = [f"{'check'.ljust(width)}  status  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{r.check.ljust(width)}  {r.status.ljust(6)}  {r.detail}" for r in self.rows]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Models without weights
# ---------------------------------------------------------------------------------------------


def locate_model(name: str, *, hub_timeout: float = 5.0) -> tuple[str, str]:
    """(where the model's files are, how they were found): a local folder, the hub cache, or the hub.

    Raises :class:`ModelLoadError` naming the fix when none has it.
    """
    from fedopd.models.paths import resolve_model_path

    path = resolve_model_path(name)
    if Path(path).is_dir():
        return path, "local folder" if not name.startswith("builtin:") else "built-in"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    if isinstance(cached, str):
        return path, "hub cache"
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(path, timeout=hub_timeout)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo or gated: all mean "not reachable"
        raise ModelLoadError(
            f"'{name}' is neither a local folder nor in the hub cache, and the hub does not answer "
            f"({type(err).__name__}); download it first (hf download {name}, huggingface_hub's command) or give a local folder"
        ) from None
    return path, "hub (not cached yet: the first run downloads it)"


def weight_parameters(path: str) -> int | None:
    """Parameters of a local model folder from its safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    total = 0
    for name in files:
        if not (folder / name).is_file():
            return None
        with safe_open(str(folder / name), framework="numpy") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def estimated_parameters(config) -> int:
    """A decoder-only model's parameters from its config, where no weights are on disk yet."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * config.intermediate_size
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp) + embeddings


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def memory_estimate(
    cfg: RunConfig, student_config, teacher_config, student_params: int, teacher_params: int, total_gib: float, backend: str
) -> dict[str, float]:
    """GiB per item on one client's GPU: the terms of the docstring's item 8, resident ones first
    (:data:`RESIDENT`), then what each phase of a round adds while it runs (:data:`PHASES`):
    :func:`memory_need` adds the resident terms and the largest phase."""
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    # LoRA factors r x (in + out) per target module and layer, bounded by the widest projection;
    # fp32 weights, gradients and AdamW's two moments.
    lora = (
        cfg.lora.rank
        * (student_config.hidden_size + student_config.intermediate_size)
        * len(cfg.lora.target_modules)
        * student_config.num_hidden_layers
    )
    sequence = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = cfg.train.micro_batch * sequence
    h, layers = student_config.hidden_size, student_config.num_hidden_layers
    if cfg.train.gradient_checkpointing:
        activations = tokens * h * (layers * CHECKPOINTED_BYTES + ACTIVATION_BYTES)
    else:
        activations = tokens * h * layers * ACTIVATION_BYTES
    teacher_tokens = cfg.model.teacher_batch * sequence
    # HF generation (rollout.backend = hf; vLLM's cache is inside its share): generate's key and
    # value cache of one batch of rollouts, every prompt at data.max-prompt-tokens and every
    # response at the cap, in the compute dtype.
    kv_heads = getattr(student_config, "num_key_value_heads", None) or student_config.num_attention_heads
    head_dim = getattr(student_config, "head_dim", None) or h // student_config.num_attention_heads
    hf_kv = min(cfg.rollout.per_round, HF_BATCH) * sequence * layers * 2 * kv_heads * head_dim * dtype_bytes if backend == "hf" else 0
    vocab = min(student_config.vocab_size, teacher_config.vocab_size)
    # The scoring pass (FedTOPS): every candidate's copy of the cached rollouts in one no-grad
    # forward, one layer's projections alive at a time (q, k, v, o and the MLP's gate, up and
    # product), and the fp32 logits at the cached positions with their coarse copy.
    scoring = 0.0
    if cfg.strategy.name == "fedtops":
        candidates = len(cfg.strategy.candidates)
        rows = cfg.cache.rollouts * candidates
        layer = (4 * h + 3 * student_config.intermediate_size) * dtype_bytes
        scoring = rows * sequence * layer + 2 * cfg.cache.rollouts * cfg.cache.positions * candidates * vocab * 4
    return {
        "teacher weights": teacher_params * dtype_bytes / GIB,
        "student weights + LoRA + AdamW": (student_params * dtype_bytes + lora * 4 * 4) / GIB,
        "vLLM share": cfg.rollout.gpu_memory_utilization * total_gib if backend == "vllm" else 0.0,
        # vLLM's engine process: its CUDA context is not in its share (vLLM measures the share's
        # use from a baseline taken after the context exists).
        "vLLM engine process": CUDA_CONTEXT_GIB if backend == "vllm" else 0.0,
        # The teacher's hidden states at every response position of the round, kept from the
        # teacher pass to the end of local OPD (every response at the cap).
        "kept teacher hidden states": cfg.rollout.per_round * cfg.rollout.max_new_tokens * teacher_config.hidden_size * dtype_bytes / GIB,
        "CUDA context": CUDA_CONTEXT_GIB,
        # phases
        "HF KV cache": hf_kv / GIB,
        "teacher pass": teacher_tokens * teacher_config.hidden_size * ACTIVATION_BYTES / GIB,
        "scoring pass": scoring / GIB,
        "loss chunk": (LOSS_CHUNK_ARRAYS * min(cfg.train.loss_chunk, tokens) * vocab * 4 + 2 * HEAD_BLOCK_BYTES) / GIB,
        "student activations": activations / GIB,
    }


RESIDENT = ("teacher weights", "student weights + LoRA + AdamW", "vLLM share", "vLLM engine process", "kept teacher hidden states", "CUDA context")
PHASES = {
    "HF generation": ("HF KV cache",),
    "teacher pass": ("teacher pass",),
    "scoring pass": ("scoring pass",),
    "local OPD": ("loss chunk", "student activations"),
}


def memory_need(parts: dict[str, float]) -> tuple[float, str]:
    """(GiB, the phase at the peak): the resident terms plus the largest phase's."""
    phase = max(PHASES, key=lambda name: sum(parts[k] for k in PHASES[name]))
    return sum(parts[k] for k in RESIDENT) + sum(parts[k] for k in PHASES[phase]), phase


def gpu_memory(simulated_free_gib: float | None) -> tuple[float, float] | None:
    """(free, total) GiB of the first CUDA device, the simulated card, or None without a GPU."""
    if simulated_free_gib is not None:
        return simulated_free_gib, simulated_free_gib
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return free / GIB, total / GIB


# ---------------------------------------------------------------------------------------------
# torch's build and the NVIDIA driver
# ---------------------------------------------------------------------------------------------

# The oldest Linux driver branch each CUDA major runs on (NVIDIA, "CUDA Compatibility", minor version
# compatibility: CUDA 13.x >= 580, 12.x >= 525, 11.x >= 450). PyPI's torch 2.13.0 (and vLLM 0.32's)
# is a CUDA 13.0 build.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def nvidia_driver(version_file: Path = DRIVER_VERSION_FILE) -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.65.06"), or None where none is loaded.

    Read from the kernel module's own file, which exists whenever the driver is loaded, also when
    torch cannot use it; else from ``nvidia-smi``.
    """
    import re
    import shutil
    import subprocess

    try:
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", version_file.read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            if re.fullmatch(r"\d+\.\d+(\.\d+)?", first):
                return first
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def torch_build_row(
    torch_version: str, torch_cuda: str | None, driver: str | None, cuda_available: bool, *, cpu_pinned: bool = False
) -> tuple[str, str]:
    """(status, detail) of torch's build against this host's NVIDIA driver.

    OK whenever a CUDA torch sees a device (a forward-compatibility package can run a newer CUDA
    on an older driver). FAIL when a GPU's driver is present but too old for torch's CUDA major
    (:data:`MIN_DRIVER`), or when torch sees no GPU beside a driver; WARN for a CPU build of torch
    beside a driver.
    A student pinned to the CPU (``FEDTOPS_DEVICE=cpu``) turns both FAILs into WARNs.
    """
    build = f"CUDA {torch_cuda} build" if torch_cuda else "CPU build"
    head = f"torch {torch_version} ({build}), NVIDIA driver {driver or 'not found'}"
    bad = WARN if cpu_pinned else FAIL
    if torch_cuda is not None and cuda_available:
        return OK, head  # torch runs CUDA here, whichever driver (forward-compatibility packages included)
    if driver is None:
        return OK, head + ("" if torch_cuda is None else "; torch sees no GPU: runs on the CPU")
    if torch_cuda is None:
        return WARN, (
            f"{head}: a GPU is present but this torch cannot use it; install a CUDA build into a new virtual environment "
            "(scripts/install.sh gpu, docs/install.md)"
        )
    major, driver_major = int(torch_cuda.split(".")[0]), int(driver.split(".")[0])
    need = MIN_DRIVER.get(major)
    if need is not None and driver_major < need:
        fits = max((m for m, d in MIN_DRIVER.items() if driver_major >= d), default=None)
        other = f", or install a torch for CUDA {fits}.x (TORCH_BACKEND=auto scripts/install.sh gpu)" if fits else ""
        return bad, f"{head}: the driver is too old for CUDA {torch_cuda} (needs >= {need}); update the driver{other}, docs/install.md"
    return bad, f"{head}: torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and `nvidia-smi`)"


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def _guard(report: Report, check: str, fn: Callable[[], Any]) -> Any:
    """Run one check; an exception becomes its FAIL row (its message names the fix)."""
    try:
        return fn()
    except (ConfigError, ModelLoadError, ValueError, FileNotFoundError, OSError) as err:
        report.add(check, FAIL, str(err))
        return None


def _host_checks(report: Report, cfg: RunConfig, gpu_free_gib: float | None) -> str:
    """The rows that need only the run config and this host: torch against the driver, the engines
    (and which one ``rollout.backend`` picks), packing under this host's attention; the rollout
    engine chosen."""
    import torch

    from fedopd.models.paths import DEVICE_VARIABLE, default_device, flash_attention_status
    from fedopd.rollout.vllm_engine import vllm_platform

    cuda = torch.cuda.is_available()
    status, detail = torch_build_row(
        torch.__version__, torch.version.cuda, nvidia_driver(), cuda, cpu_pinned=os.environ.get(DEVICE_VARIABLE, "").strip() == "cpu"
    )
    report.add("torch", status, detail)
    platform = vllm_platform()
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_flash, flash_why = flash_attention_status() if cuda else (False, "")
    backend = cfg.rollout.backend
    # auto: vLLM only for a student on CUDA (FEDTOPS_DEVICE=cpu keeps it on HF), as fedopd.rollout.resolve_backend
    on_cuda = default_device().type == "cuda"
    chosen = "vllm" if (backend == "vllm" and platform) or (backend == "auto" and platform == "cuda" and on_cuda) else "hf"
    if gpu_free_gib is not None and backend == "auto" and has_vllm:
        chosen = "vllm"
    vllm = "no" if not has_vllm else "yes (CPU build)" if platform == "cpu" else "yes"
    flash = "yes" if has_flash else f"no ({flash_why})" if importlib.util.find_spec("flash_attn") is not None and cuda else "no"
    engines = f"CUDA {'yes' if cuda else 'no'}, vLLM {vllm}, flash-attention {flash}"
    if backend == "vllm" and platform is None:
        report.add(
            "engines", FAIL, f"{engines}: rollout.backend = 'vllm' needs vLLM and a CUDA GPU, or vLLM's CPU build; install one or use 'auto'/'hf'"
        )
    else:
        report.add(
            "engines",
            OK if cuda or backend == "hf" else WARN,
            f"{engines}; rollout.backend = {backend!r} uses {chosen}" + ("" if cuda else " (CPU: a paper-size run is not practical)"),
        )

    from fedopd.distill.opd import packed_rows_isolated
    from fedopd.models import attention_implementation, default_device
    from fedopd.models.paths import resolve_dtype

    attention = attention_implementation(default_device(), resolve_dtype(cfg.model.dtype, default_device()))
    if cfg.train.packing == "packed":
        isolated, why = packed_rows_isolated(attention)
        report.add(
            "packing", OK if isolated else FAIL, why if isolated else f"{why}; use train.packing = 'padded' or 'auto', or upgrade torch/transformers"
        )
    else:
        packed = cfg.train.packing == "auto" and attention.startswith("flash_attention")
        report.add("packing", OK, f"train.packing = {cfg.train.packing!r}: {'packed' if packed else 'padded'} micro-batches under {attention}")
    return chosen


MODEL_CHECKS = (  # the rows that need the models' files, and what each needs
    ("model pair", "both models' tokenizers and configs"),
    ("stop tokens", "both models' tokenizers and generation configs"),
    ("chat template", "the student's tokenizer and chat template"),
    ("template pair", "both models' chat templates"),
    ("prompts", "the student's tokenizer"),
    ("positions", "both models' configs"),
)


def run_checks(overrides: dict[str, Any], *, num_clients: int | None = None, gpu_free_gib: float | None = None) -> Report:
    from fedopd.models.vocab import ModelFiles, check_same_vocabulary, end_of_turn_token, resolve_stop_tokens

    report = Report()

    def config():
        cfg = parse_run_config({**app_defaults(), **overrides})
        check_server_requirements(cfg)
        report.add("run config", OK, f"preset '{cfg.preset}', strategy '{cfg.strategy.name}', {cfg.num_server_rounds} rounds")
        return cfg

    cfg = _guard(report, "run config", config)
    if cfg is None:
        return report

    files, paths = {}, {}
    for role, name in (("student", cfg.model.student), ("teacher", cfg.model.teacher)):

        def find(role=role, name=name):
            path, how = locate_model(name)
            files[role] = ModelFiles.load(name)
            paths[role] = path
            report.add(f"{role} model", OK, f"{name} ({how})")

        _guard(report, f"{role} model", find)
    if len(files) < 2:
        for check, need in MODEL_CHECKS:
            report.add(check, SKIP, f"not checked: needs {need} (the model rows above say how to get them)")
        _host_checks(report, cfg, gpu_free_gib)
        report.add("GPU memory", SKIP, "not checked: needs both models' configs (the model rows above say how to get them)")
        return report
    student, teacher = files["student"], files["teacher"]

    def pair():
        check_same_vocabulary(student, teacher)
        width = len(student.tokenizer)
        rows = {r: getattr(files[r].config, "vocab_size", width) for r in files}
        if width > min(rows.values()):
            raise ModelLoadError(
                f"the tokenizer has {width} tokens but the models have {rows['student']} / {rows['teacher']} logit rows; choose models of one family"
            )
        padded = f" (logit rows {rows['student']} / {rows['teacher']}, compared on the tokenizer's {width})" if min(rows.values()) > width else ""
        report.add("model pair", OK, f"one vocabulary of {width} tokens{padded}")

    _guard(report, "model pair", pair)

    stop = _guard(report, "stop tokens", lambda: resolve_stop_tokens(cfg.rollout.stop_tokens, student, teacher))
    if stop is not None:
        report.add("stop tokens", OK, f"{list(stop.tokens)} = ids {list(stop.ids)} (rollout.stop-tokens = {cfg.rollout.stop_tokens!r})")

    def template():
        from fedopd.data import render_prompt

        text = render_prompt(student.tokenizer, "What is 1 + 1?")
        end = end_of_turn_token(student.tokenizer)
        if end is None:
            report.add("chat template", WARN, "renders the prompt; no special token ends an assistant turn: check rollout.stop-tokens by hand")
            return
        name = student.tokenizer.convert_ids_to_tokens(end)
        if stop is not None and end not in stop.ids:
            raise ModelLoadError(
                f"an assistant turn ends with {name!r} (id {end}), which is not in the stop set {list(stop.tokens)}: "
                f"responses would run on into a new turn; set rollout.stop-tokens = '{','.join([*stop.tokens, name])}'"
            )
        report.add(
            "chat template",
            OK,
            f"renders the paper's prompt ({len(student.tokenizer(text, add_special_tokens=False)['input_ids'])} tokens, "
            f"enable_thinking=False); a turn ends with {name!r}, in the stop set",
        )

    _guard(report, "chat template", template)

    def templates():
        from fedopd.engine.templates import compare_chat_templates

        check = compare_chat_templates(student, teacher)
        report.add("template pair", check.status, check.message)

    if "student" in files and "teacher" in files and not any(r.check == "model pair" and r.status == FAIL for r in report.rows):
        _guard(report, "template pair", templates)  # token ids compare only within one vocabulary

    clients = num_clients or cfg.num_clients or 3

    def prompts():
        from fedopd.data import partition_rows, render_prompt

        counts = []
        for pid in range(clients):
            rows = partition_rows(cfg.data, pid, clients)
            kept = sum(
                len(student.tokenizer(render_prompt(student.tokenizer, r["problem"]), add_special_tokens=False)["input_ids"])
                <= cfg.data.max_prompt_tokens
                for r in rows
            )
            counts.append((kept, len(rows)))
        empty = [pid for pid, (kept, _) in enumerate(counts) if kept == 0]
        detail = ", ".join(f"client {pid}: {kept}/{total}" for pid, (kept, total) in enumerate(counts))
        if empty:
            raise ValueError(
                f"{detail}: no prompt of client {empty[0]} fits data.max-prompt-tokens = {cfg.data.max_prompt_tokens}; "
                "raise data.max-prompt-tokens or choose shorter prompts"
            )
        short = any(kept < cfg.rollout.per_round for kept, _ in counts)
        report.add(
            "prompts",
            WARN if short else OK,
            f"{detail} within {cfg.data.max_prompt_tokens} tokens"
            + (f" (fewer than rollout.per-round = {cfg.rollout.per_round}: prompts repeat within a round)" if short else ""),
        )

    _guard(report, "prompts", prompts)

    def positions():
        from fedopd.models.positions import check_run_positions, model_positions, needed_positions

        check_run_positions(cfg, student.config, teacher.config)
        need = needed_positions(cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens if cfg.eval.every else 0)
        have = ", ".join(f"{r} {model_positions(files[r].config)[0] or 'undeclared'}" for r in files)
        report.add("positions", OK, f"prompt + response need {need} positions; the models have {have}")

    _guard(report, "positions", positions)

    chosen = _host_checks(report, cfg, gpu_free_gib)

    card = gpu_memory(gpu_free_gib)
    if card is None:
        report.add("GPU memory", SKIP, "no CUDA device (simulate one with --gpu-free-gib)")
        return report
    free, total = card

    def memory():
        params = {}
        for role in files:
            counted = weight_parameters(paths[role]) if Path(paths[role]).is_dir() else None
            params[role] = counted if counted is not None else estimated_parameters(files[role].config)
        parts = memory_estimate(cfg, student.config, teacher.config, params["student"], params["teacher"], total, chosen)
        need, phase = memory_need(parts)
        detail = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v) + f"; peak in {phase} = {need:.1f} GiB of {free:.1f} GiB free"
        if need > free:
            raise ValueError(
                f"{detail}: too little GPU memory; lower rollout.gpu-memory-utilization, train.micro-batch or "
                "rollout.max-new-tokens, turn on train.gradient-checkpointing, or use a larger card"
            )
        report.add("GPU memory", OK, detail)

    _guard(report, "GPU memory", memory)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedopd.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="a TOML file of overrides (e.g. configs/paper-0.6b-1x.toml)")
    add_run_config_option(parser)
    parser.add_argument("--num-clients", type=int, default=None, help="clients to check prompts for (default: num-clients, else 3)")
    parser.add_argument("--gpu-free-gib", type=float, default=None, help="simulate a GPU with this much free memory")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        overrides = load_preset(args.file) if args.file else {}
        if args.run_config:
            overrides.update(overrides_from_args(args.run_config))
    except ConfigError as err:
        print(f"run config  FAIL  {err}")
        return 1
    report = run_checks(overrides, num_clients=args.num_clients, gpu_free_gib=args.gpu_free_gib)
    print(report.table())
    print("preflight: " + ("FAILED: fix the rows marked FAIL" if report.failed else "passed"))
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
