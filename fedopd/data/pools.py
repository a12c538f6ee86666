"""The pools that ``data.partitioner`` = iid, dirichlet or natural splits (:mod:`fedopd.data.partition`),
and every client's training and held-out rows under those partitioners, computed once per process."""

from __future__ import annotations

import math
from functools import lru_cache

from fedopd.core.settings import DataSettings
from fedopd.data.hendrycks_math import math_pool


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


def _pool(data: DataSettings, num_partitions: int) -> tuple[list[dict], str]:
    """The rows a non-``groups`` partitioner splits, and their name for messages."""
    if data.name == "sandbox":
        return sandbox_pool(data, num_partitions), "the sandbox training pool"
    if data.name == "math":
        return math_pool(data), f"the MATH rows{f' of data.path = {data.path!r}' if data.path else ''}"
    if data.name == "prompts":
        from fedopd.data.prompt_files import train_pool

        return train_pool(data), f"the training prompts of data.path = '{data.path}'"
    raise ValueError(f"data.name = {data.name!r} supports only data.partitioner = 'groups'")


@lru_cache(maxsize=8)
def partitions(data: DataSettings, num_partitions: int) -> tuple[tuple[dict, ...], ...]:
    """Every client's training rows under ``data.partitioner`` (iid, dirichlet, natural), computed
    once per process for a ``DataSettings`` and a number of partitions.

    A seeded sample (``data.seed``) of at most ``data.prompts-per-client x num_partitions`` rows of
    the set's pool is partitioned, so clients hold ``data.prompts-per-client`` prompts on average.
    """
    from fedopd.data.partition import partition_pool, sample_pool

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
    from fedopd.data.partition import demand, heldout_allocation, mix, take_heldout

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
    from fedopd.data.prompt_files import heldout_pool

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
