"""vLLM's arguments, built without vLLM (fedopd.rollout.vllm_engine's pure functions), and one real run
of the engine where vLLM and CUDA exist."""

import sys
import types

import numpy as np
import pytest

from fedopd.rollout import SamplingParams
from fedopd.rollout.vllm_engine import (
    VLLM_MAX_LORA_RANKS,
    VLLM_MAX_TEMPERATURE,
    check_vllm_sampling,
    finished,
    llm_kwargs,
    lora_request_kwargs,
    request_seeds,
    sampling_kwargs,
    vllm_lora_rank,
)

# --- LoRA rank: vllm/config/lora.py MaxLoRARanks ---------------------------------------------


def test_allowed_lora_ranks_are_vllms():
    assert VLLM_MAX_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (4, 8), (8, 8), (12, 16), (16, 16), (300, 320), (320, 320), (512, 512)])
def test_lora_rank_rounds_up_to_an_allowed_max_lora_rank(rank, served):
    assert vllm_lora_rank(rank) == served


def test_lora_rank_above_vllms_largest_is_a_clear_error():
    with pytest.raises(ValueError, match=r"lora\.rank = 600 .*512"):
        vllm_lora_rank(600)
    with pytest.raises(ValueError, match=r"lora\.rank = 0"):
        vllm_lora_rank(0)


def test_llm_kwargs():
    kw = llm_kwargs("/models/student", lora_rank=4, max_model_len=3072, gpu_memory_utilization=0.25, dtype="bfloat16", seed=3)
    assert kw == {
        "model": "/models/student",
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 1,
        "max_model_len": 3072,
        "gpu_memory_utilization": 0.25,
        "dtype": "bfloat16",
        "seed": 3,
        "generation_config": "vllm",
    }
    assert llm_kwargs("m", lora_rank=12, max_model_len=8, gpu_memory_utilization=0.3, dtype="float32", seed=0)["max_lora_rank"] == 16
    with pytest.raises(ValueError, match=r"lora\.rank = 600"):
        llm_kwargs("m", lora_rank=600, max_model_len=8, gpu_memory_utilization=0.3, dtype="float32", seed=0)


def test_vllm_never_resolves_the_dtype_itself():
    """'auto' would make vLLM read config.json (the sandbox models say bfloat16) while HF runs fp32."""
    with pytest.raises(ValueError, match="not 'auto'"):
        llm_kwargs("m", lora_rank=8, max_model_len=8, gpu_memory_utilization=0.3, dtype="auto", seed=0)


def test_vllms_cpu_build_runs_eager_without_chunked_prefill():
    """vLLM 0.32's CPU build cannot rewind a seeded request's generator after a partial prefill:
    'CPU Generator does not use offset' killed the engine on a batch of 192 seeded requests."""
    kw = llm_kwargs("m", lora_rank=8, max_model_len=8, gpu_memory_utilization=0.1, dtype="float32", seed=0, platform="cpu")
    assert kw["enforce_eager"] is True and kw["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in llm_kwargs("m", lora_rank=8, max_model_len=8, gpu_memory_utilization=0.1, dtype="float32", seed=0)


# --- temperature: vllm/sampling_params.py refuses > 2 ----------------------------------------


def test_vllm_temperature_bound():
    assert VLLM_MAX_TEMPERATURE == 2.0
    for t in (0.0, 0.6, 1.0, 2.0):
        check_vllm_sampling(t, "rollout.temperature")


@pytest.mark.parametrize("key", ["rollout.temperature", "eval.temperature"])
def test_temperature_above_two_is_refused_naming_the_key(key):
    with pytest.raises(ValueError) as err:
        check_vllm_sampling(2.5, key)
    assert f"{key} = 2.5" in str(err.value) and "[0, 2]" in str(err.value)
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        check_vllm_sampling(float("nan"), key)
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        check_vllm_sampling(-0.1, key)


# --- sampling: exactly our config, whatever the model ships -----------------------------------


def test_sampling_kwargs_are_exactly_our_config():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1), seed=12345, stop_token_ids=(151645, 151643))
    assert kw == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 64,
        "seed": 12345,
        "stop_token_ids": [151645, 151643],
        "ignore_eos": True,
        "detokenize": False,  # only token ids are read
    }
    assert type(kw["stop_token_ids"]) is list


def test_sampling_kwargs_greedy_and_without_stop_set():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.0), seed=0, stop_token_ids=())
    assert kw["temperature"] == 0.0 and kw["top_k"] == 0 and kw["stop_token_ids"] == [] and kw["ignore_eos"] is False


def test_sampling_kwargs_refuse_a_temperature_vllm_refuses():
    with pytest.raises(ValueError, match=r"temperature = 2\.5"):
        sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=2.5), seed=0, stop_token_ids=(2,))


def test_each_request_gets_its_own_seed():
    seeds = request_seeds(7, 4)
    kws = [sampling_kwargs(SamplingParams(max_new_tokens=8, seed=7), s, (2,)) for s in seeds]
    assert [k["seed"] for k in kws] == seeds and len(set(seeds)) == 4


# --- LoRARequest by keyword --------------------------------------------------------------------


def test_lora_request_kwargs():
    assert lora_request_kwargs(3, "/tmp/adapters/adapter-000003") == {
        "lora_name": "fedtops-3",
        "lora_int_id": 3,
        "lora_path": "/tmp/adapters/adapter-000003",
    }
    assert lora_request_kwargs(4, "x")["lora_name"] != lora_request_kwargs(3, "x")["lora_name"]
    with pytest.raises(ValueError, match="adapter id"):
        lora_request_kwargs(0, "x")


# --- finish reasons -----------------------------------------------------------------------------


def test_stop_keeps_the_stop_token():
    assert finished([5, 6, 2], "stop", [2, 9], 0) == ([5, 6, 2], False)
    assert finished((5, 9), "stop", [2, 9], 0, stop_reason=9) == ([5, 9], False)


def test_stop_token_dropped_by_vllm_is_appended():
    assert finished([5, 6], "stop", [2, 9], 0, stop_reason=9) == ([5, 6, 9], False)


def test_stop_without_a_stop_token_is_an_error():
    with pytest.raises(RuntimeError, match=r"request 3: finish_reason 'stop' but the response ends with 6"):
        finished([5, 6], "stop", [2, 9], 3)


def test_stop_without_a_stop_set_of_ours():
    assert finished([5, 6, 7], "stop", [], 0) == ([5, 6, 7], False)


def test_length_is_capped():
    assert finished([5, 6, 7], "length", [2], 0) == ([5, 6, 7], True)
    assert finished([5, 6, 7], "length", [], 0) == ([5, 6, 7], True)
    # older vLLM checks the length before the stop set: a stop token at the cap is finished
    assert finished([5, 6, 2], "length", [2], 0) == ([5, 6, 2], False)


@pytest.mark.parametrize("reason", ["abort", "error", "repetition", None])
def test_other_finish_reasons_are_errors(reason):
    with pytest.raises(RuntimeError) as err:
        finished([5, 6, 2], reason, [2], 4)
    assert "request 4" in str(err.value) and repr(reason) in str(err.value)


# --- the engine's wiring, against a stand-in vllm module (no vLLM needed) -----------------------


class _FakeVLLM:
    """Records what the engine hands vLLM; answers with scripted (token_ids, finish_reason)."""

    def __init__(self):
        self.llm_kwargs, self.lora_requests, self.calls, self.script, self.runs_in = None, [], [], [], None
        fake = self

        class LLM:
            def __init__(self, **kwargs):
                fake.llm_kwargs = kwargs
                import torch

                dtype = getattr(torch, fake.runs_in or kwargs["dtype"])  # what vLLM resolved the model to
                self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype, max_model_len=kwargs["max_model_len"]))

            def generate(self, prompts, sampling, *, lora_request, use_tqdm):
                fake.calls.append((prompts, sampling, lora_request))
                return [
                    types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=t, finish_reason=f, stop_reason=None)]) for t, f in fake.script
                ]

        class LoRARequest:
            def __init__(self, *, lora_name, lora_int_id, lora_path):  # keywords only
                self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

        class VSamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        self.modules = {
            "vllm": types.SimpleNamespace(LLM=LLM, SamplingParams=VSamplingParams),
            "vllm.lora": types.SimpleNamespace(),
            "vllm.lora.request": types.SimpleNamespace(LoRARequest=LoRARequest),
            "vllm.inputs": types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}),
        }


