"""Loading the student and the teacher, and the student's LoRA adapter.

Both models load with ``transformers`` from a hub id or a local folder (the built-in tiny models of
:mod:`fedopd.sandbox.tiny` are local folders too, so they take exactly this path). Computation runs in
bf16 on GPU and fp32 on CPU; the LoRA factors are fp32 in both cases (PEFT upcasts adapters), and
they cross the wire as fp32 numpy arrays keyed by PEFT's factor names (:mod:`fedopd.models.lora`, which
also reads and writes adapter folders).

:class:`CausalLM` exposes the two halves of a forward pass separately, final hidden states and the
LM head, so that callers can evaluate the vocabulary projection only where it is needed (cached
positions) or chunk by chunk (the OPD loss).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedopd.core.errors import ModelLoadError
from fedopd.core.settings import LoraSettings
from fedopd.models.head import fp32_head
from fedopd.models.lora import name_mismatch
from fedopd.models.paths import attention_implementation, default_device, resolve_dtype, resolve_model_path
from fedopd.models.vocab import ModelFiles, check_same_vocabulary

# PEFT under transformers 5 calls a renamed property on every forward; the warning is upstream's.
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)

# ---------------------------------------------------------------------------------------------
# The model wrapper
# ---------------------------------------------------------------------------------------------


@dataclass
class CausalLM:
    """A causal LM (optionally PEFT-wrapped) split into body and head.

    ``logit_width`` is the vocabulary width compared between student and teacher (the
    shared tokenizer length when their logit widths differ).
    """

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    logit_width: int
    name: str
    _factors: dict = field(default_factory=dict, repr=False)  # adapter name -> {factor name: Parameter}

    # -- forward ---------------------------------------------------------------------------------
    @property
    def causal_lm(self):
        """The transformers ``*ForCausalLM`` module (inside the PEFT wrapper, if any)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final (post-norm) hidden states (B, T, H); LoRA layers are active if attached.

        Packed (padding-free) rows: ``attention_mask=None`` and ``position_ids`` restarting at 0 for
        each sequence; transformers then keeps the sequences apart (flash-attention 2 varlen, or a
        block-diagonal mask for SDPA).
        """
        body = self.causal_lm.base_model
        return body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state

    @property
    def attn_implementation(self) -> str:
        return str(getattr(self.causal_lm.config, "_attn_implementation", "sdpa"))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states (..., H) -> (..., logit_width), computed in fp32.

        Probabilities come from fp32 logits, not from bf16 logits upcast afterwards. The
        hidden states and the head's weight are upcast (a no-op for an fp32 model), so a bf16
        model's logits carry no bf16 rounding of their own. Callers evaluate the head only where
        they need it (cached positions, one loss chunk at a time).
        """
        head = self.causal_lm.get_output_embeddings()
        bias = head.bias[: self.logit_width] if head.bias is not None else None
        out = fp32_head(hidden, head.weight[: self.logit_width], bias)
        cap = getattr(self.causal_lm.config, "final_logit_softcapping", None)
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def head_trainable(self) -> bool:
        """Whether any parameter of the LM head takes a gradient (LoRA targets the head, or its
        weight is tied to trainable embeddings). :func:`fedopd.models.fp32_head` treats the head as
        frozen (no weight gradient), so the OPD loss refuses such a student."""
        return any(p.requires_grad for p in self.causal_lm.get_output_embeddings().parameters())

    @property
    def vocab_width(self) -> int:
        return int(self.causal_lm.get_output_embeddings().weight.shape[0])

    # -- LoRA ------------------------------------------------------------------------------------
    def lora_names(self) -> list[str]:
        """Names of the LoRA factors in wire order (PEFT's saved key names)."""
        from peft import get_peft_model_state_dict

        return list(get_peft_model_state_dict(self.model).keys())

    def get_lora_arrays(self) -> dict[str, np.ndarray]:
        """The LoRA factors as fp32 numpy arrays (copies), keyed by name in :meth:`lora_names` order."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model)
        return {n: t.detach().to(torch.float32).cpu().numpy().copy() for n, t in state.items()}

    def factor_parameters(self, adapter: str = "default") -> dict[str, torch.nn.Parameter]:
        """The parameters of ``adapter``'s LoRA factors, keyed by PEFT's saved (wire) names, in wire order.

        Built once per adapter: a saved name ``...q_proj.lora_A.weight`` is the parameter
        ``...q_proj.lora_A.<adapter>.weight``.
        """
        if adapter not in self._factors:
            params = dict(self.model.named_parameters())
            out = {}
            for name in self.lora_names():
                head, _, leaf = name.rpartition(".")
                key = f"{head}.{adapter}.{leaf}"
                if key not in params:
                    raise ValueError(f"adapter '{adapter}' of '{self.name}' has no parameter for factor '{name}'")
                out[name] = params[key]
            self._factors[adapter] = out
        return self._factors[adapter]

    def set_lora_arrays(self, arrays: Mapping[str, np.ndarray], adapter: str = "default") -> None:
        """Copy named fp32 factors into ``adapter``, matched by name (bit-exact for fp32).

        The names must be exactly the adapter's (:meth:`lora_names`); the first missing or
        unknown name, or a wrong shape, is an error that names the factor.
        """
        if not isinstance(arrays, Mapping):
            raise TypeError(f"LoRA factors must be given by name (a mapping), got {type(arrays).__name__}")
        params = self.factor_parameters(adapter)
        problem = name_mismatch(list(params), list(arrays))
        if problem:
            raise ValueError(f"LoRA arrays do not match the adapter of '{self.name}': {problem}")
        for n, param in params.items():
            if tuple(np.shape(arrays[n])) != tuple(param.shape):
                raise ValueError(f"LoRA factor '{n}' has shape {tuple(np.shape(arrays[n]))}, the adapter's is {tuple(param.shape)}")
        with torch.no_grad():
            for n, param in params.items():
                param.copy_(torch.from_numpy(np.ascontiguousarray(arrays[n], dtype=np.float32)))

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def lora_config(self):
        """The adapter's ``peft.LoraConfig``."""
        return self.model.peft_config["default"]


