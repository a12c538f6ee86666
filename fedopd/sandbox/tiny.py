"""Built-in tiny models: a small Qwen3-architecture student and a larger teacher, made offline.

Both share a byte-level tokenizer built with ``tokenizers`` (every byte is a token, plus Qwen's
chat special tokens) and a Qwen3-style chat template that accepts ``enable_thinking``. Weights are
random with fixed seeds; the teacher is initialised with a larger scale so its next-token
distributions are peaked and distillation has something to learn. Models are written with
``save_pretrained`` to a cache folder (``$FEDTOPS_CACHE`` or ``~/.cache/fedtops``) and then load
through :func:`fedopd.models.load_causal_lm` like any hub model.

To use a trained teacher instead, save it with ``save_pretrained`` under the same tokenizer and
pass its folder as ``model.teacher``; :func:`build_model` accepts any :class:`TinySpec`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

VERSION = "tiny-v1"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Architecture and init of one tiny Qwen3 model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    initializer_range: float
    seed: int
    max_positions: int = 1024


TINY_MODELS: dict[str, TinySpec] = {
    "tiny-student": TinySpec(64, 2, 4, 2, 16, 192, True, 0.02, seed=1),
    "tiny-teacher": TinySpec(128, 3, 4, 2, 32, 384, False, 0.08, seed=2),
}


def cache_root() -> Path:
    return Path(os.environ.get("FEDTOPS_CACHE", Path.home() / ".cache" / "fedtops")).expanduser()


def build_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast`` with Qwen's chat tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<think>", "</think>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(spec: TinySpec, tokenizer):
    """A randomly initialised ``Qwen3ForCausalLM`` for ``spec`` (deterministic in ``spec.seed``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def builtin_model_path(name: str, root: Path | None = None) -> Path:
    """The folder of built-in model ``name``, built on first use and reused afterwards.

    Building goes to a temporary folder that is renamed into place, so concurrent workers never
    see a half-written model.
    """
    if name not in TINY_MODELS:
        from fedopd.core.errors import ModelLoadError

        raise ModelLoadError(f"unknown built-in model 'builtin:{name}'; allowed: " + ", ".join(f"builtin:{n}" for n in TINY_MODELS))
    root = (root or cache_root()) / VERSION
    target = root / name
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        tokenizer = build_tokenizer()
        build_model(TINY_MODELS[name], tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_spec.txt").write_text(repr(asdict(TINY_MODELS[name])) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost the race to a broken folder
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