def test_engine_hands_vllm_the_built_arguments(monkeypatch, tmp_path):
    from fedopd.config import LoraSettings
    from fedopd.models import lora_config
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine

    fake = _FakeVLLM()
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    names = ["a.lora_A.weight", "a.lora_B.weight"]
    engine = VLLMRolloutEngine(
        "/models/student",
        names,
        lora_config(LoraSettings(rank=4, target_modules=("q_proj",))),
        max_model_len=128,
        gpu_memory_utilization=0.2,
        dtype="bfloat16",
        seed=5,
        stop_token_ids=(2, 9),
        workdir=tmp_path,
        platform="cuda",
    )
    assert fake.llm_kwargs["max_lora_rank"] == 8 and fake.llm_kwargs["generation_config"] == "vllm"
    arrays = {"a.lora_A.weight": np.zeros((4, 8), np.float32), "a.lora_B.weight": np.zeros((8, 4), np.float32)}
    for expected_id in (1, 2):
        engine.set_adapter(arrays)
        assert (engine._request.lora_name, engine._request.lora_int_id) == (f"fedtops-{expected_id}", expected_id)
    fake.script = [([5, 2], "stop"), ([5, 6, 7], "length")]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, seed=11)
    out = engine.generate([[1, 2], [1, 3]], params)
    assert out.response_ids == [[5, 2], [5, 6, 7]] and out.capped == [False, True]
    _, sampling, request = fake.calls[-1]
    assert [s.kwargs for s in sampling] == [sampling_kwargs(params, s, (2, 9)) for s in request_seeds(11, 2)]
    assert request.lora_int_id == 2
    fake.script = [([5, 2], "stop"), ([5], "abort")]
    with pytest.raises(RuntimeError, match=r"request 1 did not finish: finish_reason = 'abort'"):
        engine.generate([[1, 2], [1, 3]], params)
    engine.close()


# --- the real engine (vLLM + CUDA) ---------------------------------------------------------------


@pytest.mark.gpu
def test_real_vllm_engine_on_the_sandbox_student():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: vLLM cannot run")
    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm, resolve_model_path
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine

    name = "builtin:sandbox-student"
    student = attach_lora(load_causal_lm(name), LoraSettings(rank=4, alpha=8.0), seed=0)  # rank 4 -> max_lora_rank 8
    stop = sorted({int(student.tokenizer.eos_token_id)})
    engine = VLLMRolloutEngine(
        resolve_model_path(name),
        student.lora_names(),
        student.lora_config,
        max_model_len=256,
        gpu_memory_utilization=0.2,
        dtype="bfloat16",
        seed=0,
        stop_token_ids=stop,
    )
    try:
        arrays = student.get_lora_arrays()
        engine.set_adapter(arrays)
        prompt = student.tokenizer("1+1=")["input_ids"]
        prompts = [prompt] * 4
        for params in (SamplingParams(max_new_tokens=24, temperature=1.0, seed=3), SamplingParams(max_new_tokens=24, temperature=0.0)):
            out = engine.generate(prompts, params)
            assert len(out) == 4
            for r, capped in zip(out.response_ids, out.capped):
                assert 1 <= len(r) <= 24
                assert capped or r[-1] in stop  # the contract: ends with the stop token unless capped
                assert not capped or len(r) == 24
            again = engine.generate(prompts, params)
            assert again.response_ids == out.response_ids  # reproducible per-request seeds
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
        assert len(set(map(tuple, greedy.response_ids))) == 1
        engine.set_adapter({n: np.zeros_like(a) for n, a in arrays.items()})  # a fresh name and id
        engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    finally:
        engine.close()


def test_an_engine_that_runs_another_dtype_than_the_hf_student_is_refused(monkeypatch, tmp_path):
    from fedopd.config import LoraSettings
    from fedopd.models import lora_config
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine

    fake = _FakeVLLM()
    fake.runs_in = "bfloat16"  # e.g. a platform that casts float16 to bfloat16
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(RuntimeError, match="vLLM runs the student in bfloat16, the HF student is in float16"):
        VLLMRolloutEngine(
            "/m", ["a.lora_A.weight"], lora_config(LoraSettings(rank=4)), max_model_len=8, dtype="float16", workdir=tmp_path, platform="cuda"
        )


