"""Client prompts: the prompt sets by name (:data:`DATASETS`), their client partitions, prompt
rendering, and the per-round loader.

A new prompt set is one loader function and one :func:`register_dataset` line. The built-in sets:
``sandbox`` and ``math`` (every ``data.partitioner``), ``tiny-arith`` (``groups`` only) and
``prompts``, your own files or hub dataset (:mod:`fedopd.data_prompts`; ``iid``, ``dirichlet``,
``natural``). ``data.partitioner = 'groups'`` is each set's own fixed split (the paper's); the
others are Flower Datasets' partitioners over a seeded sample of the set's pool
(:mod:`fedopd.data_partition`), computed once per process (:func:`partitions`).
:func:`check_prompt_set` validates a configuration before round 1, and
``python -m fedopd.data describe`` prints (and ``--plot`` draws) the partitions.

A row is a dict with at least ``problem`` and ``answer`` (the gold answer as a string). Prompts
are rendered as in the paper: the problem, a newline, :data:`INSTRUCTION`, as one user
message through the tokenizer's chat template with ``add_generation_prompt=True`` and
``enable_thinking=False``. Prompts longer than ``data.max-prompt-tokens`` are dropped, never
truncated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedopd.config import PARTITIONERS, DataSettings
from fedopd.data_partition import allocate as _allocate

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
        raise ValueError(f"{source}: all {len(rows)} prompts are longer than data.max-prompt-tokens = {max_prompt_tokens}")
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
    from fedopd.grading import last_boxed

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


def _check_partition_id(partition_id: int, num_partitions: int) -> None:
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is not in [0, num-partitions = {num_partitions})")


def _partitioned(data, partition_id: int, num_partitions: int) -> list[dict]:
    """One client's training rows under a Flower Datasets partitioner (:func:`partitions`)."""
    _check_partition_id(partition_id, num_partitions)
    return list(partitions(data, num_partitions)[partition_id])


def _partitioned_heldout(data, partition_id: int, num_partitions: int, count: int) -> list[dict]:
    """One client's held-out rows under a Flower Datasets partitioner (:func:`heldout_partitions`)."""
    _check_partition_id(partition_id, num_partitions)
    return list(heldout_partitions(data, num_partitions, count)[partition_id])


def _sandbox_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    from fedopd.sandbox import task

    if data.partitioner != "groups":
        return _partitioned(data, partition_id, num_partitions)
    return task.client_partition(partition_id, num_partitions, data.prompts_per_client, data.seed)


def _sandbox_heldout(data, partition_id: int, num_partitions: int, count: int) -> list[dict]:
    from fedopd.sandbox import task

    if data.partitioner != "groups":
        return _partitioned_heldout(data, partition_id, num_partitions, count)
    return task.client_heldout(partition_id, num_partitions, count)


def _tiny_arith_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    return tiny_arith_partition(partition_id, num_partitions, data.prompts_per_client, data.seed)


@lru_cache(maxsize=1)
def math_partitions(path: str, prompts_per_client: int, seed: int) -> tuple[tuple[dict, ...], ...]:
    """The three MATH client partitions, computed once per process (every client reads its own)."""
    return tuple(tuple(p) for p in partition_math(load_math_rows(path), prompts_per_client, seed))


def _check_math_groups(num_partitions: int) -> None:
    if num_partitions != len(MATH_CLIENT_GROUPS):
        raise ValueError(f"data.name = 'math' has {len(MATH_CLIENT_GROUPS)} subject-group clients; num-partitions is {num_partitions}")


def _math_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    if data.partitioner != "groups":
        return _partitioned(data, partition_id, num_partitions)
    _check_math_groups(num_partitions)
    return list(math_partitions(data.path, data.prompts_per_client, data.seed)[partition_id])


register_dataset("sandbox", _sandbox_train, _sandbox_heldout, partitioners=PARTITIONERS)
register_dataset("tiny-arith", _tiny_arith_train)
register_dataset("math", _math_train, partitioners=PARTITIONERS)
register_dataset("prompts", _partitioned, _partitioned_heldout, partitioners=("iid", "dirichlet", "natural"))


