"""The per-token divergence between the student's and the teacher's next-token distributions,
and the fp32 LM head that produces the logits it reads.

``train.loss`` picks one by name from :data:`DIVERGENCES`; the chunked, checkpointed machinery
of :mod:`fedopd.opd` evaluates it over every response position. Each function takes fp32 logits
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
defines them so): they live in :mod:`fedopd.cache`, not here.

:func:`fp32_head` is the LM head in fp32 (TF32 tensor cores for a half-precision model on CUDA);
:meth:`fedopd.models.CausalLM.logits` calls it, and :mod:`fedopd.models` re-exports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


# ---------------------------------------------------------------------------------------------
# The fp32 LM head
# ---------------------------------------------------------------------------------------------


@contextmanager
def _tf32_matmuls(enabled: bool) -> Iterator[None]:
    """TF32 tensor-core matmuls inside (CUDA), restored afterwards."""
    if not enabled:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


class _FP32Head(torch.autograd.Function):
    """``hidden @ weightᵀ (+ bias)`` with an fp32 output, for a frozen head (no weight gradient).

    bf16 and fp16 values are exactly representable in TF32 (8 exponent, 10 mantissa bits), so for a
    half-precision model on CUDA the forward runs on TF32 tensor cores with fp32 accumulation and
    gives the logits of an fp32 matmul of the same values, several times faster (docs/performance.md: loss
    benchmark). The backward, whose incoming gradient is fp32, uses TF32 as well: it feeds a
    half-precision backward pass. fp32 models (the CPU path) compute in plain fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        half = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
        ctx.save_for_backward(weight)
        ctx.half, ctx.hidden_dtype = half, hidden.dtype
        with _tf32_matmuls(half):
            return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        with _tf32_matmuls(ctx.half):
            grad_hidden = grad.float() @ weight.float()
        return grad_hidden.to(ctx.hidden_dtype), None, None


def fp32_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Logits in fp32 from hidden states (..., H) and a frozen head weight (V, H): see :class:`_FP32Head`."""
    return _FP32Head.apply(hidden, weight, bias)