def test_vllms_cpu_build_refuses_head_sizes_its_attention_does_not_take():
    """vllm/v1/attention/backends/cpu_attn.py: 32, 64, ...; the tiny models' 16 failed at the first forward."""
    import types

    from fedopd.rollout.vllm_engine import cpu_head_size_problem

    sandbox = types.SimpleNamespace(head_dim=32, hidden_size=128, num_attention_heads=4)
    tiny = types.SimpleNamespace(head_dim=16, hidden_size=64, num_attention_heads=4)
    qwen3 = types.SimpleNamespace(head_dim=128, hidden_size=1024, num_attention_heads=16)  # Qwen3-0.6B-Base config.json
    assert cpu_head_size_problem("s", sandbox) is None and cpu_head_size_problem("q", qwen3) is None
    assert cpu_head_size_problem("builtin:tiny-student", tiny).startswith(
        "vLLM's CPU build cannot run 'builtin:tiny-student': its attention head size is 16"
    )
    no_head_dim = types.SimpleNamespace(hidden_size=64, num_attention_heads=4)  # head size = hidden / heads
    assert "head size is 16" in cpu_head_size_problem("m", no_head_dim)


# What vLLM 0.32's engine process prints before the client's "Engine core initialization failed"
# (vllm/v1/core/kv_cache_utils.py, vllm/v1/worker/cpu_worker.py), with vLLM's process prefix.
KV_TOO_SMALL = (
    "(EngineCore pid=4242) ValueError: To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.12 GiB). Based on the available memory, the estimated maximum model length is 980."
)
NOT_FREE = (
    "(EngineCore pid=4242) ValueError: Available memory on node 0 (3.1/23.5 GiB) on startup is less than desired CPU memory "
    "utilization (0.3, 7.05 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory reserved"
)


@pytest.mark.parametrize(
    "printed, expected",
    [
        (KV_TOO_SMALL, "rollout.gpu-memory-utilization = 0.3 of the host's memory leaves too little for the KV cache: raise it"),
        (
            # vLLM's CPU build at a share of 0.0003 (seen): its worker's error, wrapped
            "RuntimeError: Worker failed with error 'Available memory on node 0 (7.31/19.71 GiB) on kv cache allocation is less than "
            "requested memory for kv (-0.82/0.01 GiB)'",
            "rollout.gpu-memory-utilization = 0.3 of the host's memory leaves too little for the KV cache: raise it",
        ),
        (NOT_FREE, "rollout.gpu-memory-utilization = 0.3 of the host's memory is more than is free: lower it"),
        (
            "(EngineCore pid=4242) RuntimeError: An attempt has been made to start a new process before the current process has "
            "finished its bootstrapping phase.",
            "the full traceback is in this client's log",
        ),
        ("", None),
    ],
)
def test_an_engine_process_that_fails_to_start_says_vllms_own_cause_and_the_direction(printed, expected, monkeypatch, tmp_path, capfd):
    """vLLM raises only 'Engine core initialization failed. See root cause above.' in the client;
    its engine process printed the cause (to the file descriptors this process shares with it)."""
    import os

    from fedopd.config import LoraSettings
    from fedopd.models import lora_config
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine

    fake = _FakeVLLM()

    def refuse(**kwargs):
        os.write(1, b"(EngineCore pid=4242) INFO a line of vLLM's log\n")
        os.write(2, b"Traceback (most recent call last):\n  File ...\n" + printed.encode() + b"\n")
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}")

    fake.modules["vllm"].LLM = refuse
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("fedopd.rollout.vllm_engine.device_memory", lambda platform: None)
    with pytest.raises(RuntimeError) as err:
        VLLMRolloutEngine(
            "/m", ["a.lora_A.weight"], lora_config(LoraSettings(rank=4)), max_model_len=8, dtype="float32", workdir=tmp_path, platform="cpu"
        )
    message = str(err.value)
    if expected is None:
        assert message == "vLLM's engine process failed to start (Engine core initialization failed); vLLM printed the cause in this client's log"
    else:
        cause = printed.removeprefix("(EngineCore pid=4242) ")
        assert message == f"vLLM's engine process failed to start: {cause} ({expected}" + message[message.index(expected) + len(expected) :]
        assert cause in message and "pid=4242" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # one line, no chain
    out, errors = capfd.readouterr()  # and everything still reached this process's own output
    assert "a line of vLLM's log" in out and printed in errors


