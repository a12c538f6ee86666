"""Checks of a prompt set before round 1, and what ``python -m fedopd.data describe`` prints and draws."""

from __future__ import annotations

from fedopd.core.settings import DataSettings
from fedopd.data.hendrycks_math import check_math_groups
from fedopd.data.registry import DATASETS


def check_prompt_set(data: DataSettings, num_partitions: int, heldout_count: int = 0, min_prompts: tuple[int, str] | None = None) -> None:
    """Load and validate the configured prompt set and partition, before round 1 (the ServerApp).

    Every partition must be non-empty (``natural``: one value of ``data.partition-by`` per
    partition); for ``data.name = 'prompts'`` every file must be readable with its columns and
    every gold answer parseable by math-verify. With ``heldout_count`` (``eval.prompts-per-client``
    when the run evaluates), every client must have held-out problems. With ``min_prompts`` =
    (n, why), every client must have at least n training prompts. Raises ``ValueError`` naming
    the run-config key. Cheap for the built-in sets (``math`` with ``groups`` is not loaded here).
    """
    from fedopd.data.registry import resolve_partitioner

    data = resolve_partitioner(data)
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
        check_math_groups(num_partitions)  # the clients load MATH; the server need not
        return
    if data.name == "prompts":
        from fedopd.data.prompt_files import check_gold_answers, eval_files, load_prompt_files

        check_gold_answers(load_prompt_files(data.path, data.split, data.problem_column, data.answer_column), data.answer_column)
        check_gold_answers(eval_files(data), data.answer_column)
    for pid in range(num_partitions):
        rows = prompt_set.train_rows(data, pid, num_partitions)
        if not rows:
            raise ValueError(f"data.name = {data.name!r}: client partition {pid} of {num_partitions} has no prompts")
        if min_prompts is not None and len(rows) < min_prompts[0]:
            raise ValueError(
                f"data.name = {data.name!r}: client partition {pid} of {num_partitions} has {len(rows)} prompts; {min_prompts[1]} "
                f"needs at least {min_prompts[0]}"
            )
    if heldout_count > 0 and prompt_set.heldout_rows is not None:
        for pid in range(num_partitions):
            if not prompt_set.heldout_rows(data, pid, num_partitions, heldout_count):
                raise ValueError(f"data.name = {data.name!r}: client partition {pid} of {num_partitions} has no held-out problems")


def describe(data: DataSettings, num_partitions: int, heldout_count: int = 0) -> str:
    """Each partition's size and mix over ``data.partition-by`` (and its held-out problems)."""
    from fedopd.data.registry import resolve_partitioner

    data = resolve_partitioner(data)
    from fedopd.data.partition import describe_partition

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
    from fedopd.data.registry import resolve_partitioner

    data = resolve_partitioner(data)
    import matplotlib

    matplotlib.use("Agg")
    from flwr_datasets.visualization import plot_label_distributions

    from fedopd.data.partition import LABEL, fixed_partitioner

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
