"""Where a model comes from and what it runs on: model names (a hub id, a local folder, or a
built-in model), the device, the compute dtype and the attention implementation."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import re
from pathlib import Path

import torch

from fedopd.core.errors import ModelLoadError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # org/name, as the hub spells them


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is written as a hub id ``org/name`` (the file system is not read)."""
    return HUB_ID.fullmatch(name) is not None


# ---------------------------------------------------------------------------------------------
# Devices, dtypes, names
# ---------------------------------------------------------------------------------------------


DEVICE_VARIABLE = "FEDTOPS_DEVICE"


def default_device() -> torch.device:
    """The device models load on when none is given: ``$FEDTOPS_DEVICE`` where it is set (``cpu``,
    ``cuda``, ``cuda:N``; empty or ``auto``: as if unset), else CUDA where a device is available,
    else the CPU.

    Read at every call, so it reaches every process that inherits the environment (``flwr run``'s
    SuperLink and simulation, Ray workers, SuperNodes). ``model.dtype = auto`` follows the device
    (:func:`resolve_dtype`) and so does ``rollout.backend = auto`` (vLLM only for a student on
    CUDA), so ``FEDTOPS_DEVICE=cpu`` runs everything in fp32 on the CPU of a GPU host; the test suite
    sets it (tests/conftest.py). A value that names no usable device raises :class:`ModelLoadError`.
    """
    name = os.environ.get(DEVICE_VARIABLE, "").strip().lower()
    if name in ("", "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"{DEVICE_VARIABLE}={name!r} is not a device; allowed: 'cpu', 'cuda', 'cuda:N', 'auto'")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ModelLoadError(f"{DEVICE_VARIABLE}={name!r}, but this host has {count} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on GPU, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _flash_attn_2_declared() -> bool:
    """transformers' own check: the flash-attn package (>= 2.3.3) is installed and torch has CUDA.
    It reads package metadata only; an extension built against another torch passes it."""
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


@functools.lru_cache(maxsize=1)
def flash_attention_status() -> tuple[bool, str]:
    """Whether flash-attention 2 can run in this process, and a line saying why (not).

    transformers' check of the package first, then an import of the compiled extension itself
    (``flash_attn_2_cuda``, and the functions transformers calls), which a flash-attn built
    against another torch or CUDA fails ("undefined symbol ..."): such a build is not used, and the
    line carries the import's error. Cached: an extension is loaded once per process.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn is not installed"
    if not _flash_attn_2_declared():
        return False, "flash-attn is installed but transformers cannot use it here (no CUDA torch, or a version below 2.3.3)"
    try:
        importlib.import_module("flash_attn_2_cuda")
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401 - what transformers imports
    except Exception as error:  # noqa: BLE001 - an ABI mismatch raises ImportError, a missing library OSError
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return False, f"flash-attn is installed but its compiled extension does not load ({type(error).__name__}: {first[:300]})"
    return True, "flash-attn's compiled extension loads"


_FLASH_WARNED: set[str] = set()


def attention_implementation(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """flash-attention 2 on a GPU in 16-bit (its kernels take fp16 and bf16 only) when its compiled
    extension loads (:func:`flash_attention_status`), else PyTorch SDPA; an installed flash-attn
    that does not load is warned about once, naming why. ``dtype`` None: the device's ``auto``."""
    dtype = dtype if dtype is not None else resolve_dtype("auto", device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    usable, why = flash_attention_status()
    if usable:
        return "flash_attention_2"
    if importlib.util.find_spec("flash_attn") is not None and why not in _FLASH_WARNED:
        _FLASH_WARNED.add(why)
        logging.getLogger("fedopd").warning("%s; using PyTorch SDPA attention instead (docs/install.md#flash-attention)", why)
    return "sdpa"


BUILTIN_MODELS = ("builtin:sandbox-student", "builtin:sandbox-teacher", "builtin:tiny-student", "builtin:tiny-teacher")


def resolve_model_path(name: str) -> str:
    """A local folder, a hub id, or a built-in model (:data:`BUILTIN_MODELS`).

    ``builtin:sandbox-*`` are the trained sandbox models shipped in the package
    (:mod:`fedopd.sandbox`); ``builtin:tiny-*`` are random tiny models built on first use
    (:mod:`fedopd.sandbox.tiny`). Raises :class:`ModelLoadError` for a name that is none of these,
    before anything is loaded.
    """
    if name.startswith("builtin:"):
        from fedopd.sandbox import SANDBOX_MODELS, sandbox_model_path
        from fedopd.sandbox.tiny import builtin_model_path

        short = name.removeprefix("builtin:")
        if short in SANDBOX_MODELS:
            return str(sandbox_model_path(short))
        if f"builtin:{short}" not in BUILTIN_MODELS:
            raise ModelLoadError(f"unknown built-in model '{name}'; allowed: {', '.join(BUILTIN_MODELS)}")
        return str(builtin_model_path(short))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model path '{name}' exists but has no config.json: not a transformers model folder")
        return str(path)
    if name.startswith((".", "/", "~")) or not is_hub_id(name):
        raise ModelLoadError(
            f"model '{name}' is not an existing local folder, a hub id of the form 'org/name', or one of {', '.join(BUILTIN_MODELS)}"
        )
    return name
