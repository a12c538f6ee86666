"""The ``sandbox`` task: step-by-step arithmetic in three skill groups that share sub-skills.

* ``addition``: a + b with 2- and 3-digit operands, column by column with carries;
* ``multiplication``: c * b (1-digit times 2-digit) as two partial products, c*ones and
  c*tens*10, that are then added **with exactly the addition steps of the first group**;
* ``expression``: (a + b) * c, an addition (group 1's steps) whose sum is then multiplied (group
  2's steps).

So the groups share sub-skills: every solution of groups 2 and 3 contains a complete group-1
solution, and every group-3 solution contains a complete group-2 solution. Client i holds the
problems of group i. Every solution ends in ``\\boxed{N}`` and is graded by math-verify like the
paper's benchmarks.

Each group's problem space is split once and for all into a **training pool** and a **held-out
pool** by a hash of the problem text (:func:`is_heldout`). The sandbox models' supervised training,
the clients' training prompts and the held-out evaluation never cross that line: held-out
problems are seen by no training of any kind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import lru_cache

import numpy as np

GROUPS = ("addition", "multiplication", "expression")
HELDOUT_SHARE = 5  # one problem in 5 is held out
EVAL_SEED = 0  # held-out prompts are the same in every run (methods and seeds compare on them)


# ---------------------------------------------------------------------------------------------
# Step-by-step solutions
# ---------------------------------------------------------------------------------------------


def addition_steps(a: int, b: int) -> list[str]:
    """Column addition of a + b, lowest digit first, with explicit carries.

    Each column line is ``x+y(+carry)=s``: its last digit is written, its tens are carried.

    >>> addition_steps(347, 85)
    ['347+85:', '7+5=12', '4+8+1=13', '3+0+1=4', '=432']
    """
    lines = [f"{a}+{b}:"]
    da, db = str(a)[::-1], str(b)[::-1]
    carry = 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    lines.append(f"={a + b}")
    return lines


def multiplication_steps(c: int, b: int) -> list[str]:
    """c * b for a 1-digit c and a 2-digit b: c*ones, c*tens*10, then their column addition.

    >>> multiplication_steps(7, 46)
    ['7*46:', '7*6=42', '7*40=280', '280+42:', '0+2=2', '8+4=12', '2+0+1=3', '=322']
    """
    ones, tens = b % 10, b - b % 10
    return [f"{c}*{b}:", f"{c}*{ones}={c * ones}", f"{c}*{tens}={c * tens}", *addition_steps(c * tens, c * ones)]


def expression_steps(a: int, b: int, c: int) -> list[str]:
    """(a + b) * c: the addition, then the multiplication of its sum by c."""
    return [*addition_steps(a, b), *multiplication_steps(c, a + b)]


def solution(lines: list[str], answer: int) -> str:
    return "\n".join(lines) + f"\n\\boxed{{{answer}}}"


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------


def _addition(rng: np.random.Generator) -> dict:
    a, b = (int(rng.integers(10, 1000)) for _ in range(2))
    return {"problem": f"Compute {a} + {b}.", "answer": str(a + b), "solution": solution(addition_steps(a, b), a + b)}


def _multiplication(rng: np.random.Generator) -> dict:
    c, b = int(rng.integers(2, 10)), int(rng.integers(10, 100))
    return {"problem": f"Compute {c} * {b}.", "answer": str(c * b), "solution": solution(multiplication_steps(c, b), c * b)}


def _expression(rng: np.random.Generator) -> dict:
    a = int(rng.integers(10, 90))
    b = int(rng.integers(10, 100 - a))  # a + b <= 99: the product step is group 2's
    c = int(rng.integers(2, 10))
    v = (a + b) * c
    return {"problem": f"Compute ({a} + {b}) * {c}.", "answer": str(v), "solution": solution(expression_steps(a, b, c), v)}


_MAKERS: dict[str, Callable[[np.random.Generator], dict]] = {
    "addition": _addition,
    "multiplication": _multiplication,
    "expression": _expression,
}


def is_heldout(problem: str) -> bool:
    """Whether a problem belongs to the held-out pool (a fixed hash split, 1 in 5)."""
    return int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big") % HELDOUT_SHARE == 0


def problems(group: str, count: int, seed: int, *, heldout: bool = False) -> list[dict]:
    """``count`` distinct problems of ``group`` from the training (or held-out) pool.

    Deterministic in ``seed``; rows have ``problem``, ``answer``, ``solution`` and ``group``.
    """
    if group not in _MAKERS:
        raise ValueError(f"unknown sandbox group {group!r}; allowed: {', '.join(GROUPS)}")
    rng = np.random.default_rng([seed, GROUPS.index(group), int(heldout)])
    rows, seen = [], set()
    for _ in range(20 * count + 10_000):
        if len(rows) == count:
            return rows
        row = _MAKERS[group](rng)
        if row["problem"] in seen or is_heldout(row["problem"]) != heldout:
            continue
        seen.add(row["problem"])
        rows.append({**row, "group": group})
    pool = "held-out" if heldout else "training"
    raise ValueError(f"sandbox group {group!r} cannot provide {count} distinct {pool} problems")


def _group_of(partition_id: int, num_partitions: int) -> tuple[str, int, int]:
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is not in [0, num-partitions = {num_partitions})")
    g = partition_id % len(GROUPS)
    sharing = len(range(g, num_partitions, len(GROUPS)))  # clients on this group
    return GROUPS[g], partition_id // len(GROUPS), sharing


def client_partition(partition_id: int, num_partitions: int, prompts_per_client: int, seed: int) -> list[dict]:
    """Client i's training prompts: group i mod 3, disjoint from every other client's."""
    group, k, sharing = _group_of(partition_id, num_partitions)
    rows = problems(group, prompts_per_client * sharing, seed)
    return rows[k * prompts_per_client : (k + 1) * prompts_per_client]


@lru_cache(maxsize=32)
def _heldout(group: str, count: int) -> tuple[dict, ...]:
    return tuple(problems(group, count, EVAL_SEED, heldout=True))


def client_heldout(partition_id: int, num_partitions: int, count: int) -> list[dict]:
    """Client i's held-out problems: its group's, from the held-out pool, the same in every run."""
    group, k, sharing = _group_of(partition_id, num_partitions)
    return list(_heldout(group, count * sharing)[k * count : (k + 1) * count])


def _problem_space(group: str):
    """Every problem text of ``group`` that its maker can draw (the operand ranges above)."""
    if group == "addition":
        return (f"Compute {a} + {b}." for a in range(10, 1000) for b in range(10, 1000))
    if group == "multiplication":
        return (f"Compute {c} * {b}." for c in range(2, 10) for b in range(10, 100))
    if group == "expression":
        return (f"Compute ({a} + {b}) * {c}." for a in range(10, 90) for b in range(10, 100 - a) for c in range(2, 10))
    raise ValueError(f"unknown sandbox group {group!r}; allowed: {', '.join(GROUPS)}")


@lru_cache(maxsize=8)
def pool_size(group: str, *, heldout: bool = False) -> int:
    """How many distinct problems the training (or held-out) pool of ``group`` holds.

    Multiplication is small (8 x 90 problems, 572 of them for training); counting addition's
    980,100 problems takes a few seconds (only error messages need it).
    """
    return sum(is_heldout(p) == heldout for p in _problem_space(group))
