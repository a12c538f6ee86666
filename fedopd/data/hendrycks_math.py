"""MATH (EleutherAI/hendrycks_math): loading, cleaning, and the paper's three subject-group clients."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from fedopd.core.settings import DataSettings
from fedopd.data.partition import allocate as _allocate

MATH_HUB_ID = "EleutherAI/hendrycks_math"
MATH_CONFIGS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
MATH_CLIENT_GROUPS = (
    ("Prealgebra", "Algebra"),
    ("Number Theory", "Counting & Probability"),
    ("Intermediate Algebra", "Precalculus"),
)


def _normalize_problem(text: str) -> str:
    return " ".join(text.split())


def clean_math_rows(rows: Sequence[dict]) -> list[dict]:
    """MATH rows that have an extractable ``\\boxed{}`` answer (added as ``answer``), without
    repeats of a problem already seen (up to white space; the first occurrence is kept)."""
    from fedopd.data.grading import last_boxed

    seen, clean = set(), []
    for row in rows:
        answer = last_boxed(row.get("solution") or "")
        key = _normalize_problem(row.get("problem") or "")
        if not answer or not key or key in seen:
            continue
        seen.add(key)
        clean.append({**row, "answer": answer})
    return clean


def partition_math(rows: Sequence[dict], prompts_per_client: int, seed: int) -> list[list[dict]]:
    """Three client partitions of MATH rows (paper App. "Models and client data").

    ``rows`` have the columns of ``EleutherAI/hendrycks_math`` (``problem``, ``level``, ``type``,
    ``solution``). Client i draws from the subjects of ``MATH_CLIENT_GROUPS[i]`` (Geometry is used
    by none). Rows without an extractable ``\\boxed{}`` answer are dropped, and so are repeats of
    a problem already seen (the first occurrence is kept). Each client gets ``prompts_per_client``
    rows sampled without replacement, allocated to its (subject, level) strata in proportion to
    their sizes, deterministic in ``seed``. Returned rows keep their fields and add ``answer``.
    """
    clean = clean_math_rows(rows)
    clients = []
    for index, subjects in enumerate(MATH_CLIENT_GROUPS):
        pool = [r for r in clean if r.get("type") in subjects]
        if len(pool) < prompts_per_client:
            raise ValueError(
                f"MATH client {index} ({' + '.join(subjects)}) has {len(pool)} usable problems, "
                f"fewer than data.prompts-per-client = {prompts_per_client}"
            )
        strata: dict[tuple[str, str], list[dict]] = {}
        for r in pool:
            strata.setdefault((str(r["type"]), str(r.get("level", ""))), []).append(r)
        keys = sorted(strata)
        counts = _allocate([len(strata[k]) for k in keys], prompts_per_client)
        rng = np.random.default_rng([seed, index])
        chosen = []
        for k, n in zip(keys, counts):
            picks = rng.choice(len(strata[k]), size=n, replace=False)
            chosen += [strata[k][i] for i in sorted(picks)]
        clients.append(chosen)
    return clients


def load_math_rows(path: str = "") -> list[dict]:
    """The MATH training rows: a local JSONL/JSON/Parquet file or folder of them, or the hub.

    From the hub, the seven subject configs of ``EleutherAI/hendrycks_math`` (train split), in
    the order of :data:`MATH_CONFIGS`.
    """
    from pathlib import Path

    from datasets import load_dataset

    if path:
        source = Path(path).expanduser()
        if not source.exists():
            raise FileNotFoundError(f"data.path = '{path}' does not exist")
        files = sorted(p for p in (source.iterdir() if source.is_dir() else [source]) if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise ValueError(f"data.path = '{path}' holds no .jsonl, .json or .parquet file")
        kind = "parquet" if files[0].suffix == ".parquet" else "json"
        data = load_dataset(kind, data_files=[str(f) for f in files], split="train")
        return [dict(r) for r in data]
    rows: list[dict] = []
    for config in MATH_CONFIGS:
        rows += [dict(r) for r in load_dataset(MATH_HUB_ID, config, split="train")]
    return rows


@lru_cache(maxsize=1)
def math_partitions(path: str, prompts_per_client: int, seed: int) -> tuple[tuple[dict, ...], ...]:
    """The three MATH client partitions, computed once per process (every client reads its own)."""
    return tuple(tuple(p) for p in partition_math(load_math_rows(path), prompts_per_client, seed))


def check_math_groups(num_partitions: int) -> None:
    if num_partitions != len(MATH_CLIENT_GROUPS):
        raise ValueError(f"data.name = 'math' has {len(MATH_CLIENT_GROUPS)} subject-group clients; num-partitions is {num_partitions}")


def math_pool(data: DataSettings) -> list[dict]:
    """The cleaned MATH rows (:func:`clean_math_rows`), ``group`` = the subject (``type``)."""
    return [{**r, "group": r.get("type")} for r in clean_math_rows(load_math_rows(data.path))]