def load_causal_lm(name: str, *, dtype: str = "auto", device: torch.device | None = None) -> CausalLM:
    """Load a frozen causal LM and its tokenizer from a hub id, a local folder or a builtin name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attention_implementation(device, torch_dtype))
    except OSError as err:
        raise ModelLoadError(f"could not load model '{name}' (resolved to '{path}'): {err}") from err
    model.to(device).eval()
    model.requires_grad_(False)
    return CausalLM(model, tokenizer, device, torch_dtype, int(model.get_output_embeddings().weight.shape[0]), name)


def lora_config(settings: LoraSettings, base_model: str | None = None):
    """The ``peft.LoraConfig`` of the paper (rank 8, alpha 16, dropout 0, all linear projections)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=True,  # Kaiming-uniform A, zero B
        base_model_name_or_path=base_model,
    )


def attach_lora(lm: CausalLM, settings: LoraSettings, seed: int) -> CausalLM:
    """Wrap ``lm`` with a trainable PEFT LoRA adapter, PEFT default init drawn from ``seed``."""
    from peft import get_peft_model

    config = lora_config(settings, lm.causal_lm.name_or_path)
    devices = [lm.device] if lm.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = get_peft_model(lm.model, config)
    return CausalLM(model, lm.tokenizer, lm.device, lm.dtype, lm.logit_width, lm.name)


def check_same_tokenizer(student: CausalLM, teacher: CausalLM) -> None:
    """Refuse a pair whose vocabularies (token → id) differ: OPD compares distributions token id by
    token id. Different EOS conventions are allowed (:func:`fedopd.models.vocab.check_same_vocabulary`)."""
    check_same_vocabulary(ModelFiles.of(student), ModelFiles.of(teacher))


def load_pair(
    student_name: str,
    teacher_name: str,
    *,
    lora: LoraSettings,
    seed: int,
    dtype: str = "auto",
    device: torch.device | None = None,
) -> tuple[CausalLM, CausalLM]:
    """Load the student (with LoRA attached) and the teacher; check that they can be compared."""
    resolve_model_path(student_name), resolve_model_path(teacher_name)  # fail fast on both names
    teacher = load_causal_lm(teacher_name, dtype=dtype, device=device)
    student = load_causal_lm(student_name, dtype=dtype, device=device)
    check_same_tokenizer(student, teacher)
    if student.vocab_width != teacher.vocab_width:
        width = len(student.tokenizer)
        if width > min(student.vocab_width, teacher.vocab_width):
            raise ModelLoadError(
                f"tokenizer has {width} tokens but student '{student_name}' has {student.vocab_width} "
                f"logits and teacher '{teacher_name}' {teacher.vocab_width}"
            )
        student.logit_width = teacher.logit_width = width
    return attach_lora(student, lora, seed), teacher
