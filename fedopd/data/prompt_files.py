"""Your own prompt set (``data.name = "prompts"``): rows from local files or a hub dataset.

``data.path`` is a JSONL, JSON, Parquet or CSV file, a folder of such files (read in name order),
or a Hugging Face Hub dataset id (split ``data.split``). Every file is read with
``datasets.load_dataset`` (the ``json``, ``parquet`` or ``csv`` builder). The problem text is the
column ``data.problem-column``; the gold answer is the column ``data.answer-column``, either a
plain answer or a solution whose last ``\\boxed{...}`` is the answer. Other columns are kept (for
``data.partition-by``).

Held-out problems come from ``data.eval-path`` (split ``data.eval-split``, or ``data.split``), or
from ``data.eval-split`` of a hub ``data.path``; when neither is given, one problem in
:data:`HELDOUT_SHARE` of ``data.path`` is held out by a split seeded with ``data.seed``. Repeated
problems (up to white space) are dropped, and no held-out problem is a training problem.

Errors are ``ValueError``\\ s that name the file and the run-config key: a missing path, an empty
file, a column that is not there (with the columns that are), an empty or unbalanced answer, and
(:func:`check_gold_answers`) gold answers that math-verify cannot parse.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedopd.core.errors import LocalError
from fedopd.core.settings import DataSettings

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HELDOUT_SHARE = 5  # without an eval source, one problem in 5 is held out
_SPLIT_SALT = 2  # the seeded held-out split
_ORDER_SALT = 3  # the order in which clients take held-out problems
_SHOWN = 5  # offending rows named in an error
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?(/\d+)?")


@dataclass(frozen=True)
class PromptFile:
    """The rows of one file (or one hub split): ``name`` for messages, rows with ``problem`` and
    ``answer`` (and the file's other columns), ``columns`` as read."""

    name: str
    rows: tuple[dict, ...]
    columns: tuple[str, ...]


def looks_local(path: str) -> bool:
    """Whether ``path`` is written as a local file or folder (absolute, ``~``, ``./``, ``../``, a
    data file's suffix, a backslash), not as a hub id ``owner/name``; the file system is not read."""
    return path.startswith(("/", "./", "../", "~", ".\\")) or Path(path).suffix.lower() in BUILDERS or "\\" in path


def _is_local(path: str) -> bool:
    """Whether ``path`` means a local file or folder (a hub id is ``owner/name``)."""
    return Path(path).expanduser().exists() or looks_local(path)


def local_files(path: str, key: str = "data.path") -> list[Path]:
    """The data files of a local ``path``: the file itself, or the folder's files in name order."""
    source = Path(path).expanduser()
    if not source.exists():
        raise LocalError(f"{key} = '{path}' does not exist", key, "does not exist")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in BUILDERS)
        if not files:
            raise LocalError(f"{key} = '{path}' holds no {', '.join(sorted(BUILDERS))} file", key, "a folder without data files")
        return files
    if source.suffix.lower() not in BUILDERS:
        raise LocalError(f"{key} = '{path}' is not a {', '.join(sorted(BUILDERS))} file", key, "not a data file")
    return [source]


def _read_file(file: Path, key: str) -> list[dict]:
    from datasets import load_dataset

    with open(file, "rb") as f:
        head = f.read(1 << 16)
    if not head.strip() and file.stat().st_size <= len(head):
        raise LocalError(f"{key}: {file} is empty", key, "an empty file")
    try:
        data = load_dataset(BUILDERS[file.suffix.lower()], data_files=[str(file)], split="train")
    except Exception as err:  # noqa: BLE001 - datasets raises many types; all mean "not readable"
        raise LocalError(
            f"{key}: {file} could not be read as {file.suffix.lower()[1:]}: {type(err).__name__}: {err}", key, "a file that could not be read"
        ) from None
    if len(data) == 0:
        raise LocalError(f"{key}: {file} is empty (no rows)", key, "a file without rows")
    return [dict(r) for r in data]


