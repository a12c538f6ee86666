"""Token batches of rollouts, and the teacher's next-token distributions on their responses.

A response position is a position whose next-token distribution predicts a response token: for a
prompt of length P and a response of length R these are sequence indices P−1 … P+R−2. Every
tensor "at response positions" is packed: (N, ·) with N the number of response tokens of the
batch, in row-major order of the (B, T) ``loss_mask``.

The teacher runs once per micro-batch, without gradients. What is kept between the teacher pass
and the loss is its final hidden state (width H, not V): the vocabulary projection happens chunk
by chunk inside the loss, so full teacher distributions (N × V) are never held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    """The prompt+response sequences of a micro-batch, right-padded or packed.

    Padded: input_ids, attention_mask (B, T) int64, ``position_ids`` None. Packed (padding-free):
    the sequences concatenated into one row, input_ids (1, ΣT), ``attention_mask`` None and
    ``position_ids`` (1, ΣT) restarting at 0 for each sequence. loss_mask: True at response
    positions, same shape as input_ids. Both layouts list the response positions in the same
    (sequence, position) order.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def hidden(self, model) -> torch.Tensor:
        """``model``'s final hidden states at this batch's response positions, (N, H)."""
        return model.hidden_states(self.input_ids, self.attention_mask, self.position_ids)[self.loss_mask]


def make_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> TokenBatch:
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(f"make_batch: {len(prompt_ids)} prompts for {len(response_ids)} responses")
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    loss = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, p, r) in enumerate(zip(seqs, prompt_ids, response_ids)):
        if not p:
            raise ValueError(f"make_batch: prompt {i} is empty")
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        loss[i, len(p) - 1 : len(p) - 1 + len(r)] = True
    return TokenBatch(ids.to(device), att.to(device), loss.to(device))


def make_packed_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> TokenBatch:
    """The sequences of :func:`make_batch` concatenated into one padding-free row."""
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(f"make_packed_batch: {len(prompt_ids)} prompts for {len(response_ids)} responses")
    ids, pos, loss = [], [], []
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if not p:
            raise ValueError(f"make_packed_batch: prompt {i} is empty")
        n = len(p) + len(r)
        ids.extend(list(p) + list(r))
        pos.extend(range(n))
        mask = [False] * n
        mask[len(p) - 1 : len(p) - 1 + len(r)] = [True] * len(r)
        loss.extend(mask)
    as_row = lambda values, dtype: torch.tensor([values], dtype=dtype).to(device)  # noqa: E731
    return TokenBatch(as_row(ids, torch.long), None, as_row(loss, torch.bool), as_row(pos, torch.long))


@torch.no_grad()
def teacher_hidden(teacher, batch: TokenBatch, max_rows: int | None = None) -> torch.Tensor:
    """The teacher's final hidden states at response positions, (N, H_teacher).

    ``max_rows`` sequences go through the teacher at a time (``model.teacher-batch``), so its
    activations fit beside the student and the rollout engine on one GPU.
    """
    if batch.packed:  # one padding-free row: nothing to slice
        return batch.hidden(teacher)
    rows = batch.input_ids.shape[0]
    step = max_rows or rows
    parts = []
    for i in range(0, rows, step):
        ids, att, mask = batch.input_ids[i : i + step], batch.attention_mask[i : i + step], batch.loss_mask[i : i + step]
        width = int(att.sum(-1).max())  # right padding: drop the all-pad tail of this slice
        parts.append(teacher.hidden_states(ids[:, :width], att[:, :width])[mask[:, :width]])
    return torch.cat(parts)


@torch.no_grad()
def teacher_log_probs(teacher, batch: TokenBatch) -> torch.Tensor:
    """The teacher's next-token log-distributions at response positions, (N, V) fp32.

    Materialises N × V values: for inspection and tests. Training uses :func:`teacher_hidden`.
    """
    return torch.log_softmax(teacher.logits(teacher_hidden(teacher, batch)).float(), dim=-1)
