"""``tiny-arith``: two-operand arithmetic problems in three skill groups, made from a seed (the tiny preset's set)."""

from __future__ import annotations

import numpy as np

TINY_ARITH_GROUPS = ("addition", "subtraction", "multiplication")

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
