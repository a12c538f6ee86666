"""Where a model comes from and what it runs on: model names (a hub id, a local folder, or a
built-in model), the device, the compute dtype and the attention implementation."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch

from fedopd.core.errors import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


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


def attention_implementation(device: torch.device) -> str:
    """flash-attention 2 when it is importable and a GPU is used, else PyTorch SDPA."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
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
    if name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        raise ModelLoadError(
            f"model '{name}' is not an existing local folder, a hub id of the form 'org/name', or one of {', '.join(BUILTIN_MODELS)}"
        )
    return name
