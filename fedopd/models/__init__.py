"""The student and the teacher: loading them from a hub id, a local folder or a built-in model,
their vocabularies and stop sets, their positions, the fp32 LM head, and the student's LoRA adapter.
It imports :mod:`fedopd.core` and the sandbox's built-in models.

- :mod:`~fedopd.models.paths`: model names, devices, dtypes, attention;
- :mod:`~fedopd.models.load`: :class:`CausalLM`, :func:`load_pair`, attaching LoRA;
- :mod:`~fedopd.models.vocab`: one vocabulary for both models, EOS ids and stop sets;
- :mod:`~fedopd.models.positions`: the positions a run needs and the models have;
- :mod:`~fedopd.models.head`: the LM head in fp32;
- :mod:`~fedopd.models.lora`: adapter factors on the wire and on disk, increments, their averages.
"""

from fedopd.core.errors import ModelLoadError
from fedopd.models.head import fp32_head
from fedopd.models.load import CausalLM, attach_lora, check_same_tokenizer, load_causal_lm, load_pair, lora_config
from fedopd.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter, name_mismatch, save_adapter
from fedopd.models.paths import BUILTIN_MODELS, attention_implementation, default_device, resolve_dtype, resolve_model_path

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "BUILTIN_MODELS",
    "CausalLM",
    "ModelLoadError",
    "attach_lora",
    "attention_implementation",
    "check_same_tokenizer",
    "default_device",
    "fp32_head",
    "load_adapter",
    "load_causal_lm",
    "load_pair",
    "lora_config",
    "name_mismatch",
    "resolve_dtype",
    "resolve_model_path",
    "save_adapter",
]
