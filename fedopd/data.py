"""Client prompts: the prompt sets by name (:data:`DATASETS`), prompt rendering, and the per-round loader.

A new prompt set is one loader function and one :func:`register_dataset` line.

A row is a dict with at least ``problem`` and ``answer`` (the gold answer as a string). Prompts
are rendered as in the paper: the problem, a newline, :data:`INSTRUCTION`, as one user
message through the tokenizer's chat template with ``add_generation_prompt=True`` and
``enable_thinking=False``. Prompts longer than ``data.max-prompt-tokens`` are dropped, never
truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TINY_ARITH_GROUPS = ("addition", "subtraction", "multiplication")


@dataclass(frozen=True)
class Prompt:
    """One training prompt: its row fields and its chat-rendered token ids."""

    problem: str
    answer: str
    group: str
    token_ids: tuple[int, ...]


def format_problem(problem: str) -> str:
    return f"{problem}\n{INSTRUCTION}"


def render_prompt(tokenizer, problem: str) -> str:
    """The chat-template text of one problem (no system message, non-thinking)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": format_problem(problem)}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def encode_prompts(tokenizer, rows: Sequence[dict], max_prompt_tokens: int, *, source: str = "prompts") -> list[Prompt]:
    """Render and tokenize rows, dropping prompts over ``max_prompt_tokens`` tokens.

    Raises ``ValueError`` naming ``source`` when nothing is left, before any work starts.
    """
    if not rows:
        raise ValueError(f"{source}: the prompt set is empty")
    prompts = []
    for row in rows:
        ids = tokenizer(render_prompt(tokenizer, row["problem"]), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append(Prompt(row["problem"], str(row["answer"]), str(row.get("group", "")), tuple(ids)))
    if not prompts:
        raise ValueError(
            f"{source}: all {len(rows)} prompts are longer than data.max-prompt-tokens = {max_prompt_tokens}"
        )
    return prompts


# ---------------------------------------------------------------------------------------------
# tiny-arith
# ---------------------------------------------------------------------------------------------

_TEMPLATES = {
    "addition": ("What is {a} + {b}?", "Compute {a} + {b}.", "Find the sum of {a} and {b}."),
    "subtraction": ("What is {a} - {b}?", "Compute {a} - {b}.", "Find the difference {a} minus {b}."),
    "multiplication": ("What is {a} * {b}?", "Compute {a} times {b}.", "Find the product of {a} and {b}."),
}


def _operands(group: str, rng: np.random.Generator) -> tuple[int, int, int]:
    if group == "addition":
        a, b = rng.integers(10, 100, size=2)
        return int(a), int(b), int(a + b)
    if group == "subtraction":
        a, b = sorted(rng.integers(10, 100, size=2), reverse=True)
        return int(a), int(b), int(a - b)
    a, b = rng.integers(2, 20, size=2)
    return int(a), int(b), int(a * b)


def tiny_arith_group(group: str, count: int, seed: int) -> list[dict]:
    """``count`` distinct problems of one skill group, deterministic in ``seed``."""
    if group not in TINY_ARITH_GROUPS:
        raise ValueError(f"unknown tiny-arith group {group!r}; allowed: {', '.join(TINY_ARITH_GROUPS)}")
    rng = np.random.default_rng([seed, TINY_ARITH_GROUPS.index(group)])
    rows, seen = [], set()
    for _ in range(100 * count + 1000):
        if len(rows) == count:
            return rows
        a, b, answer = _operands(group, rng)
        template = _TEMPLATES[group][int(rng.integers(len(_TEMPLATES[group])))]
        problem = template.format(a=a, b=b)
        if problem not in seen:
            seen.add(problem)
            rows.append({"problem": problem, "answer": str(answer), "group": group})
    raise ValueError(f"tiny-arith group {group!r} cannot provide {count} distinct problems")


def tiny_arith_partition(partition_id: int, num_partitions: int, prompts_per_client: int, seed: int) -> list[dict]:
    """The rows of one client: client i gets skill group i mod 3, disjoint from every other client."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is not in [0, num-partitions = {num_partitions})")
    groups = len(TINY_ARITH_GROUPS)
    group = TINY_ARITH_GROUPS[partition_id % groups]
    sharing = len(range(partition_id % groups, num_partitions, groups))  # clients on this group
    rows = tiny_arith_group(group, prompts_per_client * sharing, seed)
    k = partition_id // groups
    return rows[k * prompts_per_client : (k + 1) * prompts_per_client]


# ---------------------------------------------------------------------------------------------
# The per-round loader
# ---------------------------------------------------------------------------------------------


def epoch_order(num_prompts: int, epoch: int, per_round: int, seed: int) -> np.ndarray:
    """The order in which the per-round loader visits the prompts in ``epoch`` (0-based).

    Each epoch is a permutation seeded by ``(seed, epoch)``. When a round's batch straddles the
    end of an epoch, the prompts that batch already took from the old epoch are moved behind the
    part of the new epoch that completes it (keeping the permutation's order otherwise), so no
    prompt appears twice in one round while ``per_round <= num_prompts``.
    """
    order = np.random.default_rng([seed, 0]).permutation(num_prompts)
    for e in range(1, epoch + 1):
        perm = np.random.default_rng([seed, e]).permutation(num_prompts)
        start = e * num_prompts  # global draw index of this epoch's first prompt
        carried = start - (start // per_round) * per_round  # drawn in the straddling round so far
        if carried:
            taken = set(order[num_prompts - carried :].tolist())
            need = per_round - carried
            fresh = [int(x) for x in perm if x not in taken]
            head = (fresh + [int(x) for x in perm if x in taken])[:need]
            head_set = set(head)
            perm = np.asarray(head + [int(x) for x in perm if x not in head_set], dtype=perm.dtype)
        order = perm
    return order


def round_indices(num_prompts: int, server_round: int, per_round: int, seed: int) -> np.ndarray:
    """Indices of the prompts a client uses in ``server_round`` (1-based).

    Equivalent to a persistent shuffled loader that draws ``per_round`` prompts per round and
    reshuffles (with seed ``(seed, epoch)``) when it runs out, but stateless: any round's batch
    is recomputed from the round number, so nothing has to survive between Flower messages.
    A batch never holds a prompt twice unless ``per_round`` exceeds ``num_prompts``
    (:func:`epoch_order`).
    """
    if num_prompts <= 0:
        raise ValueError("round_indices: no prompts")
    start, stop = (server_round - 1) * per_round, server_round * per_round
    out = []
    for epoch in range(start // num_prompts, (stop - 1) // num_prompts + 1):
        perm = epoch_order(num_prompts, epoch, per_round, seed)
        lo, hi = epoch * num_prompts, (epoch + 1) * num_prompts
        out.append(perm[max(start, lo) - lo : min(stop, hi) - lo])
    return np.concatenate(out)


# ---------------------------------------------------------------------------------------------
# MATH (EleutherAI/hendrycks_math), three subject-group clients
# ---------------------------------------------------------------------------------------------

MATH_HUB_ID = "EleutherAI/hendrycks_math"
MATH_CONFIGS = (
    "algebra", "counting_and_probability", "geometry", "intermediate_algebra",
    "number_theory", "prealgebra", "precalculus",
)
MATH_CLIENT_GROUPS = (
    ("Prealgebra", "Algebra"),
    ("Number Theory", "Counting & Probability"),
    ("Intermediate Algebra", "Precalculus"),
)


def _normalize_problem(text: str) -> str:
    return " ".join(text.split())


def _allocate(sizes: list[int], total: int) -> list[int]:
    """Proportional allocation of ``total`` over strata of ``sizes`` (largest remainder)."""
    n = sum(sizes)
    exact = [total * s / n for s in sizes]
    counts = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def partition_math(rows: Sequence[dict], prompts_per_client: int, seed: int) -> list[list[dict]]:
    """Three client partitions of MATH rows (paper App. "Models and client data").

    ``rows`` have the columns of ``EleutherAI/hendrycks_math`` (``problem``, ``level``, ``type``,
    ``solution``). Client i draws from the subjects of ``MATH_CLIENT_GROUPS[i]`` (Geometry is used
    by none). Rows without an extractable ``\\boxed{}`` answer are dropped, and so are repeats of
    a problem already seen (the first occurrence is kept). Each client gets ``prompts_per_client``
    rows sampled without replacement, allocated to its (subject, level) strata in proportion to
    their sizes, deterministic in ``seed``. Returned rows keep their fields and add ``answer``.
    """
    from fedopd.grading import last_boxed

    seen, clean = set(), []
    for row in rows:
        answer = last_boxed(row.get("solution") or "")
        key = _normalize_problem(row.get("problem") or "")
        if not answer or not key or key in seen:
            continue
        seen.add(key)
        clean.append({**row, "answer": answer})

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


# ---------------------------------------------------------------------------------------------
# Prompt sets by name (data.name)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSet:
    """A client prompt set: how to get one client's training rows, and its held-out rows.

    ``train_rows(data, partition_id, num_partitions)`` and ``heldout_rows(data, partition_id,
    num_partitions, count)`` take the validated ``DataSettings`` (``data.seed``, ``data.path``,
    ``data.prompts-per-client``, ...) and return rows with ``problem`` and ``answer``. A set
    without held-out problems leaves ``heldout_rows`` None (``eval.every`` must then be 0).
    """

    train_rows: Callable[..., list[dict]]
    heldout_rows: Callable[..., list[dict]] | None = None
    partitioners: tuple[str, ...] = ("groups",)  # the data.partitioner values it supports


DATASETS: dict[str, PromptSet] = {}


def register_dataset(
    name: str,
    train_rows: Callable[..., list[dict]],
    heldout_rows: Callable[..., list[dict]] | None = None,
    partitioners: tuple[str, ...] = ("groups",),
) -> None:
    """Make ``data.name = name`` valid (the run config reads its allowed names from here)."""
    DATASETS[name] = PromptSet(train_rows, heldout_rows, tuple(partitioners))


def _sandbox_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    from fedopd.sandbox import task

    return task.client_partition(partition_id, num_partitions, data.prompts_per_client, data.seed)


def _sandbox_heldout(data, partition_id: int, num_partitions: int, count: int) -> list[dict]:
    from fedopd.sandbox import task

    return task.client_heldout(partition_id, num_partitions, count)


def _tiny_arith_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    return tiny_arith_partition(partition_id, num_partitions, data.prompts_per_client, data.seed)


@lru_cache(maxsize=1)
def math_partitions(path: str, prompts_per_client: int, seed: int) -> tuple[tuple[dict, ...], ...]:
    """The three MATH client partitions, computed once per process (every client reads its own)."""
    return tuple(tuple(p) for p in partition_math(load_math_rows(path), prompts_per_client, seed))


def _math_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    if num_partitions != len(MATH_CLIENT_GROUPS):
        raise ValueError(f"data.name = 'math' has {len(MATH_CLIENT_GROUPS)} subject-group clients; num-partitions is {num_partitions}")
    return list(math_partitions(data.path, data.prompts_per_client, data.seed)[partition_id])


register_dataset("sandbox", _sandbox_train, _sandbox_heldout)
register_dataset("tiny-arith", _tiny_arith_train)
register_dataset("math", _math_train)
