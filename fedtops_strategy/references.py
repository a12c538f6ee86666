"""The paper's two reference methods as Flower strategies: Local and Centralized.

* :class:`LocalTraining` (``strategy.name = 'local'``): every client trains its own adapter from
  the shared initialisation for the whole run; nothing is averaged. The server keeps each
  client's latest adapter and sends it back to that client only, so the clients stay stateless
  about their adapter (as in deployment, where a fresh ClientApp serves each message). The run
  reports the mean over clients of their own adapters' scores ("Local mean").
* :class:`Centralized` (``strategy.name = 'centralized'``): one learner on the pooled prompts of
  all clients, with the combined rollouts per round of the clients the round samples and the same
  mini-batch (its train message says ``learner = 'centralized'`` and ``pooled-clients``; the
  ClientApp side: ``client_app/handlers.py``). The server trains one node, the sampled one with
  the smallest node id, and takes its adapter as the global one (a = 1).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedopd.models.lora import Named
from fedtops_strategy.base import ServerStrategy
from fedtops_strategy.round import ScoreRows, Step, TrainAggregate, TrainRound

POOLED_CLIENTS = "pooled-clients"  # Centralized's train config: whose rollouts per round it takes


class LocalTraining(ServerStrategy):
    """Independent Local training: each client keeps its own adapter, nothing is averaged."""

    strategy_name = "local"
    learner = "local"
    averages_factors = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # cross-round: Local's models, one per client
        self.client_arrays: dict[int, ArrayRecord] = {}  # node id -> its latest adapter
        self.partitions: dict[int, int] = {}  # node id -> partition id

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        return [self._own(m, arrays) for m in messages]

    def _own(self, message: Message, initial: ArrayRecord) -> Message:
        """The same message with the destination client's own adapter (the initial one at first)."""
        node = message.metadata.dst_node_id
        content = RecordDict({key: value for key, value in message.content.items()})
        content["arrays"] = self.client_arrays.get(node, initial)
        return Message(content=content, message_type=message.metadata.message_type, dst_node_id=node, group_id=message.metadata.group_id)

    def aggregate_train(self, sent: TrainRound, replies: Iterable[Message]) -> TrainAggregate:
        """The round's checked replies; nothing is averaged."""
        kept, excluded, notes = self.screen(sent, replies)
        return TrainAggregate(sent, kept, excluded, {r.node_id: float(r.num_examples) for r in kept}, None, None, notes=notes)

    def step(self, train: TrainAggregate, scores: ScoreRows | None) -> Step:
        """Keep each checked reply's adapter as its node's own (by node id, from the metadata), and
        the partition it last claimed without dispute as its label; no global step (θ_t stays,
        which nobody uses)."""
        for reply in train.kept:
            if reply.partition_id is not None:  # a disputed claim came back without it: the label stays
                self.partitions[reply.node_id] = reply.partition_id
            self.client_arrays[reply.node_id] = ArrayRecord({k: Array(np.asarray(v)) for k, v in reply.arrays.items()})
        return Step(train.theta, None)

    def evaluation_arrays(self, node_id: int, global_arrays: ArrayRecord) -> ArrayRecord:
        return self.client_arrays.get(node_id, global_arrays)

    def client_adapters(self) -> dict[int | str, Named]:
        """Each client's latest adapter (named fp32 arrays) by its folder label: the partition id it
        claimed (its node id if it never sent one), or ``node-<node id>`` while another node's
        label is the same partition (a claim the server cannot verify never overwrites another
        node's adapter)."""
        labels = {n: self.partitions.get(n, n) for n in self.client_arrays}
        taken = [label for label in labels.values()]
        out: dict[int | str, Named] = {}
        for n, arrays in sorted(self.client_arrays.items()):
            label = labels[n] if taken.count(labels[n]) == 1 else f"node-{n}"
            out[label] = {k: v.numpy() for k, v in arrays.items()}
        return out


class Centralized(ServerStrategy):
    """One learner on the pooled prompts; its adapter becomes the global one."""

    strategy_name = "centralized"
    learner = "centralized"
    averages_factors = False  # one learner: nothing is averaged

    def aggregate_train(self, sent: TrainRound, replies: Iterable[Message]) -> TrainAggregate:
        """The one learner's checked adapter (None: no valid update, the round holds)."""
        kept, excluded, notes = self.screen(sent, replies)
        mean = kept[0].arrays if kept else None
        return TrainAggregate(sent, kept, excluded, {kept[0].node_id: 1.0} if kept else {}, mean, None, notes=notes)

    def step(self, train: TrainAggregate, scores: ScoreRows | None) -> Step:
        """The one learner's adapter is the global one (a = 1); none: the round holds."""
        if train.mean is None:
            return Step(train.theta, 0.0, {"hold-reason": "no valid client update"})
        return Step(train.mean, 1.0)

    def prepare_messages(self, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        """One train message, to the sampled node with the smallest id; its config asks for the
        rollouts of every sampled client (``pooled-clients``)."""
        first = sorted(messages, key=lambda m: m.metadata.dst_node_id)[0]
        content = RecordDict({key: value for key, value in first.content.items()})
        config = ConfigRecord(dict(first.content["config"]))
        config[POOLED_CLIENTS] = len(messages)
        content["config"] = config
        return [
            Message(
                content=content, message_type=first.metadata.message_type, dst_node_id=first.metadata.dst_node_id, group_id=first.metadata.group_id
            )
        ]