def test_a_share_of_memory_that_is_not_free_is_refused_before_vllm_starts(monkeypatch, tmp_path):
    """4 GiB free of 80, 0.75 of them for vLLM's engine process's own CUDA context: 3.25 GiB for
    its share. 0.04 asks for 3.2 (fits), 0.05 for 4.0 and 0.9 for 72 (refused); at most 0.04 fits
    (floor of 3.25/80 = 0.0406 to two decimals). On the CPU build no context: 0.05 of 80 fits in 4."""
    from fedopd.config import LoraSettings
    from fedopd.models import lora_config
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine, memory_request_problem

    gib = 2**30
    assert memory_request_problem(0.04, 4 * gib, 80 * gib, "cuda") is None
    assert memory_request_problem(0.05, 4 * gib, 80 * gib, "cpu") is None
    assert memory_request_problem(0.05, 4 * gib, 80 * gib, "cuda") is not None
    problem = memory_request_problem(0.9, 4 * gib, 80 * gib, "cuda")
    assert problem.startswith(
        "rollout.gpu-memory-utilization = 0.9 asks vLLM for 72.0 GiB of the GPU (80.0 GiB), but only 4.0 GiB are free, "
        "0.75 GiB of them for vLLM's engine process itself"
    )
    assert "lower rollout.gpu-memory-utilization (at most 0.04 fits vLLM now, leaving nothing for training" in problem
    assert "python -m fedopd.preflight" in problem and "nvidia-smi" in problem

    fake, started = _FakeVLLM(), []
    fake.modules["vllm"].LLM = lambda **kwargs: started.append(kwargs)
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("fedopd.rollout.vllm_engine.device_memory", lambda platform: (4 * gib, 80 * gib))
    with pytest.raises(RuntimeError, match=r"asks vLLM for 72.0 GiB of the GPU"):
        VLLMRolloutEngine(
            "/m",
            ["a.lora_A.weight"],
            lora_config(LoraSettings(rank=4)),
            max_model_len=8,
            gpu_memory_utilization=0.9,
            dtype="float32",
            workdir=tmp_path,
            platform="cuda",
        )
    assert started == []  # refused before vLLM was asked


def test_vllm_is_sized_to_the_apps_largest_call():
    """max_num_seqs: a learner's rollouts of a round (per-round 64) or an evaluation's prompts ×
    samples (32 × 8 = 256), whichever is larger; no evaluation, no evaluation batch."""
    from fedopd.config import parse_run_config
    from fedopd.rollout.vllm_engine import llm_kwargs, run_max_num_seqs, workload_max_num_seqs

    assert workload_max_num_seqs(64) == 64 and workload_max_num_seqs(64, 32, 8) == 256 and workload_max_num_seqs(512, 4, 8) == 512
    cfg = parse_run_config({"rollout.per-round": 64, "eval.every": 2, "eval.prompts-per-client": 32, "eval.samples": 8})
    assert run_max_num_seqs(cfg) == 256
    assert run_max_num_seqs(parse_run_config({"rollout.per-round": 64, "eval.every": 0, "eval.prompts-per-client": 32})) == 64
    # the Centralized learner generates every client's rollouts in one call: 3 x 32 = 96
    central = {"strategy.name": "centralized", "rollout.per-round": 32, "eval.every": 0}
    assert run_max_num_seqs(parse_run_config({**central, "num-clients": 3})) == 96
    assert run_max_num_seqs(parse_run_config(central)) is None  # clients unknown: vLLM's default
    base = dict(lora_rank=8, max_model_len=64, gpu_memory_utilization=0.3, dtype="bfloat16", seed=0)
    assert llm_kwargs("m", **base, max_num_seqs=96)["max_num_seqs"] == 96
    assert "max_num_seqs" not in llm_kwargs("m", **base)  # vLLM's default
