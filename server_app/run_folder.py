"""The run folder (SPEC §4): ``config.json``, ``rounds.jsonl`` and ``round-NNN/`` PEFT adapters.

One folder per run under ``output-dir``; an existing folder is never reused or overwritten.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fedopd.config import RunConfig
from fedopd.models import save_adapter


def _jsonable(value: Any) -> Any:
    """JSON without NaN/Infinity literals: non-finite floats become strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def new_run_dir(output_dir: str | Path, label: str) -> Path:
    """A fresh folder ``output_dir/<YYYYmmdd-HHMMSS>-<label>[-k]``."""
    root = Path(output_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = root / (f"{stamp}-{label}" + (f"-{k}" if k else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a new run folder under {root}")


class RunFolder:
    """Writes one run's files as the run goes."""

    def __init__(self, path: Path, cfg: RunConfig, lora_config) -> None:
        self.path = path
        self.lora_config = lora_config
        (path / "config.json").write_text(json.dumps(cfg.to_run_config(), indent=2, sort_keys=True) + "\n")

    def adapter_dir(self, server_round: int, client: int | None = None) -> Path:
        """``round-NNN/`` (global adapter) or ``round-NNN/client-<partition-id>/`` (Local)."""
        path = self.path / f"round-{server_round:03d}"
        return path if client is None else path / f"client-{client}"

    def save_adapter(self, server_round: int, arrays: Mapping[str, np.ndarray], client: int | None = None) -> Path:
        return save_adapter(self.adapter_dir(server_round, client), arrays, self.lora_config)

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.path / "rounds.jsonl", "a") as f:
            f.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    """The records of a run folder's ``rounds.jsonl``."""
    with open(Path(path) / "rounds.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
