"""Loading, LoRA attachment, wire arrays and adapter folders on the built-in tiny models."""

import re
import shutil

import numpy as np
import pytest
import torch
from precision import PAIR, log_softmax_error, logit_error, logit_scale

from fedopd.config import LoraSettings
from fedopd.distill.teacher import make_batch, teacher_log_probs
from fedopd.models import (
    ModelLoadError,
    load_adapter,
    load_causal_lm,
    load_pair,
    resolve_model_path,
    save_adapter,
)
from fedopd.sandbox.tiny import builtin_model_path

pytestmark = pytest.mark.slow


def _random_like(arrays, seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in arrays.items()}


def test_lora_has_spec_rank_alpha_targets_and_peft_default_init(tiny_pair):
    student, _ = tiny_pair
    cfg = student.lora_config
    assert cfg.r == 8 and cfg.lora_alpha == 16 and cfg.lora_dropout == 0.0
    assert set(cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    names = student.lora_names()
    assert len(names) == 2 * 7 * 2  # A and B for 7 projections in each of 2 layers
    assert not any("lm_head" in n for n in names)


def test_initial_adapter_is_deterministic_in_the_seed_with_zero_b():
    lora = LoraSettings()
    a = load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=lora, seed=5)[0]
    b = load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=lora, seed=5)[0]
    c = load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=lora, seed=6)[0]
    xs, ys, zs = a.get_lora_arrays(), b.get_lora_arrays(), c.get_lora_arrays()
    assert list(xs) == a.lora_names()
    for name in a.lora_names():
        x, y, z = xs[name], ys[name], zs[name]
        assert np.array_equal(x, y)
        if "lora_B" in name:
            assert not x.any()
        else:
            assert x.any() and not np.array_equal(x, z)


def test_lora_arrays_round_trip_bit_exact(tiny_pair):
    student, _ = tiny_pair
    original = student.get_lora_arrays()
    values = _random_like(original, 1)
    try:
        student.set_lora_arrays(values)
        back = student.get_lora_arrays()
        assert all(b.dtype == np.float32 for b in back.values())
        assert all(np.array_equal(values[n], back[n]) for n in values)
    finally:
        student.set_lora_arrays(original)


def test_lora_factors_are_applied_by_name_not_by_position(tiny_pair):
    student, _ = tiny_pair
    original = student.get_lora_arrays()
    names = student.lora_names()
    # Two A factors of the same shape: q_proj's and k_proj's... find a pair that shares a shape.
    shapes = {}
    for n in names:
        shapes.setdefault(original[n].shape, []).append(n)
    first, second = next(v for v in shapes.values() if len(v) >= 2)[:2]
    values = {n: np.zeros_like(a) for n, a in original.items()}
    values[first] = np.full_like(original[first], 1.0)
    values[second] = np.full_like(original[second], 2.0)
    reordered = {second: values[second], first: values[first], **{n: values[n] for n in names}}
    try:
        student.set_lora_arrays(reordered)  # a different order, the same names
        back = student.get_lora_arrays()
        assert np.all(back[first] == 1.0) and np.all(back[second] == 2.0)
    finally:
        student.set_lora_arrays(original)


def test_lora_arrays_whose_names_do_not_match_are_refused_naming_the_first_mismatch(tiny_pair):
    student, _ = tiny_pair
    original = student.get_lora_arrays()
    names = list(original)
    missing = {n: a for n, a in original.items() if n != names[3]}
    with pytest.raises(ValueError, match=f"factor '{names[3]}' is missing"):
        student.set_lora_arrays(missing)
    renamed = {("x." + n if n == names[5] else n): a for n, a in original.items()}
    with pytest.raises(ValueError, match=f"factor '{names[5]}' is missing"):
        student.set_lora_arrays(renamed)
    extra = {**original, "model.extra.lora_A.weight": original[names[0]]}
    with pytest.raises(ValueError, match="factor 'model.extra.lora_A.weight' is not in the adapter"):
        student.set_lora_arrays(extra)
    wrong_shape = {**original, names[2]: original[names[2]].T.copy()}
    if original[names[2]].shape != original[names[2]].T.shape:
        with pytest.raises(ValueError, match=f"LoRA factor '{names[2]}' has shape"):
            student.set_lora_arrays(wrong_shape)
    with pytest.raises(TypeError, match="given by name"):
        student.set_lora_arrays(list(original.values()))
    assert all(np.array_equal(original[n], a) for n, a in student.get_lora_arrays().items())  # untouched


def test_adapter_folder_round_trips_through_peft(tiny_pair, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    student, _ = tiny_pair
    names = student.lora_names()
    values = _random_like(student.get_lora_arrays(), 2)
    save_adapter(tmp_path / "ours", values, student.lora_config)

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-student"))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ours"))
    peft_model.save_pretrained(str(tmp_path / "peft"))
    loaded = load_adapter(tmp_path / "peft", names)
    assert list(loaded) == names
    assert all(np.array_equal(values[n], loaded[n]) for n in names)