# ---------------------------------------------------------------------------------------------
# The pools of data.partitioner = iid, dirichlet, natural (fedopd.data_partition)
# ---------------------------------------------------------------------------------------------


def sandbox_pool(data: DataSettings, num_partitions: int) -> list[dict]:
    """ceil(prompts-per-client x num-partitions / 3) training problems of each skill group."""
    from fedopd.sandbox import task

    need = math.ceil(data.prompts_per_client * num_partitions / len(task.GROUPS))
    rows: list[dict] = []
    for group in task.GROUPS:
        try:
            rows += task.problems(group, need, data.seed)
        except ValueError:
            capacity = task.pool_size(group)
            raise ValueError(
                f"data.partitioner = {data.partitioner!r} draws ceil(data.prompts-per-client x num-partitions / "
                f"{len(task.GROUPS)}) = ceil({data.prompts_per_client} x {num_partitions} / {len(task.GROUPS)}) = {need} "
                f"training problems of each sandbox skill group, but group {group!r} holds only {capacity}; "
                f"lower data.prompts-per-client (at most {len(task.GROUPS) * capacity // num_partitions} "
                f"for num-partitions = {num_partitions}) or num-partitions"
            ) from None
    return rows


def math_pool(data: DataSettings) -> list[dict]:
    """The cleaned MATH rows (:func:`clean_math_rows`), ``group`` = the subject (``type``)."""
    return [{**r, "group": r.get("type")} for r in clean_math_rows(load_math_rows(data.path))]


def _pool(data: DataSettings, num_partitions: int) -> tuple[list[dict], str]:
    """The rows a non-``groups`` partitioner splits, and their name for messages."""
    if data.name == "sandbox":
        return sandbox_pool(data, num_partitions), "the sandbox training pool"
    if data.name == "math":
        return math_pool(data), f"the MATH rows{f' of data.path = {data.path!r}' if data.path else ''}"
    if data.name == "prompts":
        from fedopd.data_prompts import train_pool

        return train_pool(data), f"the training prompts of data.path = '{data.path}'"
    raise ValueError(f"data.name = {data.name!r} supports only data.partitioner = 'groups'")


@lru_cache(maxsize=8)
def partitions(data: DataSettings, num_partitions: int) -> tuple[tuple[dict, ...], ...]:
    """Every client's training rows under ``data.partitioner`` (iid, dirichlet, natural), computed
    once per process for a ``DataSettings`` and a number of partitions.

    A seeded sample (``data.seed``) of at most ``data.prompts-per-client x num_partitions`` rows of
    the set's pool is partitioned, so clients hold ``data.prompts-per-client`` prompts on average.
    """
    from fedopd.data_partition import partition_pool, sample_pool

    rows, source = _pool(data, num_partitions)
    pool = sample_pool(rows, data.prompts_per_client * num_partitions, data.seed)
    return tuple(tuple(p) for p in partition_pool(pool, num_partitions, data, source))


def _sandbox_heldout_pool(group: str, count: int) -> list[dict]:
    """``count`` held-out problems of ``group`` (the same in every run), or all there are."""
    from fedopd.sandbox import task

    try:
        return task.problems(group, count, task.EVAL_SEED, heldout=True)
    except ValueError:
        return task.problems(group, task.pool_size(group, heldout=True), task.EVAL_SEED, heldout=True)


