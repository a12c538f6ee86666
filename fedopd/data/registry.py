"""Prompt sets by name (``data.name``): :data:`DATASETS`, and one client's rows of the configured set.

A new prompt set is one loader function and one :func:`register_dataset` line. The built-in sets:
``sandbox`` and ``math`` (every ``data.partitioner``), ``tiny-arith`` (``groups`` only) and
``prompts``, your own files or hub dataset (:mod:`fedopd.data.prompt_files`; ``iid``, ``dirichlet``,
``natural``). ``data.partitioner = 'groups'`` is each set's own fixed split (the paper's); the
others are Flower Datasets' partitioners over a seeded sample of the set's pool
(:mod:`fedopd.data.pools`). The run configuration (:mod:`fedopd.config`) validates ``data.name``
against this registry, from above it.

A row is a dict with at least ``problem`` and ``answer`` (the gold answer as a string).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from fedopd.core.settings import PARTITIONERS, DataSettings
from fedopd.data.hendrycks_math import check_math_groups, math_partitions
from fedopd.data.pools import heldout_partitions, partitions
from fedopd.data.tiny_arith import tiny_arith_partition


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


def _math_train(data, partition_id: int, num_partitions: int) -> list[dict]:
    if data.partitioner != "groups":
        return _partitioned(data, partition_id, num_partitions)
    check_math_groups(num_partitions)
    return list(math_partitions(data.path, data.prompts_per_client, data.seed)[partition_id])


register_dataset("sandbox", _sandbox_train, _sandbox_heldout, partitioners=PARTITIONERS)
register_dataset("tiny-arith", _tiny_arith_train)
register_dataset("math", _math_train, partitioners=PARTITIONERS)
register_dataset("prompts", _partitioned, _partitioned_heldout, partitioners=("iid", "dirichlet", "natural"))


def resolve_partitioner(data: DataSettings) -> DataSettings:
    """``data`` with ``partitioner = 'auto'`` replaced by its set's own first choice (``groups``
    for the built-in sets, ``iid`` for ``prompts``); a parsed run config has it resolved already,
    settings built by hand get it here."""
    if data.partitioner != "auto" or data.name not in DATASETS:
        return data
    return dataclasses.replace(data, partitioner=DATASETS[data.name].partitioners[0])


def partition_rows(data: DataSettings, partition_id: int, num_partitions: int) -> list[dict]:
    """The training rows of one client partition (the prompt set ``data.name``, :data:`DATASETS`)."""
    data = resolve_partitioner(data)
    return DATASETS[data.name].train_rows(data, partition_id, num_partitions)


def heldout_rows(data: DataSettings, partition_id: int, num_partitions: int, count: int) -> list[dict]:
    """The held-out rows of one client, never among any client's training prompts."""
    data = resolve_partitioner(data)
    loader = DATASETS[data.name].heldout_rows
    if loader is None:
        allowed = ", ".join(repr(n) for n, d in DATASETS.items() if d.heldout_rows is not None)
        raise ValueError(f"data.name = {data.name!r} has no held-out problems; allowed: {allowed}")
    return loader(data, partition_id, num_partitions, count)
