"""The LM head in fp32: :func:`fp32_head` (TF32 tensor cores for a half-precision model on CUDA);
:meth:`fedopd.models.CausalLM.logits` calls it and the OPD loss reads its logits.

A half-precision head is never copied to fp32 whole: its rows are upcast :data:`HEAD_BLOCK_BYTES`
at a time (the teacher's 151,936 × 4,096 head would otherwise take a 2.3 GiB fp32 copy on every
call, forward and backward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# The fp32 copy of one block of head rows (bytes): 4,096 rows of a 4,096-wide head, 16,384 of a
# 1,024-wide one. Large enough that each block's matmul keeps the GPU busy, small beside the
# logits themselves (positions × 151,936 × 4 B).
HEAD_BLOCK_BYTES = 64 * 2**20


def head_block_rows(width: int) -> int:
    """Rows of a head of ``width`` (hidden size) upcast to fp32 at a time."""
    return max(1, HEAD_BLOCK_BYTES // (4 * int(width)))


@contextmanager
def _tf32_matmuls(enabled: bool) -> Iterator[None]:
    """TF32 tensor-core matmuls inside (CUDA), restored afterwards. Through
    ``torch.set_float32_matmul_precision``, which keeps torch's two TF32 APIs consistent (setting
    only ``matmul.fp32_precision`` makes every query of the legacy ``allow_tf32`` raise until it is
    restored; setting ``allow_tf32`` is refused by recent torch once the new API was used)."""
    if not enabled:
        yield
        return
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _blocked_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden.float() @ weight.float()ᵀ (+ bias)`` with the weight upcast a block of rows at a time."""
    rows = head_block_rows(weight.shape[1])
    h = hidden.float()
    out = h.new_empty((*h.shape[:-1], weight.shape[0]))
    for i in range(0, weight.shape[0], rows):
        block = slice(i, i + rows)
        out[..., block] = F.linear(h, weight[block].float(), None if bias is None else bias[block].float())
    return out


def _blocked_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ weight.float()`` (fp32), the weight upcast a block of rows at a time."""
    rows = head_block_rows(weight.shape[1])
    out = grad.new_zeros((*grad.shape[:-1], weight.shape[1]), dtype=torch.float32)
    for i in range(0, weight.shape[0], rows):
        out += grad[..., i : i + rows].float() @ weight[i : i + rows].float()
    return out


class _FP32Head(torch.autograd.Function):
    """``hidden @ weightᵀ (+ bias)`` with an fp32 output, for a frozen head (no weight gradient).

    bf16 and fp16 values are exactly representable in TF32 (8 exponent, 10 mantissa bits), so for a
    half-precision model on CUDA the forward runs on TF32 tensor cores with fp32 accumulation and
    gives the logits of an fp32 matmul of the same values, several times faster (docs/performance.md: loss
    benchmark). The backward, whose incoming gradient is fp32, uses TF32 as well: it feeds a
    half-precision backward pass. A half-precision head is upcast a block of rows at a time, in
    both passes; an fp32 head (the CPU path) is used as it is.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        half = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
        ctx.save_for_backward(weight)
        ctx.half, ctx.hidden_dtype = half, hidden.dtype
        with _tf32_matmuls(half):
            if weight.dtype == torch.float32:
                return F.linear(hidden.float(), weight, None if bias is None else bias.float())
            return _blocked_linear(hidden, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        with _tf32_matmuls(ctx.half):
            grad_hidden = grad.float() @ weight if weight.dtype == torch.float32 else _blocked_grad(grad, weight)
        return grad_hidden.to(ctx.hidden_dtype), None, None


def fp32_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Logits in fp32 from hidden states (..., H) and a frozen head weight (V, H): see :class:`_FP32Head`."""
    return _FP32Head.apply(hidden, weight, bias)
