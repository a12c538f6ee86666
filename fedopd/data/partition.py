"""Client partitions of a prompt pool with Flower Datasets' partitioners, and held-out problems
that follow each client's mix.

``data.partitioner`` (other than ``groups``, the set's own fixed split in :mod:`fedopd.data`):

* ``iid``: :class:`~flwr_datasets.partitioner.IidPartitioner` on the pool shuffled with
  ``data.seed`` first (the partitioner cuts contiguous shards and does not shuffle; Flower's
  ``FederatedDataset`` shuffles first too): of ``n`` prompts over ``k`` clients, the first
  ``n mod k`` clients get ``n // k + 1``, the others ``n // k``;
* ``dirichlet``: :class:`~flwr_datasets.partitioner.DirichletPartitioner` over the column
  ``data.partition-by`` with ``data.dirichlet-alpha``, ``seed = data.seed``, no self-balancing and
  at least one prompt per client;
* ``natural``: :class:`~flwr_datasets.partitioner.NaturalIdPartitioner`, one client per value of
  ``data.partition-by`` (in sorted order).

Everything here works on lists of row dicts and returns indices or rows; which rows form the pool
is the prompt set's business (:mod:`fedopd.data`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from fedopd.core.settings import DataSettings

_SAMPLE_SALT = 1  # the seeded sample (and shuffle) of the pool
LABEL = "label"  # the column the partitioners read (the values of data.partition-by, as strings)


def allocate(sizes: Sequence[int], total: int) -> list[int]:
    """Proportional allocation of ``total`` over strata of ``sizes`` (largest remainder).

    Ties in the remainder go to the lower index.
    """
    n = sum(sizes)
    exact = [total * s / n for s in sizes]
    counts = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_pool(rows: Sequence[dict], size: int, seed: int) -> list[dict]:
    """A seeded sample of at most ``size`` rows, in a seeded random order (the pool's shuffle)."""
    order = np.random.default_rng([seed, _SAMPLE_SALT]).permutation(len(rows))[:size]
    return [rows[int(i)] for i in order]


def labels_of(rows: Sequence[Mapping], partition_by: str, source: str) -> list[str]:
    """The ``partition_by`` value of every row, as a string; a clear error when rows lack it."""
    missing = [i for i, r in enumerate(rows) if r.get(partition_by) is None]
    if missing:
        columns = sorted({k for r in rows[:100] for k in r})
        raise ValueError(
            f"data.partition-by = {partition_by!r} is not a column of {source} ({len(missing)} of {len(rows)} rows "
            f"lack it, e.g. row {missing[0] + 1}); its columns: {', '.join(columns)}"
        )
    return [str(r[partition_by]) for r in rows]


def _dataset(labels: Sequence[str] | None, n: int):
    from datasets import Dataset

    columns: dict[str, list] = {"index": list(range(n))}
    if labels is not None:
        columns[LABEL] = list(labels)
    return Dataset.from_dict(columns)


def make_partitioner(partitioner: str, num_partitions: int, *, alpha: float, seed: int):
    """The Flower Datasets partitioner of ``data.partitioner`` (over the column :data:`LABEL`)."""
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

    if partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by=LABEL,
            alpha=float(alpha),
            min_partition_size=1,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    if partitioner == "natural":
        return NaturalIdPartitioner(partition_by=LABEL)
    raise ValueError(f"data.partitioner = {partitioner!r} is not a Flower Datasets partitioner; allowed: 'iid', 'dirichlet', 'natural'")


def partition_indices(
    size: int,
    labels: Sequence[str] | None,
    num_partitions: int,
    partitioner: str,
    *,
    partition_by: str,
    alpha: float,
    seed: int,
    source: str,
) -> list[list[int]]:
    """Indices into a pool of ``size`` rows for each of ``num_partitions`` partitions, all non-empty.

    ``labels`` are the pool's ``data.partition-by`` values (None: ``iid`` on a pool without that
    column). Raises ``ValueError`` naming the run-config keys when the partitioner cannot give
    every client a prompt, or ``natural`` finds a number of values other than ``num_partitions``.
    """
    if num_partitions < 1:
        raise ValueError(f"num-partitions = {num_partitions} must be at least 1")
    if labels is None and partitioner != "iid":
        raise ValueError(f"data.partitioner = {partitioner!r} needs data.partition-by = {partition_by!r} in every row of {source}")
    if size < num_partitions:
        raise ValueError(
            f"the pool of {source} has {size} prompts, fewer than num-partitions = {num_partitions}: "
            f"raise data.prompts-per-client or lower num-partitions"
        )
    if partitioner == "natural":
        values = sorted(set(labels))
        if len(values) != num_partitions:
            raise ValueError(
                f"data.partitioner = 'natural' gives one partition per value of data.partition-by = {partition_by!r}: "
                f"{source} has {len(values)} ({', '.join(values[:12])}{', ...' if len(values) > 12 else ''}), "
                f"but num-partitions is {num_partitions}"
            )
    flwr_partitioner = make_partitioner(partitioner, num_partitions, alpha=alpha, seed=seed)
    flwr_partitioner.dataset = _dataset(labels, size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Dirichlet partitioner warns on each of its re-draws
            parts = [list(flwr_partitioner.load_partition(i)["index"]) for i in range(num_partitions)]
    except ValueError as err:
        if partitioner != "dirichlet":
            raise
        raise ValueError(
            f"data.partitioner = 'dirichlet' with data.dirichlet-alpha = {alpha} left a client without prompts "
            f"in every draw: {size} prompts of {source} over {len(set(labels))} values of data.partition-by = "
            f"{partition_by!r} for num-partitions = {num_partitions} ({err}); raise data.dirichlet-alpha or "
            f"data.prompts-per-client, or lower num-partitions"
        ) from None
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise ValueError(
            f"data.partitioner = {partitioner!r} gives partition {empty[0]} no prompt ({size} prompts of {source} "
            f"for num-partitions = {num_partitions})"
        )
    return parts


def partition_pool(pool: Sequence[dict], num_partitions: int, data: DataSettings, source: str) -> list[list[dict]]:
    """The rows of each client: ``pool`` partitioned by ``data.partitioner`` (``iid``, ``dirichlet``,
    ``natural``) with ``data.partition-by``, ``data.dirichlet-alpha`` and ``data.seed``.

    ``data`` is the run config's ``DataSettings``; ``source`` names the pool in error messages.
    ``iid`` needs no ``data.partition-by`` column; the others need it in every row.
    """
    by = data.partition_by
    needs_labels = data.partitioner != "iid" or all(r.get(by) is not None for r in pool)
    labels = labels_of(pool, by, source) if needs_labels else None
    parts = partition_indices(
        len(pool),
        labels,
        num_partitions,
        data.partitioner,
        partition_by=by,
        alpha=data.dirichlet_alpha,
        seed=data.seed,
        source=source,
    )
    return [[pool[int(i)] for i in part] for part in parts]


def mix(rows: Sequence[Mapping], partition_by: str) -> dict[str, int]:
    """How many rows have each value of ``partition_by`` (rows without it are left out)."""
    return dict(sorted(Counter(str(r[partition_by]) for r in rows if r.get(partition_by) is not None).items()))


def heldout_allocation(mixes: Sequence[Mapping[str, int]], count: int, available: Mapping[str, int]) -> list[dict[str, int]]:
    """Per client, how many of its ``count`` held-out problems come from each value.

    Client i's problems follow its training mix ``mixes[i]`` over the values that have held-out
    problems (``available``: value -> pool size), by largest remainder (:func:`allocate`,
    values in sorted order). A client whose values have no held-out problem draws from the whole
    pool in the pool's own proportions.
    """
    out = []
    for client_mix in mixes:
        keys = sorted(v for v, n in client_mix.items() if n > 0 and available.get(v, 0) > 0)
        weights = [client_mix[v] for v in keys]
        if not keys:
            keys = sorted(v for v, n in available.items() if n > 0)
            weights = [available[v] for v in keys]
        out.append(dict(zip(keys, allocate(weights, count))) if keys else {})
    return out


def demand(allocations: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """How many held-out problems of each value all clients together ask for."""
    total: Counter = Counter()
    for alloc in allocations:
        total.update(alloc)
    return dict(sorted(total.items()))


def take_heldout(allocations: Sequence[Mapping[str, int]], pools: Mapping[str, Sequence[dict]]) -> list[list[dict]]:
    """Each client's held-out rows: consecutive slices of each value's pool, client after client.

    Disjoint between clients while a pool holds the total demand; past that, slices wrap around
    the pool. A client never holds a problem twice (at most the pool's size of one value).
    """
    offsets: Counter = Counter()
    out = []
    for alloc in allocations:
        rows: list[dict] = []
        for value in sorted(alloc):
            pool = pools.get(value, ())
            n = min(alloc[value], len(pool))
            rows += [pool[(offsets[value] + j) % len(pool)] for j in range(n)]
            offsets[value] += n
        out.append(rows)
    return out


def describe_partition(rows: Sequence[Mapping], partition_by: str) -> str:
    """``'N prompts; <partition-by>: a 3 (60.0%), b 2 (40.0%)'``."""
    counts = mix(rows, partition_by)
    text = f"{len(rows)} prompt{'' if len(rows) == 1 else 's'}"
    if not rows:
        return text
    if counts:
        total = sum(counts.values())
        text += f"; {partition_by}: " + ", ".join(f"{v} {n} ({100 * n / total:.1f}%)" for v, n in counts.items())
    else:
        text += f"; no column {partition_by!r}"
    return text


def fixed_partitioner(parts: Sequence[Sequence[Mapping]], partition_by: str):
    """A Flower Datasets ``Partitioner`` that serves precomputed partitions (for its plots).

    Its dataset holds the ``partition_by`` value (as :data:`LABEL`) of every row, partition
    after partition.
    """
    from flwr_datasets.partitioner import Partitioner

    labels = [str(r.get(partition_by)) for p in parts for r in p]
    bounds = np.cumsum([0] + [len(p) for p in parts]).tolist()

    class _Fixed(Partitioner):
        def load_partition(self, partition_id: int):
            return self.dataset.select(range(bounds[partition_id], bounds[partition_id + 1]))

        @property
        def num_partitions(self) -> int:
            return len(parts)

    fixed = _Fixed()
    fixed.dataset = _dataset(labels, len(labels))
    return fixed
