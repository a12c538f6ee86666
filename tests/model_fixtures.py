"""Copies of the sandbox models whose files declare what real checkpoints declare.

The weights and the vocabulary are the sandbox's (ids: 0 ``<|endoftext|>``, 1 ``<|im_start|>``,
2 ``<|im_end|>``, as Qwen's 151643 / 151644 / 151645); only the metadata changes, mirroring:

- ``base-student``: a Base model that declares only its pre-training EOS, ``<|endoftext|>``, in
  its tokenizer, config and generation config (Qwen2.5-Coder-7B Base: config ``eos_token_id``
  151643, QwenLM/Qwen3-Coder issue 182; Llama 3.x Base likewise declares ``<|end_of_text|>``).
- ``qwen3-base-student``: Qwen3 Base's inconsistent files: the tokenizer says ``<|im_end|>``
  while ``config.json`` and ``generation_config.json`` say ``<|endoftext|>`` (QwenLM/Qwen3 issue
  1422, "Inconsistent eos_token across config.json, generation_config.json, and
  tokenizer_config.json in Qwen 3 Base models").
- ``instruct-teacher``: an instruct model whose generation config lists both EOS ids and ships
  its own sampling defaults (Qwen/Qwen3-8B ``generation_config.json``: ``do_sample`` true,
  ``eos_token_id`` [151645, 151643], ``temperature`` 0.6, ``top_k`` 20, ``top_p`` 0.95).
- ``instruct-student``: the student with those sampling defaults in its generation config.
- ``other-vocab-teacher``: the teacher with two tokens' ids swapped (a different vocabulary).

Real chat templates on the sandbox models (``tests/chat_templates/``, written to the copy's
``chat_template.jinja``, which transformers reads before ``tokenizer_config.json``'s
``chat_template``). The sandbox vocabulary has ``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>``, ``<think>`` and ``</think>`` as single tokens; other text is byte tokens.

- ``qwen2.5-instruct-student``: Qwen/Qwen2.5-7B-Instruct's template (no ``enable_thinking``; a
  default system message "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
  when the conversation has none). Copied from huggingface/huggingface.js
  ``packages/jinja/test/e2e.test.js``, entry "Qwen/Qwen2.5-7B-Instruct" (commit fe42e68).
- ``qwen2.5-math-teacher``: Qwen/Qwen2.5-Math-1.5B's template: the Qwen2.5-7B-Instruct template
  line for line with the default system message "Please reason step by step, and put your final
  answer within \\boxed{}." instead, as ``AutoTokenizer.from_pretrained("Qwen/Qwen2.5-Math-1.5B")
  .chat_template`` prints it in a public notebook found by code search (a DeepMath-103K SFT
  notebook); written as that replacement of the Instruct file.
- ``qwen3-teacher`` / ``qwen3-student``: Qwen/Qwen3-0.6B's template (with ``enable_thinking=False``
  the generation prompt is ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``; no default
  system message). Copied from the same huggingface.js file, entry "Qwen/Qwen3-0.6B".
- ``no-template-teacher``: the teacher without a chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = 0, 1, 2
# A run of one short round without evaluation: enough to reach a pair's checks and its first round.
ONE_ROUND = {
    "num-server-rounds": 1,
    "eval.every": 0,
    "data.prompts-per-client": 16,
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 48,
    "cache.rollouts": 2,
}
QWEN3_INSTRUCT_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def _copy(source: str, dest: Path) -> Path:
    from fedopd.sandbox import sandbox_model_path

    shutil.copytree(sandbox_model_path(source), dest)
    return dest


def _student_with_eos(dest: Path, tokenizer_eos: str) -> Path:
    """The student whose config and generation config declare only ``<|endoftext|>``."""
    path = _copy("sandbox-student", dest)
    _edit_json(path / "tokenizer_config.json", eos_token=tokenizer_eos)
    _edit_json(path / "config.json", eos_token_id=ENDOFTEXT)
    _edit_json(path / "generation_config.json", eos_token_id=ENDOFTEXT)
    return path


def base_student(dest: Path) -> Path:
    return _student_with_eos(dest, "<|endoftext|>")


def qwen3_base_student(dest: Path) -> Path:
    return _student_with_eos(dest, "<|im_end|>")


def instruct_teacher(dest: Path) -> Path:
    path = _copy("sandbox-teacher", dest)
    _edit_json(path / "tokenizer_config.json", eos_token="<|im_end|>")
    _edit_json(path / "generation_config.json", eos_token_id=[IM_END, ENDOFTEXT], **QWEN3_INSTRUCT_SAMPLING)
    return path


def instruct_student(dest: Path) -> Path:
    path = _copy("sandbox-student", dest)
    _edit_json(path / "generation_config.json", eos_token_id=[IM_END, ENDOFTEXT], **QWEN3_INSTRUCT_SAMPLING)
    return path


def other_vocab_teacher(dest: Path) -> Path:
    """Tokens '7' and '8' trade ids: same size, another token -> id map."""
    path = _copy("sandbox-teacher", dest)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def _with_template(source: str, dest: Path, template: str | None) -> Path:
    """A sandbox model whose chat template is ``tests/chat_templates/<template>.jinja`` (None: none)."""
    path = _copy(source, dest)
    if template is None:
        (path / "chat_template.jinja").unlink()
    else:
        shutil.copyfile(CHAT_TEMPLATES / f"{template}.jinja", path / "chat_template.jinja")
    return path


def qwen25_instruct_student(dest: Path) -> Path:
    return _with_template("sandbox-student", dest, "qwen2.5-7b-instruct")


def qwen25_math_teacher(dest: Path) -> Path:
    return _with_template("sandbox-teacher", dest, "qwen2.5-math-1.5b")


def qwen3_teacher(dest: Path) -> Path:
    return _with_template("sandbox-teacher", dest, "qwen3-0.6b")


def qwen3_student(dest: Path) -> Path:
    return _with_template("sandbox-student", dest, "qwen3-0.6b")


def no_template_teacher(dest: Path) -> Path:
    return _with_template("sandbox-teacher", dest, None)


BUILDERS = {
    "base-student": base_student,
    "qwen3-base-student": qwen3_base_student,
    "instruct-teacher": instruct_teacher,
    "instruct-student": instruct_student,
    "other-vocab-teacher": other_vocab_teacher,
    "qwen2.5-instruct-student": qwen25_instruct_student,
    "qwen2.5-math-teacher": qwen25_math_teacher,
    "qwen3-teacher": qwen3_teacher,
    "qwen3-student": qwen3_student,
    "no-template-teacher": no_template_teacher,
}


# Published architectures (config.json of Qwen/Qwen3-0.6B-Base and Qwen/Qwen3-8B on the hub) for
# memory planning without weights: the sandbox tokenizer and template stand in for Qwen's.
QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
QWEN3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
)


def architecture_only(source: str, dest: Path, architecture: dict) -> Path:
    """A sandbox model's tokenizer and template with a published architecture's config and no weights."""
    path = _copy(source, dest)
    (path / "model.safetensors").unlink()
    _edit_json(path / "config.json", **architecture, layer_types=["full_attention"] * architecture["num_hidden_layers"])
    return path


# vLLM's GPU attention backends take only some head sizes (get_supported_head_sizes: FlashAttention
# 32, 64, 96, 128, 160, 192, 224, 256; FlashInfer 64, 128, 256); the built-in tiny student's 16 is in
# none of them. 64 is in every list, and in vLLM's CPU build's (fedopd.rollout.vllm_engine.VLLM_CPU_HEAD_SIZES).
VLLM_GPU_HEAD_SIZE = 64


def tiny_student_for_vllm_gpu(dest: Path) -> Path:
    """A random 2-layer Qwen3 student with head size 64 (2 query heads, 1 key/value head, hidden size
    128) and the built-in tiny models' byte-level tokenizer and chat template, written to ``dest``:
    built locally (fedopd.sandbox.tiny.build_model), nothing downloaded."""
    from fedopd.sandbox.tiny import TinySpec, build_model, build_tokenizer

    spec = TinySpec(
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=VLLM_GPU_HEAD_SIZE,
        intermediate_size=256,
        tie_word_embeddings=True,
        initializer_range=0.02,
        seed=1,
    )
    tokenizer = build_tokenizer()
    build_model(spec, tokenizer).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest
