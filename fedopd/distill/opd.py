"""Local on-policy distillation: the exact per-token loss and the client's optimisation loop.

The loss at a response position h is a divergence D(p_θ(·|h), q(·|h)) over the full vocabulary,
from fp32 logits, averaged over the response tokens of a mini-batch (token mean). D is
``train.loss`` (:data:`fedopd.distill.loss.DIVERGENCES`, with β = ``train.loss-beta``): by default the
paper's reverse KL(p_θ ‖ q). It is computed in chunks of positions, so that at most one chunk of
fp32 (positions × vocabulary) intermediates is alive at a time. When the student's head is frozen
(LoRA never adapts it), each chunk's gradient with respect to the student's hidden states is taken
in the forward pass itself (:class:`_FusedDivergenceSum`, as Liger-Kernel's fused linear losses
do): neither head runs again in the backward pass, and the teacher's logits never enter autograd.

The loop is written out nanoGPT-style: one epoch over the round's rollouts, mini-batches of
``train.mini-batch`` rollouts (one AdamW step each) accumulated from micro-batches of
``train.micro-batch``, gradient-norm clipping, and a cosine learning rate without warmup over the
run's total local steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

# token_reverse_kl, KL(softmax(student) ‖ softmax(teacher)) per position, is re-exported from here.
from fedopd.distill.loss import DIVERGENCES, Divergence
from fedopd.distill.loss import reverse_kl as token_reverse_kl
from fedopd.distill.teacher import TokenBatch, make_batch, make_packed_batch, teacher_hidden

DEFAULT_CHUNK = 1024

# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def training_divergence(settings) -> tuple[Divergence, float]:
    """The per-token divergence ``train.loss`` and its β ``train.loss-beta`` of a :class:`TrainSettings`."""
    if settings.loss not in DIVERGENCES:
        raise ValueError(f"train.loss = {settings.loss!r} is not one of {', '.join(map(repr, DIVERGENCES))}")
    return DIVERGENCES[settings.loss], settings.loss_beta


def _chunked_sum(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], chunk_size: int) -> torch.Tensor:
    """Σ over chunks of rows of ``fn(*chunk)``, each chunk checkpointed when gradients flow."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = tensors[0].shape[0]
    total = tensors[0].new_zeros((), dtype=torch.float32)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    for i in range(0, n, chunk_size):
        parts = [t[i : i + chunk_size] for t in tensors]
        total = total + (checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts))
    return total