@lru_cache(maxsize=8)
def heldout_partitions(data: DataSettings, num_partitions: int, count: int) -> tuple[tuple[dict, ...], ...]:
    """Every client's ``count`` held-out rows under a non-``groups`` partitioner.

    Each client's held-out problems follow its training mix over ``data.partition-by`` (the
    sandbox: over its skill groups), allocated by largest remainder, and are disjoint between
    clients where the held-out pool allows. None is any client's training problem.
    """
    from fedopd.data_partition import demand, heldout_allocation, mix, take_heldout

    parts = partitions(data, num_partitions)
    if count <= 0:
        return tuple(() for _ in parts)
    if data.name == "sandbox":
        from fedopd.sandbox import task

        allocations = heldout_allocation([mix(p, "group") for p in parts], count, {g: 1 for g in task.GROUPS})
        pools = {g: _sandbox_heldout_pool(g, n) for g, n in demand(allocations).items()}
        return tuple(tuple(rows) for rows in take_heldout(allocations, pools))
    if data.name != "prompts":
        raise ValueError(f"data.name = {data.name!r} has no held-out problems")
    from fedopd.data_prompts import heldout_pool

    pool = heldout_pool(data)
    if not pool:
        raise ValueError(
            f"data.name = 'prompts' has no held-out problems: data.path = '{data.path}' is too small for its seeded "
            f"split (one problem in 5 held out), or every held-out problem is also a training problem; give data.eval-path"
        )
    by = data.partition_by
    if all(r.get(by) is not None for r in pool) and all(r.get(by) is not None for p in parts for r in p):
        pools: dict[str, list[dict]] = {}
        for r in pool:
            pools.setdefault(str(r[by]), []).append(r)
        mixes = [mix(p, by) for p in parts]
    else:  # no partition-by column: one mix
        pools, mixes = {"": pool}, [{"": len(p)} for p in parts]
    allocations = heldout_allocation(mixes, count, {v: len(rows) for v, rows in pools.items()})
    return tuple(tuple(rows) for rows in take_heldout(allocations, pools))


# ---------------------------------------------------------------------------------------------
# Checks before round 1, and python -m fedopd.data describe
# ---------------------------------------------------------------------------------------------


def check_prompt_set(data: DataSettings, num_partitions: int, heldout_count: int = 0) -> None:
    """Load and validate the configured prompt set and partition, before round 1 (the ServerApp).

    Every partition must be non-empty (``natural``: one value of ``data.partition-by`` per
    partition); for ``data.name = 'prompts'`` every file must be readable with its columns and
    every gold answer parseable by math-verify. With ``heldout_count`` (``eval.prompts-per-client``
    when the run evaluates), every client must have held-out problems. Raises ``ValueError`` naming
    the run-config key. Cheap for the built-in sets (``math`` with ``groups`` is not loaded here).
    """
    if data.name not in DATASETS:
        raise ValueError(f"data.name = {data.name!r} is not a registered prompt set; allowed: {', '.join(DATASETS)}")
    prompt_set = DATASETS[data.name]
    if data.partitioner not in prompt_set.partitioners:
        raise ValueError(
            f"data.partitioner = {data.partitioner!r} is not defined for data.name = {data.name!r}; "
            f"allowed: {', '.join(repr(p) for p in prompt_set.partitioners)}"
        )
    if num_partitions < 1:
        raise ValueError(f"num-partitions = {num_partitions} must be at least 1")
    if data.name == "math" and data.partitioner == "groups":
        _check_math_groups(num_partitions)  # the clients load MATH; the server need not
        return
    if data.name == "prompts":
        from fedopd.data_prompts import check_gold_answers, eval_files, load_prompt_files

        check_gold_answers(load_prompt_files(data.path, data.split, data.problem_column, data.answer_column), data.answer_column)
        check_gold_answers(eval_files(data), data.answer_column)
    for pid in range(num_partitions):
        if not prompt_set.train_rows(data, pid, num_partitions):
            raise ValueError(f"data.name = {data.name!r}: client partition {pid} of {num_partitions} has no prompts")
    if heldout_count > 0 and prompt_set.heldout_rows is not None:
        for pid in range(num_partitions):
            if not prompt_set.heldout_rows(data, pid, num_partitions, heldout_count):
                raise ValueError(f"data.name = {data.name!r}: client partition {pid} of {num_partitions} has no held-out problems")