def _read_hub(path: str, split: str, key: str, split_key: str) -> list[dict]:
    from datasets import load_dataset

    try:
        data = load_dataset(path, split=split)
    except Exception as err:  # noqa: BLE001 - not found, no such split, offline: all "cannot load"
        raise LocalError(
            f"{key} = '{path}' is no local file or folder, and as a hub dataset (split {split_key} = '{split}') "
            f"it could not be loaded: {type(err).__name__}: {err}",
            key,
            "neither a local file nor a loadable hub dataset",
        ) from None
    if len(data) == 0:
        raise LocalError(f"{key} = '{path}' (split {split_key} = '{split}') is empty", key, "an empty split")
    return [dict(r) for r in data]


def gold_answer(value) -> str | None:
    """The gold answer of a cell: the last ``\\boxed{...}`` if there is one, else the text itself.

    None when the cell is empty, or has a ``\\boxed`` without a complete answer.
    """
    from fedopd.data.grading import last_boxed

    if value is None:
        return None
    text = str(value).strip()
    if "\\boxed" in text or "\\fbox" in text:
        return last_boxed(text) or None
    return text or None


def _rows_text(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i + 1) for i in indices[:_SHOWN])
    return f"row{'s' if len(indices) > 1 else ''} {shown}{f' (and {len(indices) - _SHOWN} more)' if len(indices) > _SHOWN else ''}"


def prompt_file(name: str, raw: Sequence[dict], problem_column: str, answer_column: str) -> PromptFile:
    """Rows with ``problem`` and ``answer`` from the raw rows of one file (checked, not yet graded)."""
    columns = tuple(raw[0]) if raw else ()
    for key, column in (("data.problem-column", problem_column), ("data.answer-column", answer_column)):
        if column not in columns:
            raise LocalError(f"{key} = '{column}' is not a column of {name}; its columns: {', '.join(columns)}", key, "not a column of the file")
    rows, no_problem, no_answer = [], [], []
    for i, r in enumerate(raw):
        problem = r.get(problem_column)
        answer = gold_answer(r.get(answer_column))
        if problem is None or not str(problem).strip():
            no_problem.append(i)
        if answer is None:
            no_answer.append(i)
        rows.append({**r, "problem": str(problem or ""), "answer": answer})
    if no_problem:
        raise LocalError(
            f"data.problem-column = '{problem_column}' of {name} is empty in {_rows_text(no_problem)} (1-based)",
            "data.problem-column",
            "empty in some rows",
        )
    if no_answer:
        raise LocalError(
            f"data.answer-column = '{answer_column}' of {name} has no answer in {_rows_text(no_answer)} (1-based): "
            "empty, or a \\boxed{ without its closing brace",
            "data.answer-column",
            "no answer in some rows",
        )
    return PromptFile(name, tuple(rows), columns)


@lru_cache(maxsize=8)
def load_prompt_files(
    path: str, split: str, problem_column: str, answer_column: str, key: str = "data.path", split_key: str = "data.split"
) -> tuple[PromptFile, ...]:
    """The files of ``path`` (or its hub split), read and checked once per process."""
    if not path:
        raise ValueError(f"data.name = 'prompts' needs {key}: a JSONL, JSON, Parquet or CSV file, a folder of them, or a hub dataset id")
    if _is_local(path):
        files = local_files(path, key)
        return tuple(prompt_file(str(f), _read_file(f, key), problem_column, answer_column) for f in files)
    raw = _read_hub(path, split, key, split_key)
    return (prompt_file(f"{path} (split '{split}')", raw, problem_column, answer_column),)


def normalize_problem(text: str) -> str:
    return " ".join(str(text).split())


