"""The per-token divergence between the student's and the teacher's next-token distributions,
by name (``train.loss``).

``train.loss`` picks one by name from :data:`DIVERGENCES`; the chunked, checkpointed machinery
of :mod:`fedopd.distill.opd` evaluates it over every response position. Each function takes fp32 logits
(..., V) of the student and the teacher and returns the divergence per position (...), in nats.

- ``reverse_kl`` (the paper's, the default): KL(p_θ ‖ q), mode-seeking, the on-policy
  distillation objective of "Trapped by Their Own Rollouts".
- ``forward_kl``: KL(q ‖ p_θ), mode-covering.
- ``jsd``: the generalized Jensen-Shannon divergence of GKD (Agarwal et al., "On-Policy
  Distillation of Language Models: Learning from Self-Generated Mistakes", 2024) exactly as TRL's
  ``GKDTrainer.generalized_jsd_loss`` computes it: with M = β·q + (1 − β)·p_θ,
  JSD_β = β·KL(q ‖ M) + (1 − β)·KL(p_θ ‖ M); β = 0 is forward KL and β = 1 reverse KL (TRL's
  limits), β = ``train.loss-beta``.

The scoring cache's Ĵ and K̂ stay reverse-direction KLs whatever the training loss (the paper
defines them so): they live in :mod:`fedopd.distill.cache`, not here.

The LM head that produces those logits in fp32 is :func:`fedopd.models.head.fp32_head`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Divergence = Callable[..., torch.Tensor]


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """KL(softmax(student) ‖ softmax(teacher)) per position."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    return (s.exp() * (s - t)).sum(-1)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """KL(softmax(teacher) ‖ softmax(student)) per position."""
    return reverse_kl(teacher_logits, student_logits)


def jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalized JSD_β per position (GKD / TRL): β·KL(q ‖ M) + (1 − β)·KL(p_θ ‖ M), M = β·q + (1 − β)·p_θ."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"train.loss-beta = {beta} is outside [0, 1]")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits)
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    m = torch.logsumexp(torch.stack([s + math.log(1.0 - beta), t + math.log(beta)]), dim=0)
    kl_teacher = (t.exp() * (t - m)).sum(-1)
    kl_student = (s.exp() * (s - m)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


DIVERGENCES: dict[str, Divergence] = {"reverse_kl": reverse_kl, "forward_kl": forward_kl, "jsd": jsd}