def divergence_mean(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    divergence: Divergence = token_reverse_kl,
    beta: float = 0.5,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Token mean over ``mask == 1`` of ``divergence(student, teacher, beta)``.

    Shapes (B, T, V), (B, T, V), (B, T). Returns a scalar; 0 when the mask is empty.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.shape[:-1] != mask.shape:
        name = getattr(divergence, "__name__", "divergence")
        raise ValueError(f"{name}: shapes {tuple(student_logits.shape)}, {tuple(teacher_logits.shape)}, {tuple(mask.shape)}")
    v = student_logits.shape[-1]
    m = mask.reshape(-1).to(torch.float32)

    def chunk_loss(s, t, w):
        return (divergence(s, t, beta) * w).sum()

    total = _chunked_sum(chunk_loss, [student_logits.reshape(-1, v), teacher_logits.reshape(-1, v), m], chunk_size)
    return total / m.sum().clamp_min(1.0)


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Token mean over ``mask == 1`` of KL(softmax(student) ‖ softmax(teacher)).

    Shapes (B, T, V), (B, T, V), (B, T). Returns a scalar; 0 when the mask is empty.
    """
    return divergence_mean(student_logits, teacher_logits, mask, token_reverse_kl, chunk_size=chunk_size)


class _FusedDivergenceSum(torch.autograd.Function):
    """Σ over positions of ``divergence(student_head(hs), teacher_head(ht), beta)``, whose gradient
    with respect to ``hs`` is computed chunk by chunk in the forward pass and kept (N × H_s, the
    hidden states' dtype) for the backward, which only scales it.

    Valid for a loss that is a sum of this value (nothing but ``hs`` carries a gradient through
    the heads: the student's head is frozen). ``seed`` is the gradient the caller's backward is
    expected to bring (1 / the mini-batch's tokens): each chunk's gradient is taken with that
    seed, so the result is bit for bit the gradient of the checkpointed computation; any other
    incoming gradient rescales it.
    """

    @staticmethod
    def forward(ctx, hs, ht, student_head, teacher_head, divergence, beta, chunk_size, seed):
        total = hs.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(hs)
        for i in range(0, hs.shape[0], chunk_size):
            with torch.no_grad():
                teacher_logits = teacher_head(ht[i : i + chunk_size])
            with torch.enable_grad():
                h = hs[i : i + chunk_size].detach().requires_grad_(True)
                loss = divergence(student_head(h), teacher_logits, beta).sum()
                (grad[i : i + chunk_size],) = torch.autograd.grad(loss, h, grad_outputs=seed)
            total = total + loss.detach()
        ctx.save_for_backward(grad, seed)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad, seed = ctx.saved_tensors
        if not torch.equal(grad_output, seed):
            grad = (grad.float() * (grad_output / seed)).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def divergence_sum_from_hidden(
    student_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_hidden: torch.Tensor,
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    divergence: Divergence = token_reverse_kl,
    beta: float = 0.5,
    chunk_size: int = DEFAULT_CHUNK,
    *,
    fused_scale: float | None = None,
) -> torch.Tensor:
    """Σ over N positions of ``divergence(student logits, teacher logits, beta)``, from packed
    hidden states (N, H_s) and (N, H_t).

    The heads run one chunk of positions at a time, so memory is O(N·H + chunk·V), never O(N·V).
    ``fused_scale`` (the factor the caller multiplies the sum by, 1 / tokens; only for a frozen
    student head): the gradient is taken in the forward pass (:class:`_FusedDivergenceSum`);
    otherwise each chunk is checkpointed and recomputed in the backward pass.
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"{student_hidden.shape[0]} student positions vs {teacher_hidden.shape[0]} teacher positions")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if fused_scale is not None and torch.is_grad_enabled() and student_hidden.requires_grad:
        seed = torch.ones((), dtype=torch.float32, device=student_hidden.device) * fused_scale
        return _FusedDivergenceSum.apply(student_hidden, teacher_hidden, student_head, teacher_head, divergence, beta, chunk_size, seed)

    def chunk_loss(hs, ht):
        return divergence(student_head(hs), teacher_head(ht), beta).sum()

    return _chunked_sum(chunk_loss, [student_hidden, teacher_hidden], chunk_size)


def reverse_kl_sum_from_hidden(
    student_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_hidden: torch.Tensor,
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Σ over N positions of the reverse KL: :func:`divergence_sum_from_hidden` with KL(p_θ ‖ q)."""
    return divergence_sum_from_hidden(student_hidden, student_head, teacher_hidden, teacher_head, token_reverse_kl, chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# Optimizer state across rounds
# ---------------------------------------------------------------------------------------------


def make_optimizer(params: Sequence[torch.nn.Parameter], settings) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay, eps=1e-8)


def optimizer_state_to_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """AdamW moments and step counts as numpy arrays keyed ``"<param index>.<name>"``."""
    out = {}
    for idx, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{idx}.{name}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, arrays: dict[str, np.ndarray]) -> None:
    """Inverse of :func:`optimizer_state_to_arrays` for an optimizer over the same parameters."""
    current = optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = torch.from_numpy(np.array(value))
    num_params = sum(len(g["params"]) for g in current["param_groups"])
    if state and max(state) >= num_params:
        raise ValueError(f"optimizer state covers {max(state) + 1} parameters, the adapter has {num_params}")
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def cosine_lr(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine decay from ``base_lr`` (step 0) towards 0 (step ``total_steps``), no warmup."""
    progress = min(max(step, 0), total_steps) / max(total_steps, 1)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# The local loop
# ---------------------------------------------------------------------------------------------


_CHECKPOINTING_FLAG = "_fedtops_activation_checkpointing"


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in backward (transformers 5 name, falling back to 4.x's).

    Idempotent: enabling registers hooks on the model, so it happens once per model (process),
    not once per round.
    """
    if getattr(model, _CHECKPOINTING_FLAG, False):
        return
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    setattr(model, _CHECKPOINTING_FLAG, True)


@dataclass
class OPDResult:
    arrays: dict[str, np.ndarray]  # θ_{t,i}^+, named factors
    optimizer_state: dict[str, np.ndarray]
    metrics: dict[str, float]


def micro_batches(num_rollouts: int, mini_batch: int, micro_batch: int, lengths: Sequence[int] | None = None) -> list[list[list[int]]]:
    """Rollout indices grouped as mini-batches of micro-batches (one epoch).

    Mini-batches are consecutive rollouts, in order: one optimizer step each. ``lengths`` (each
    rollout's prompt + response tokens): within a mini-batch, micro-batches of rollouts of similar
    length (sorted by length, stably), which pads the least of any split into micro-batches of
    these sizes; the mini-batch's token-mean loss and its gradient are the same sums over the same
    tokens, in another order. None: micro-batches in rollout order.
    """
    if mini_batch % micro_batch:
        raise ValueError(f"train.mini-batch = {mini_batch} is not a multiple of train.micro-batch = {micro_batch}")
    if lengths is not None and len(lengths) != num_rollouts:
        raise ValueError(f"micro_batches: {len(lengths)} lengths for {num_rollouts} rollouts")
    minis = [list(range(s, min(s + mini_batch, num_rollouts))) for s in range(0, num_rollouts, mini_batch)]
    if lengths is not None:
        minis = [sorted(m, key=lambda i: lengths[i]) for m in minis]
    return [[m[i : i + micro_batch] for i in range(0, len(m), micro_batch)] for m in minis]


def round_plan(rollouts, settings) -> list[list[list[int]]]:
    """The epoch's micro-batches for these rollouts under a :class:`TrainSettings`
    (``train.mini-batch``, ``train.micro-batch``), grouped by length (:func:`micro_batches`)."""
    return micro_batches(len(rollouts), settings.mini_batch, settings.micro_batch, sequence_lengths(rollouts))


def sequence_lengths(rollouts) -> list[int]:
    """Each rollout's prompt + response tokens: the row it takes in a padded micro-batch."""
    return [len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]


def padding_share(plan: list[list[list[int]]], lengths: Sequence[int]) -> float:
    """The share of a padded epoch's token slots that are padding: Σ (rows × longest row − Σ rows)
    over the micro-batches of ``plan``, over Σ rows × longest row."""
    slots = sum(len(idx) * max(lengths[i] for i in idx) for mini in plan for idx in mini)
    return 1.0 - sum(lengths) / slots if slots else 0.0


def hidden_in_rollout_order(hidden: dict[tuple[int, ...], torch.Tensor], response_lengths: Sequence[int]) -> torch.Tensor:
    """The per-micro-batch hidden states at response positions (keyed by rollout indices, each
    listing its rollouts' response positions in key order) as one (N, H) tensor in rollout order."""
    rows: dict[int, torch.Tensor] = {}
    for key, h in hidden.items():
        for i, part in zip(key, torch.split(h, [int(response_lengths[i]) for i in key])):
            rows[i] = part
    if sorted(rows) != list(range(len(response_lengths))):
        raise ValueError(f"hidden states for rollouts {sorted(rows)}, expected 0..{len(response_lengths) - 1}")
    return torch.cat([rows[i] for i in range(len(response_lengths))])


def minibatch_gradient(
    student,
    teacher,
    micro: Sequence[TokenBatch],
    hidden: Sequence[torch.Tensor],
    chunk: int,
    divergence: Divergence = token_reverse_kl,
    beta: float = 0.5,
) -> float:
    """Accumulate into ``.grad`` the gradient of one mini-batch's loss and return the loss.

    The loss is the token mean over the *whole* mini-batch: every micro-batch's summed
    divergence (``train.loss``, default the reverse KL) is divided by the mini-batch's token
    count, so micro-batches of unequal length weigh by their tokens, not equally.
    """
    if student.head_trainable():
        raise ValueError(
            f"the student's LM head takes gradients (lora.target-modules = {list(student.lora_config.target_modules)!r}, or tied "
            "trainable embeddings): the OPD loss computes it in fp32 as a frozen head and would train it nothing; "
            "leave lm_head and the embeddings out of lora.target-modules"
        )
    tokens = max(sum(b.num_tokens for b in micro), 1)
    scale = float(torch.ones(()) / tokens)  # 1 / tokens as autograd computes it for the division below (an fp32 scalar)
    loss_sum = 0.0
    for b, th in zip(micro, hidden):
        hs = b.hidden(student)
        loss = divergence_sum_from_hidden(hs, student.logits, th, teacher.logits, divergence, beta, chunk, fused_scale=scale) / tokens
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def optimizer_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], lr: float, grad_clip: float) -> None:
    """Clip the gradient norm to ``grad_clip``, set the learning rate, step, clear gradients."""
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def mean_divergence(
    student,
    teacher,
    batches: Sequence[TokenBatch],
    hidden: Sequence[torch.Tensor],
    chunk: int,
    divergence: Divergence = token_reverse_kl,
    beta: float = 0.5,
) -> float:
    """Token mean of ``divergence`` over all batches (no gradients)."""
    total, tokens = 0.0, 0
    for batch, th in zip(batches, hidden):
        hs = batch.hidden(student)
        total += float(divergence_sum_from_hidden(hs, student.logits, th, teacher.logits, divergence, beta, chunk))
        tokens += batch.num_tokens
    return total / max(tokens, 1)


def mean_reverse_kl(student, teacher, batches: Sequence[TokenBatch], hidden: Sequence[torch.Tensor], chunk: int) -> float:
    """Token mean of the reverse KL over all batches (no gradients)."""
    return mean_divergence(student, teacher, batches, hidden, chunk, token_reverse_kl)


# A packed row (attention_mask None, position ids restarting at 0 per sequence) keeps its
# sequences apart under SDPA / eager attention only through the block-diagonal mask that
# transformers derives from the restarting position ids (masking_utils.find_packed_sequence_indices,
# applied in create_causal_mask). transformers 4.54-4.57 apply it only with torch >= 2.6
# (`if packed_sequence_mask is not None and _is_torch_greater_or_equal_than_2_6`): with an older
# torch the row gets a plain causal mask and every sequence attends to the ones before it,
# silently. From transformers 5.0 on the mask is applied with any torch. Measured by
# tests/test_packing_isolation.py: isolated with 4.57.6 x torch 2.6.0 / 2.13.0, 5.0.0 / 5.3.0 /
# 5.15.1 x torch 2.5.1, 5.23.0 x torch 2.13.0; leaking with 4.57.1 / 4.57.6 x torch 2.5.1.
# flash-attention 2/3 take the varlen path (cu_seqlens from the position ids) instead.
_MASKED_ATTENTION = ("sdpa", "eager")


def packed_rows_isolated(attn_implementation: str, *, transformers_version: str | None = None, torch_version: str | None = None) -> tuple[bool, str]:
    """Whether packed rows keep their sequences apart under ``attn_implementation`` with the
    installed transformers and torch (or the versions given), and why, as a short sentence that
    names them. Implementations other than flash-attention, SDPA and eager are not verified: False."""
    from packaging.version import Version

    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    torch_version = torch_version or torch.__version__
    versions = f"transformers {transformers_version}, torch {torch_version}"
    if attn_implementation.startswith("flash_attention"):
        return True, f"{attn_implementation} runs packed rows through varlen kernels ({versions})"
    if attn_implementation not in _MASKED_ATTENTION:
        return False, f"packed rows are not verified to stay isolated under attention '{attn_implementation}' ({versions})"
    tf_new = Version(transformers_version).release[:1] >= (5,)
    torch_new = Version(torch_version).release[:2] >= (2, 6)
    if tf_new or torch_new:
        return True, f"{attn_implementation}: {versions} masks packed rows block-diagonally from their position ids"
    return False, (
        f"{attn_implementation}: {versions} does not isolate packed rows (transformers < 5 applies the "
        "block-diagonal mask of restarting position ids only with torch >= 2.6): each sequence would attend to "
        "the ones packed before it"
    )


def use_packing(model, packing: str) -> bool:
    """Whether micro-batches are packed: ``packed`` / ``padded``, or ``auto`` = packed exactly
    when the attention is flash-attention 2 (varlen kernels: no padding computed anywhere). SDPA
    can run packed rows too, but through a block-diagonal mask over the whole row, which costs
    more attention than the padding it saves. ``packed`` where the installed versions would let
    packed sequences attend to each other (:func:`packed_rows_isolated`) raises ValueError."""
    if packing == "auto":
        return model.attn_implementation.startswith("flash_attention")
    if packing == "packed":
        isolated, why = packed_rows_isolated(model.attn_implementation)
        if not isolated:
            raise ValueError(
                f"train.packing = 'packed' refused: {why}. Use train.packing = 'padded' (or 'auto'), "
                "flash-attention 2, or upgrade to torch >= 2.6 or transformers >= 5"
            )
        return True
    return False


def make_micro_batches(rollouts, plan: list[list[list[int]]], pad_id: int, device, packed: bool) -> dict[tuple[int, ...], TokenBatch]:
    """The round's micro-batches, keyed by their rollout indices, in plan order."""
    out = {}
    for mini in plan:
        for idx in mini:
            prompts = [rollouts.prompt_ids[i] for i in idx]
            responses = [rollouts.response_ids[i] for i in idx]
            out[tuple(idx)] = make_packed_batch(prompts, responses, device) if packed else make_batch(prompts, responses, pad_id, device)
    return out


def teacher_pass(teacher, batches: dict[tuple[int, ...], TokenBatch], teacher_batch: int | None = None) -> dict[tuple[int, ...], torch.Tensor]:
    """The teacher's final hidden states at every response position, per micro-batch: the round's
    only teacher forward (the loss and the scoring cache both read from it)."""
    return {key: teacher_hidden(teacher, b, teacher_batch) for key, b in batches.items()}


def local_opd(
    student,
    teacher,
    rollouts,
    settings,
    *,
    step_offset: int,
    total_steps: int,
    optimizer_state: dict[str, np.ndarray] | None = None,
    teacher_batch: int | None = None,
    batches: dict[tuple[int, ...], TokenBatch] | None = None,
    hidden: dict[tuple[int, ...], torch.Tensor] | None = None,
) -> OPDResult:
    """One epoch of on-policy distillation of ``student`` (LoRA at θ_t) towards ``teacher``.

    ``settings`` is a :class:`fedopd.config.TrainSettings`; ``step_offset`` the number of local
    steps this client took in earlier rounds (the cosine schedule's position). ``batches`` and
    ``hidden``: the micro-batches (:func:`make_micro_batches`) and the teacher's hidden states
    on them (:func:`teacher_pass`) when the caller already has them; else they are made here.

    The loss is the token mean of ``settings.loss`` (β = ``settings.loss_beta``), by default
    the reverse KL.

    Metrics come from the passes the epoch makes anyway: ``loss`` (mean mini-batch loss),
    ``loss_first`` (the first mini-batch's, at θ_t) and ``loss_last``, ``steps``, ``tokens``,
    ``lr_first`` / ``lr_last``, ``teacher_s``, ``train_s``. With ``settings.exact_kl`` also
    ``kl_before`` / ``kl_after``: the token-mean reverse KL on all the round's rollouts with θ_t
    and with the result, whatever ``settings.loss`` (two extra student passes over the data; off
    by default).
    """
    if len(rollouts) == 0:
        raise ValueError("local_opd: no rollouts to train on")
    divergence, beta = training_divergence(settings)
    plan = round_plan(rollouts, settings)
    if batches is None:
        pad = student.tokenizer.pad_token_id or 0
        batches = make_micro_batches(rollouts, plan, pad, student.device, use_packing(student, settings.packing))

    t0 = time.perf_counter()
    if hidden is None:
        hidden = teacher_pass(teacher, batches, teacher_batch)
    t1 = time.perf_counter()

    chunk = settings.loss_chunk
    exact = {}
    if settings.exact_kl:
        exact["kl_before"] = mean_reverse_kl(student, teacher, list(batches.values()), list(hidden.values()), chunk)

    if settings.gradient_checkpointing:
        enable_activation_checkpointing(student.causal_lm)
    params = student.lora_parameters()
    optimizer = make_optimizer(params, settings)
    if optimizer_state:
        load_optimizer_state(optimizer, optimizer_state)
    student.model.train()
    losses, rates = [], []
    for step, mini in enumerate(plan):
        lr = cosine_lr(settings.lr, step_offset + step, total_steps)
        keys = [tuple(idx) for idx in mini]
        micro, micro_hidden = [batches[k] for k in keys], [hidden[k] for k in keys]
        losses.append(minibatch_gradient(student, teacher, micro, micro_hidden, chunk, divergence, beta))
        optimizer_step(optimizer, params, lr, settings.grad_clip)
        rates.append(lr)
    student.model.eval()
    t2 = time.perf_counter()

    if settings.exact_kl:
        exact["kl_after"] = mean_reverse_kl(student, teacher, list(batches.values()), list(hidden.values()), chunk)
    return OPDResult(
        arrays=student.get_lora_arrays(),
        optimizer_state=optimizer_state_to_arrays(optimizer),
        metrics={
            "loss": float(np.mean(losses)),
            "loss_first": losses[0],
            "loss_last": losses[-1],
            **exact,
            "steps": len(plan),
            "tokens": int(sum(b.num_tokens for b in batches.values())),
            "lr_first": rates[0],
            "lr_last": rates[-1],
            "teacher_s": t1 - t0,
            "train_s": t2 - t1,
        },
    )