def unique_rows(rows: Sequence[dict], exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Rows in order without repeats of a problem (up to white space) and without ``exclude``d ones."""
    seen, out = set(exclude), []
    for r in rows:
        key = normalize_problem(r["problem"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def heldout_split(rows: Sequence[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): ``len(rows) // HELDOUT_SHARE`` rows held out, chosen with ``seed``.

    Both keep the rows' order. The share is fixed, so the training rows never depend on how many
    held-out problems a client evaluates.
    """
    held = set(np.random.default_rng([seed, _SPLIT_SALT]).permutation(len(rows))[: len(rows) // HELDOUT_SHARE].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _eval_source(data: DataSettings) -> tuple[str, str, str, str] | None:
    """(path, split, key, split key) of the held-out problems, or None for the seeded split."""
    eval_split = data.eval_split or data.split
    if data.eval_path:
        return data.eval_path, eval_split, "data.eval-path", "data.eval-split" if data.eval_split else "data.split"
    if eval_split == data.split:
        return None
    if data.path and _is_local(data.path):
        raise ValueError(
            f"data.eval-split = '{data.eval_split}' names a split of a hub dataset, but data.path = '{data.path}' is local; "
            "give the held-out file as data.eval-path, or leave data.eval-split empty for a seeded split of data.path"
        )
    return data.path, eval_split, "data.path", "data.eval-split"


def _rows(files: Sequence[PromptFile]) -> list[dict]:
    return [r for f in files for r in f.rows]


@lru_cache(maxsize=8)
def _pools(data: DataSettings) -> tuple[tuple[dict, ...], tuple[dict, ...] | None]:
    rows = unique_rows(_rows(load_prompt_files(data.path, data.split, data.problem_column, data.answer_column)))
    if _eval_source(data) is not None:
        return tuple(rows), None
    train, held = heldout_split(rows, data.seed)
    return tuple(train), tuple(held)


def train_pool(data: DataSettings) -> list[dict]:
    """The training problems of ``data`` (``DataSettings``): ``data.path``, less the held-out split."""
    return list(_pools(data)[0])


def eval_files(data: DataSettings) -> tuple[PromptFile, ...]:
    """The files of the held-out source (empty for the seeded split of ``data.path``)."""
    source = _eval_source(data)
    if source is None:
        return ()
    path, split, key, split_key = source
    return load_prompt_files(path, split, data.problem_column, data.answer_column, key, split_key)


def heldout_pool(data: DataSettings) -> list[dict]:
    """The held-out problems of ``data``, none of them a training problem, in a seeded order."""
    train, held = _pools(data)
    if held is None:
        taken = frozenset(normalize_problem(r["problem"]) for r in train)
        held = unique_rows(_rows(eval_files(data)), exclude=taken)
    order = np.random.default_rng([data.seed, _ORDER_SALT]).permutation(len(held))
    return [held[int(i)] for i in order]


# ---------------------------------------------------------------------------------------------
# Gold answers that math-verify can parse
# ---------------------------------------------------------------------------------------------


def answer_parses(answer: str) -> bool:
    """Whether math-verify parses ``\\boxed{answer}`` into a math expression (not only text).

    Plain numbers pass without math-verify. In a thread other than the main one, math-verify's
    signal-based timeout cannot run, so it parses without one.
    """
    if _PLAIN_NUMBER.fullmatch(answer.strip()):
        return True
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if timeout is None:
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that the timeout is off
    parsed = parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout)
    return any(not isinstance(p, str) for p in parsed)


def check_gold_answers(files: Sequence[PromptFile], answer_column: str, key: str = "data.answer-column") -> None:
    """Raise a ``ValueError`` naming the file, the column and the first rows whose gold answer
    math-verify cannot parse (such a problem could never be graded correct)."""
    for f in files:
        bad = [i for i, r in enumerate(f.rows) if not answer_parses(r["answer"])]
        if bad:
            examples = "; ".join(f"row {i + 1}: {f.rows[i]['answer']!r}" for i in bad[:3])
            raise LocalError(
                f"{key} = '{answer_column}' of {f.name}: math-verify cannot parse the gold answer of "
                f"{_rows_text(bad)} (1-based; {examples}); fix or drop those rows",
                key,
                "gold answers math-verify cannot parse",
            )
