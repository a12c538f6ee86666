"""The LM head in fp32: :func:`fp32_head` (TF32 tensor cores for a half-precision model on CUDA);
:meth:`fedopd.models.CausalLM.logits` calls it and the OPD loss reads its logits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F


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
