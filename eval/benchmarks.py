"""The six evaluation benchmarks: hub datasets by their usual ids, or local JSONL files.

A benchmark is a list of rows ``{"problem": str, "answer": str}``. On an offline machine put a
file ``<name>.jsonl`` (one such object per line) in a folder and pass it as ``data_dir``; a row may
also use ``question`` for the problem or ``final_answer`` for the answer, and an answer written as
``\\boxed{…}`` is unwrapped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedopd.grading import last_boxed


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
        raise ValueError(f"{source}: a row needs a problem ({'/'.join(_PROBLEM_COLUMNS)}) and an answer ({'/'.join(_ANSWER_COLUMNS)}); got keys {sorted(row)}")
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


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """Rows of benchmark ``name``: from ``data_dir/<name>.jsonl`` if given, else from the hub."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; allowed: {', '.join(BENCHMARKS)}")
    if data_dir is not None:
        return read_jsonl(Path(data_dir) / f"{name}.jsonl")
    spec = BENCHMARKS[name]
    from datasets import load_dataset

    data = load_dataset(spec.hub_id, spec.config, split=spec.split)
    rows = [normalize_row(dict(r), spec.hub_id) for r in data]
    if len(rows) not in spec.expected:
        import warnings

        warnings.warn(f"{spec.hub_id} has {len(rows)} problems; expected {' or '.join(map(str, spec.expected))}", stacklevel=2)
    return rows
