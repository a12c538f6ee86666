"""A SuperNode's own prompts, named in its node config: the server never names a file on a client.

In a deployment each host holds its own private prompt file. Its operator names it when starting
the SuperNode (``flower-supernode --node-config 'data-path="/data/ours.jsonl" ...'``):

======================  ============  =====================================================
node config key         default       meaning
======================  ============  =====================================================
``data-path``           (none)        a JSONL, JSON, Parquet or CSV file, a folder of them, or
                                      a hub dataset id: this node's training prompts
``data-split``          ``train``     the split of a hub ``data-path``
``problem-column``      ``problem``   the problem text
``answer-column``       ``answer``    the gold answer (plain, or a solution whose last
                                      ``\\boxed{}`` is the answer)
``eval-path``           ``""``        this node's held-out problems; ``""``: a seeded one-in-five
                                      split of ``data-path`` (seed ``data.seed``)
``eval-split``          ``""``        the split of a hub ``eval-path`` (``""``: ``data-split``)
======================  ============  =====================================================

Such a node reads its rows as ``data.name = "prompts"`` reads a file
(:mod:`fedopd.data.prompt_files`), as the one partition of its own set: a seeded sample of at most
``data.prompts-per-client`` problems (the run config's bound on its work), and at most
``eval.prompts-per-client`` held-out problems. Of the run config's ``data.*`` keys only
``data.max-prompt-tokens``, ``data.prompts-per-client`` and ``data.seed`` apply to it.

A node without ``data-path`` keeps the run config's data set, partitioned by ``partition-id`` (the
simulation's data sets). A deployment node (:func:`deployment_node`) without ``data-path`` reads
no data source the run config names (:func:`check_server_named_files`): only a built-in set, or
MATH from its own hub source.

Errors name the node config key. Their text stays in the node's log; the server's reply reason
names the key and the kind of problem only (:class:`fedopd.core.errors.LocalError`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from fedopd.core.errors import LocalError, RequestError
from fedopd.core.settings import DataSettings

# node config key -> (DataSettings field, the run-config key a file error names, default)
NODE_DATA_KEYS: dict[str, tuple[str, str, str]] = {
    "data-path": ("path", "data.path", ""),
    "data-split": ("split", "data.split", "train"),
    "problem-column": ("problem_column", "data.problem-column", "problem"),
    "answer-column": ("answer_column", "data.answer-column", "answer"),
    "eval-path": ("eval_path", "data.eval-path", ""),
    "eval-split": ("eval_split", "data.eval-split", ""),
}
DEPLOYMENT_RUNTIME = "flwr.supernode.runtime.run_clientapp"  # the module Flower's flwr-clientapp process runs (1.41, 1.42)
NONEMPTY = ("data-path", "data-split", "problem-column", "answer-column")
MAX_VALUE_CHARS = 4096


def _node_key(key: str) -> str:
    return f"node config {key!r}"


@dataclasses.dataclass(frozen=True)
class NodeData:
    """The prompt source a node's operator named (:data:`NODE_DATA_KEYS`)."""

    path: str
    split: str = "train"
    problem_column: str = "problem"
    answer_column: str = "answer"
    eval_path: str = ""
    eval_split: str = ""

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeData | None:
        """The node's own data, or None when its node config names none; a key of
        :data:`NODE_DATA_KEYS` without ``data-path``, or a value that is not a string (empty for
        :data:`NONEMPTY`), is refused naming the key."""
        given = [k for k in NODE_DATA_KEYS if k in node_config]
        if "data-path" not in node_config:
            if given:
                raise LocalError(f"{_node_key(given[0])} is set, but node config 'data-path' is not", _node_key(given[0]), "set without 'data-path'")
            return None
        values = {}
        for key in given:
            value = node_config[key]
            if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS or (key in NONEMPTY and not value.strip()):
                raise LocalError(
                    f"{_node_key(key)} = {value!r}: expected a{' non-empty' if key in NONEMPTY else ''} string (quoted in --node-config)",
                    _node_key(key),
                    "not a string" if not isinstance(value, str) else "empty or too long",
                )
            values[NODE_DATA_KEYS[key][0]] = value
        return cls(**values)

    def settings(self, data: DataSettings) -> DataSettings:
        """The run's data settings with this node's source in place of the run config's: one
        partition of its own prompts (``data.name = "prompts"``, ``iid``)."""
        fields = {field: getattr(self, field) for field, _, _ in NODE_DATA_KEYS.values()}
        return dataclasses.replace(data, name="prompts", partitioner="iid", **fields)


def in_node_terms(err: LocalError) -> LocalError:
    """A file error raised with the run-config keys (``data.path``...), in the node config's."""
    text, key = str(err), err.key
    for node_key, (_, run_key, _) in NODE_DATA_KEYS.items():
        text = text.replace(run_key, _node_key(node_key))
        if key == run_key:
            key = _node_key(node_key)
    return LocalError(text, key, err.kind)


def deployment_node(node_config: Mapping[str, Any]) -> bool:
    """A node of a deployment: one its operator set up for it (a resident worker, data of its own,
    or a state folder of its own), or any ClientApp that Flower's deployment runtime runs (the
    ``flwr-clientapp`` process, whatever its node config says: a SuperNode started with only
    ``partition-id`` and ``num-partitions`` is one too). Such a node reads no data source and no
    model folder the server names, and keeps its state under its own root. Only a simulation's
    nodes (Flower's simulation engine, or the in-process grid) share the server's machine and
    operator."""
    return (
        node_config.get("worker") == "resident"
        or "data-path" in node_config
        or bool(node_config.get("client-state-dir"))
        or DEPLOYMENT_RUNTIME in sys.modules
    )


def check_server_named_files(data: DataSettings, *, deployment: bool) -> None:
    """A deployment node without data of its own reads no data source the run config names
    (``data.path``, ``data.eval-path``): not a local file, and not a hub id either, since telling
    the two apart would mean looking at the host's files. A built-in set, or MATH from its
    default hub source (``data.path = ""``), is fine."""
    if not deployment:
        return
    for key, value in (("data.path", data.path), ("data.eval-path", data.eval_path)):
        if value:
            raise RequestError(
                f"the run config's {key} = {value[:200]!r} names a data source; a deployment node reads only the one its own "
                "node config names: 'data-path' (docs/deployment.md)"
            )
