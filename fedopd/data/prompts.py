"""Prompts: rendering a problem as the paper does, tokenizing it, and the per-round loader.

Prompts are rendered as in the paper: the problem, a newline, :data:`INSTRUCTION`, as one user
message through the tokenizer's chat template with ``add_generation_prompt=True`` and
``enable_thinking=False``. Prompts longer than ``data.max-prompt-tokens`` are dropped, never
truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


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


MAX_CHARS_PER_TOKEN = 32  # more characters per token than any tokenizer's longest common tokens hold


def encode_prompts(tokenizer, rows: Sequence[dict], max_prompt_tokens: int, *, source: str = "prompts") -> list[Prompt]:
    """Render and tokenize rows, dropping prompts over ``max_prompt_tokens`` tokens.

    A problem longer than :data:`MAX_CHARS_PER_TOKEN` x ``max_prompt_tokens`` characters is
    dropped before it is rendered: no tokenizer packs that many characters into a token, and the
    work of reading a prompt pool stays bounded by its rows x ``max_prompt_tokens``
    (:mod:`client_app.limits`). Raises ``ValueError`` naming ``source`` when nothing is left.
    """
    if not rows:
        raise ValueError(f"{source}: the prompt set is empty")
    prompts = []
    for row in rows:
        if len(str(row["problem"])) > MAX_CHARS_PER_TOKEN * max_prompt_tokens:
            continue
        ids = tokenizer(render_prompt(tokenizer, row["problem"]), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            prompts.append(Prompt(row["problem"], str(row["answer"]), str(row.get("group", "")), tuple(ids)))
    if not prompts:
        raise ValueError(f"{source}: all {len(rows)} prompts are longer than data.max-prompt-tokens = {max_prompt_tokens}")
    return prompts


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


def untrained_indices(num_prompts: int, trained: Sequence[int], count: int, seed: int) -> np.ndarray:
    """``count`` distinct prompt indices outside ``trained`` (a round's batch), drawn with ``seed``:
    the prompts of a held-out scoring cache. A ValueError when fewer than ``count`` are left."""
    left = np.setdiff1d(np.arange(num_prompts), np.asarray(trained, dtype=np.int64))
    if len(left) < count:
        raise ValueError(f"a held-out scoring cache needs {count} prompts outside the round's {len(set(trained))}; the client has {num_prompts}")
    return np.random.default_rng(seed).choice(left, size=count, replace=False)


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