def test_hidden_states_and_head_reproduce_the_full_forward(tiny_pair):
    _, teacher = tiny_pair
    batch = make_batch([[258, 70, 71, 72], [258, 80]], [[60, 61], [62, 63, 64]], pad_id=257)
    log_probs = teacher_log_probs(teacher, batch)
    with torch.no_grad():
        full = teacher.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.log_softmax(full[batch.loss_mask].float(), -1)
    assert log_probs.shape == (5, teacher.logit_width)
    # Two fp32 evaluations of the same logits (split vs whole forward): each log-probability moves
    # by at most twice one logit's error plus twice the log-softmax's own rounding.
    bound = PAIR * (logit_error(teacher, batch.input_ids.shape[1]) + log_softmax_error(teacher.logit_width, logit_scale(teacher)))
    assert (log_probs - expected).abs().max().item() <= bound


def test_batch_marks_the_positions_that_predict_response_tokens():
    batch = make_batch([[1, 2, 3]], [[4, 5]], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert batch.loss_mask.tolist() == [[False, False, True, True, False]]


def test_builtin_models_are_built_once_and_reused():
    path = builtin_model_path("tiny-teacher")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert builtin_model_path("tiny-teacher") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_tiny_chat_template_accepts_enable_thinking():
    tok = load_causal_lm("builtin:tiny-student").tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_model_path_fails_before_loading(tmp_path):
    with pytest.raises(ModelLoadError, match="'./no/such/model' is not an existing local folder"):
        load_pair("./no/such/model", "builtin:tiny-teacher", lora=LoraSettings(), seed=0)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="unknown built-in model 'builtin:tiny-giant'"):
        resolve_model_path("builtin:tiny-giant")


def test_student_and_teacher_with_different_tokenizers_are_refused(tmp_path):
    other = tmp_path / "other-teacher"
    shutil.copytree(builtin_model_path("tiny-teacher"), other)
    tok = load_causal_lm(str(other)).tokenizer
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(ModelLoadError, match=r"must share a vocabulary .*1 tokens only in the teacher's \(e\.g\. '<extra>'\)"):
        load_pair("builtin:tiny-student", str(other), lora=LoraSettings(), seed=0)


def test_local_folder_loads_like_a_hub_model(tmp_path):
    copy = tmp_path / "student"
    shutil.copytree(builtin_model_path("tiny-student"), copy)
    lm = load_causal_lm(str(copy))
    assert lm.dtype == torch.float32 and lm.device.type in ("cpu", "cuda")
    assert lm.model.config.model_type == "qwen3"


def test_fedtops_device_sets_the_default_device_and_auto_dtype_follows(monkeypatch):
    from fedopd.models import default_device, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as default_device can tell
    monkeypatch.setenv("FEDTOPS_DEVICE", "cpu")
    assert default_device() == torch.device("cpu") and resolve_dtype("auto", default_device()) == torch.float32
    for unset in ("", "auto", " AUTO "):
        monkeypatch.setenv("FEDTOPS_DEVICE", unset)
        assert default_device() == torch.device("cuda") and resolve_dtype("auto", default_device()) == torch.bfloat16
    monkeypatch.delenv("FEDTOPS_DEVICE")
    assert default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("FEDTOPS_DEVICE", "cuda:1")
    assert default_device() == torch.device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FEDTOPS_DEVICE")
    assert default_device() == torch.device("cpu")


@pytest.mark.parametrize(
    "value, cuda_devices, message",
    [
        ("tpu", 0, "FEDTOPS_DEVICE='tpu' is not a device; allowed: 'cpu', 'cuda', 'cuda:N', 'auto'"),
        ("mps", 0, "FEDTOPS_DEVICE='mps' is not a device"),
        ("cuda", 0, "FEDTOPS_DEVICE='cuda', but this host has 0 CUDA device"),
        ("cuda:1", 1, "FEDTOPS_DEVICE='cuda:1', but this host has 1 CUDA device"),
    ],
)
def test_a_fedtops_device_that_names_no_usable_device_is_refused(monkeypatch, value, cuda_devices, message):
    from fedopd.models import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    monkeypatch.setenv("FEDTOPS_DEVICE", value)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        default_device()
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_causal_lm("builtin:tiny-student")


def test_the_suite_runs_on_the_cpu_in_fp32(tiny_pair):
    """tests/conftest.py sets FEDTOPS_DEVICE=cpu, so the session's models are fp32 on the CPU on any
    host (the processes the tests start inherit it: tests/test_flwr_run.py, tests/test_simulation.py)."""
    import os

    assert os.environ["FEDTOPS_DEVICE"] == "cpu"
    assert all(lm.device.type == "cpu" and lm.dtype == torch.float32 for lm in tiny_pair)


@pytest.mark.slow
def test_a_saved_adapter_names_its_base_model_as_the_run_config_does(tmp_path):
    """Not where this host keeps the built-in model's files (an absolute path inside the clone,
    issue 49): the name works on any machine."""
    import json

    from conftest import TINY

    from fedopd.config import parse_run_config
    from fedopd.models.lora import save_adapter
    from server_app.app import initial_adapter

    arrays, config = initial_adapter(parse_run_config(TINY))
    saved = json.loads((save_adapter(tmp_path / "round-000", arrays, config) / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "builtin:tiny-student"
