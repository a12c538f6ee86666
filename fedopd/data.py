"""Client prompts: the tiny-arith set, prompt rendering, and the per-round prompt loader.

A row is a dict with at least ``problem`` and ``answer`` (the gold answer as a string). Prompts
are rendered as in the paper (SPEC §3): the problem, a newline, :data:`INSTRUCTION`, as one user
message through the tokenizer's chat template with ``add_generation_prompt=True`` and
``enable_thinking=False``. Prompts longer than ``data.max-prompt-tokens`` are dropped, never
truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def round_indices(num_prompts: int, server_round: int, per_round: int, seed: int) -> np.ndarray:
    """Indices of the prompts a client uses in ``server_round`` (1-based).

    Equivalent to a persistent shuffled loader that draws ``per_round`` prompts per round and
    reshuffles (with seed ``(seed, epoch)``) when it runs out, but stateless: any round's batch
    is recomputed from the round number, so nothing has to survive between Flower messages.
    """
    if num_prompts <= 0:
        raise ValueError("round_indices: no prompts")
    start, stop = (server_round - 1) * per_round, server_round * per_round
    out = []
    for epoch in range(start // num_prompts, (stop - 1) // num_prompts + 1):
        perm = np.random.default_rng([seed, epoch]).permutation(num_prompts)
        lo, hi = epoch * num_prompts, (epoch + 1) * num_prompts
        out.append(perm[max(start, lo) - lo : min(stop, hi) - lo])
    return np.concatenate(out)
