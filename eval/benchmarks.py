"""The six evaluation benchmarks: hub datasets by their usual ids, or local JSONL files.

A benchmark is a list of rows ``{"problem": str, "answer": str}``. On an offline machine put a
file ``<name>.jsonl`` (one such object per line) in a folder and pass it as ``data_dir``; a row may
also use ``question`` for the problem or ``final_answer`` for the answer, and an answer written as
``\\boxed{…}`` is unwrapped.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from fedopd.data.grading import last_boxed


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    hub_id: str
    split: str
    expected: tuple[int, ...]  # problem counts we expect from the hub version
    config: str | None = None


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("math500", "MATH500", "HuggingFaceH4/MATH-500", "test", (500,)),
        Benchmark("amc23", "AMC23", "math-ai/amc23", "test", (40,)),
        Benchmark("minerva", "Minerva", "math-ai/minervamath", "test", (272,)),
        Benchmark("olympiadbench", "OlympiadBench", "math-ai/olympiadbench", "test", (674, 675)),
        Benchmark("aime24", "AIME24", "HuggingFaceH4/aime_2024", "train", (30,)),
        Benchmark("aime25", "AIME25", "math-ai/aime25", "test", (30,)),
    )
}
PAPER_ORDER = tuple(BENCHMARKS)

_PROBLEM_COLUMNS = ("problem", "question", "Problem", "Question")
_ANSWER_COLUMNS = ("answer", "final_answer", "Answer", "solution")


def normalize_row(row: dict, source: str) -> dict:
    """``{"problem", "answer"}`` from a row with any of the usual column names."""
    problem = next((row[c] for c in _PROBLEM_COLUMNS if c in row and row[c] is not None), None)
    answer = next((row[c] for c in _ANSWER_COLUMNS if c in row and row[c] is not None), None)
    if problem is None or answer is None:
        raise ValueError(
            f"{source}: a row needs a problem ({'/'.join(_PROBLEM_COLUMNS)}) and an answer ({'/'.join(_ANSWER_COLUMNS)}); got keys {sorted(row)}"
        )
    if isinstance(answer, (list, tuple)):
        answer = ", ".join(str(a) for a in answer)
    answer = str(answer)
    boxed = last_boxed(answer)
    return {"problem": str(problem), "answer": boxed if boxed is not None else answer.strip()}


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file '{path}' does not exist")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(normalize_row(json.loads(line), f"{path}:{n}"))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON object ({err})") from None
    if not rows:
        raise ValueError(f"benchmark file '{path}' has no rows")
    return rows


class BenchmarkUnavailable(ValueError):
    """A hub benchmark that cannot be loaded here; the message names the offline options."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within ``timeout`` seconds (and
    offline mode is not set)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _go_offline() -> None:
    """Offline mode for ``datasets`` and ``huggingface_hub``: the variables, and the flags they
    read them into at import if they are already imported."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, names in (("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")), ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        if module in sys.modules:
            for name in names:
                setattr(sys.modules[module], name, True)


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """Rows of benchmark ``name``: from ``data_dir/<name>.jsonl`` if given, else from the hub."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; allowed: {', '.join(BENCHMARKS)}")
    if data_dir is not None:
        return read_jsonl(Path(data_dir) / f"{name}.jsonl")
    spec = BENCHMARKS[name]
    offline_hint = (
        f'offline, put {name}.jsonl (one {{"problem": ..., "answer": ...}} per line) in a folder and pass '
        f"--data-dir FOLDER, or pass --benchmark-file {name}=PATH"
    )
    reachable = hub_reachable()
    if not reachable:
        # Without this, datasets retries for about 25 s before failing. Offline mode still
        # serves a copy in the local datasets cache, if there is one.
        _go_offline()
    from datasets import load_dataset

    try:
        data = load_dataset(spec.hub_id, spec.config, split=spec.split)
    except Exception as err:  # noqa: BLE001 - datasets raises many types; all mean "not available here"
        reason = (
            f"{type(err).__name__}: {err}"
            if reachable
            else "the Hugging Face Hub is not reachable (or offline mode is set) and no cached copy exists"
        )
        raise BenchmarkUnavailable(f"benchmark {name!r} ({spec.hub_id}) could not be loaded: {reason}; {offline_hint}") from None
    rows = [normalize_row(dict(r), spec.hub_id) for r in data]
    if len(rows) not in spec.expected:
        import warnings

        warnings.warn(f"{spec.hub_id} has {len(rows)} problems; expected {' or '.join(map(str, spec.expected))}", stacklevel=2)
    return rows
