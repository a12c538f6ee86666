"""GPU paths: vLLM rollouts (where vLLM and CUDA exist) and the HF path on CUDA."""

import dataclasses

import numpy as np
import pytest
import torch

from fedopd.rollout import HFRolloutEngine, SamplingParams, make_rollout_engine
from fedopd.rollout_vllm import request_seeds, vllm_available

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed or no CUDA device is present")


def test_request_seeds_are_distinct_and_reproducible():
    seeds = request_seeds(0, 16)
    assert len(set(seeds)) == 16 and seeds == request_seeds(0, 16) and seeds != request_seeds(1, 16)


@pytest.mark.skipif(vllm_available(), reason="vLLM and CUDA are present: the refusal does not apply")
def test_asking_for_vllm_without_it_is_a_clear_error(tiny_pair):
    with pytest.raises(ValueError, match="rollout.backend = 'vllm' needs vLLM installed and a CUDA GPU"):
        make_rollout_engine("vllm", tiny_pair[0])
    assert isinstance(make_rollout_engine("auto", tiny_pair[0]), HFRolloutEngine)


@needs_vllm
def test_vllm_engine_serves_each_new_adapter_fresh():
    import os

    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm

    # The built-in tiny student by default (offline); FEDTOPS_VLLM_TEST_MODEL can name a hub model.
    name = os.environ.get("FEDTOPS_VLLM_TEST_MODEL", "builtin:tiny-student")
    student = attach_lora(load_causal_lm(name), LoraSettings(), seed=0)
    engine = make_rollout_engine("vllm", student, max_model_len=512, gpu_memory_utilization=0.3)
    prompts = [student.tokenizer("The capital of France is")["input_ids"]] * 4
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, seed=7)
    zero = {n: np.zeros_like(a) for n, a in student.get_lora_arrays().items()}
    rng = np.random.default_rng(0)
    big = {n: rng.standard_normal(a.shape).astype(np.float32) * 0.5 for n, a in zero.items()}
    engine.set_adapter(zero)
    first = engine.generate(prompts, params)
    engine.set_adapter(big)
    changed = engine.generate(prompts, params)
    engine.set_adapter(zero)  # same weights again under a fresh name and id
    again = engine.generate(prompts, params)
    assert first.response_ids == again.response_ids
    assert first.response_ids != changed.response_ids
    assert len(set(map(tuple, first.response_ids))) > 1  # per-request seeds: independent samples
    for r, capped in zip(first.response_ids, first.capped):
        assert len(r) <= 16 and capped == (len(r) == 16 and r[-1] != student.tokenizer.eos_token_id)


@needs_cuda
def test_client_round_on_cuda_with_the_hf_engine():
    from conftest import TINY
    from fedopd.config import parse_run_config
    from fedopd.data import encode_prompts, tiny_arith_partition
    from fedopd.lora import increment
    from fedopd.round import ClientModels, load_client_models, score_round, train_round

    cfg = parse_run_config(TINY)
    models = load_client_models(cfg.model.student, cfg.model.teacher, lora=cfg.lora, backend="hf", seed=0)
    assert models.student.device.type == "cuda" and models.student.dtype == torch.bfloat16
    models = ClientModels(models.student, models.teacher, HFRolloutEngine(models.student))
    prompts = encode_prompts(models.student.tokenizer, tiny_arith_partition(0, 3, 16, 42), 2048)
    theta = models.student.get_lora_arrays()
    out = train_round(
        models, theta, prompts, rollout=dataclasses.replace(cfg.rollout, per_round=8, max_new_tokens=16),
        cache=cfg.cache, train=cfg.train, server_round=1, seed=1, step_offset=0, total_steps=2, teacher_batch=2,
    )
    assert out.metrics["kl_after"] < out.metrics["kl_before"]
    j, k = score_round(models, theta, increment(out.arrays, theta), out.cache, [0.0, 1.0])
    assert k[0] == pytest.approx(0.0, abs=1e-6)