def describe(data: DataSettings, num_partitions: int, heldout_count: int = 0) -> str:
    """Each partition's size and mix over ``data.partition-by`` (and its held-out problems)."""
    from fedopd.data_partition import describe_partition

    prompt_set = DATASETS[data.name]
    parts = [prompt_set.train_rows(data, pid, num_partitions) for pid in range(num_partitions)]
    how = f"data.partitioner = {data.partitioner!r}"
    if data.partitioner in ("dirichlet", "natural"):
        how += f", data.partition-by = {data.partition_by!r}"
    if data.partitioner == "dirichlet":
        how += f", data.dirichlet-alpha = {data.dirichlet_alpha}"
    lines = [
        (
            f"data.name = {data.name!r}, {how}, data.prompts-per-client = {data.prompts_per_client}, "
            f"data.seed = {data.seed}: {num_partitions} partitions, {sum(len(p) for p in parts)} prompts"
        )
    ]
    for pid, rows in enumerate(parts):
        lines.append(f"partition {pid}: {describe_partition(rows, data.partition_by)}")
        if heldout_count > 0 and prompt_set.heldout_rows is not None:
            try:
                held = describe_partition(prompt_set.heldout_rows(data, pid, num_partitions, heldout_count), data.partition_by)
            except ValueError as err:
                held = f"none ({err})"
            lines.append(f"  held-out: {held}")
    return "\n".join(lines)


def plot_partitions(data: DataSettings, num_partitions: int, out: str) -> None:
    """Flower Datasets' per-partition label distribution (over ``data.partition-by``) as a file."""
    import matplotlib

    matplotlib.use("Agg")
    from flwr_datasets.visualization import plot_label_distributions

    from fedopd.data_partition import LABEL, fixed_partitioner

    parts = [DATASETS[data.name].train_rows(data, pid, num_partitions) for pid in range(num_partitions)]
    fig, _, _ = plot_label_distributions(
        fixed_partitioner(parts, data.partition_by),
        label_name=LABEL,
        legend=True,
        legend_title=data.partition_by,
        verbose_labels=False,
        title=f"{data.name}: data.partitioner = {data.partitioner!r}, by {data.partition_by!r}",
    )
    fig.savefig(out, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    """``python -m fedopd.data describe [--run-config ...] [--preset NAME] [--num-partitions N] [--plot FILE]``."""
    import argparse
    import sys
    from pathlib import Path

    from fedopd.config import ConfigError, parse_run_config
    from fedopd.presets import add_run_config_option, app_defaults, load_preset, overrides_from_args

    parser = argparse.ArgumentParser(prog="python -m fedopd.data", description="Inspect the client prompt partitions.")
    commands = parser.add_subparsers(dest="command", required=True)
    desc = commands.add_parser("describe", help="each partition's size and mix over data.partition-by (and held-out problems)")
    desc.add_argument("--preset", help="a preset of configs/ (e.g. tiny) or a TOML file of run-config overrides")
    add_run_config_option(desc)
    desc.add_argument("--num-partitions", type=int, default=0, help="default: num-clients, or 3")
    desc.add_argument("--plot", metavar="FILE", help="also draw Flower Datasets' partition plot to FILE (e.g. out.png)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        merged = app_defaults()
        if args.preset:
            preset = Path(args.preset)
            if not preset.is_file():
                preset = Path(__file__).resolve().parent.parent / "configs" / f"{args.preset}.toml"
            merged.update(load_preset(preset))
        if args.run_config:
            merged.update(overrides_from_args(args.run_config))
        cfg = parse_run_config(merged)
        num = args.num_partitions or cfg.num_clients or 3
        print(describe(cfg.data, num, cfg.eval.prompts_per_client))
        if args.plot:
            plot_partitions(cfg.data, num, args.plot)
            print(f"plot: {args.plot}")
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # python -m fedopd.data describe: run the module's importable copy
    from fedopd.data import main as _main

    raise SystemExit(_main())
