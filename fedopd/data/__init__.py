"""Client prompts: the prompt sets by name and their partitions into clients, prompt rendering, the
per-round loader, held-out problems and answer grading. It imports only :mod:`fedopd.core` and the
sandbox's task; the run configuration validates ``data.name`` against :data:`DATASETS` from above.

- :mod:`~fedopd.data.registry`: :data:`DATASETS`, :func:`register_dataset`, one client's rows;
- :mod:`~fedopd.data.prompts`: rendering and tokenizing prompts, the per-round loader;
- :mod:`~fedopd.data.tiny_arith`, :mod:`~fedopd.data.hendrycks_math`, :mod:`~fedopd.data.prompt_files`: the sets;
- :mod:`~fedopd.data.partition`, :mod:`~fedopd.data.pools`: Flower Datasets' partitioners and what they split;
- :mod:`~fedopd.data.describe`: checks before round 1 and ``python -m fedopd.data describe``;
- :mod:`~fedopd.data.grading`: is a response's boxed answer the gold one (math-verify, in a subprocess).
"""

from fedopd.data.describe import check_prompt_set, describe, plot_partitions
from fedopd.data.hendrycks_math import MATH_CLIENT_GROUPS, MATH_CONFIGS, MATH_HUB_ID, clean_math_rows, load_math_rows, math_pool, partition_math
from fedopd.data.pools import heldout_partitions, partitions, sandbox_pool
from fedopd.data.prompts import INSTRUCTION, Prompt, encode_prompts, epoch_order, format_problem, render_prompt, round_indices
from fedopd.data.registry import DATASETS, PromptSet, heldout_rows, partition_rows, register_dataset
from fedopd.data.tiny_arith import TINY_ARITH_GROUPS, tiny_arith_group, tiny_arith_partition

__all__ = [
    "DATASETS",
    "INSTRUCTION",
    "MATH_CLIENT_GROUPS",
    "MATH_CONFIGS",
    "MATH_HUB_ID",
    "TINY_ARITH_GROUPS",
    "Prompt",
    "PromptSet",
    "check_prompt_set",
    "clean_math_rows",
    "describe",
    "encode_prompts",
    "epoch_order",
    "format_problem",
    "heldout_partitions",
    "heldout_rows",
    "load_math_rows",
    "math_pool",
    "partition_math",
    "partition_rows",
    "partitions",
    "plot_partitions",
    "register_dataset",
    "render_prompt",
    "round_indices",
    "sandbox_pool",
    "tiny_arith_group",
    "tiny_arith_partition",
]
