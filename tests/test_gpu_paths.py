"""GPU paths: vLLM rollouts (where vLLM and CUDA exist) and the HF path on CUDA."""

import dataclasses

import numpy as np
import pytest
import torch
from precision import U32, UBF16

from fedopd.rollout import HFRolloutEngine, SamplingParams, make_rollout_engine
from fedopd.rollout.vllm_engine import request_seeds, vllm_available

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
needs_vllm = pytest.mark.skipif(not (vllm_available() and CUDA), reason="vLLM is not installed or no CUDA device is present")


def test_request_seeds_are_distinct_and_reproducible():
    seeds = request_seeds(0, 16)
    assert len(set(seeds)) == 16 and seeds == request_seeds(0, 16) and seeds != request_seeds(1, 16)


@pytest.mark.skipif(vllm_available(), reason="vLLM and CUDA are present: the refusal does not apply")
def test_asking_for_vllm_without_it_is_a_clear_error(tiny_pair):
    with pytest.raises(ValueError, match="rollout.backend = 'vllm' needs vLLM with a CUDA GPU, or vLLM's CPU build"):
        make_rollout_engine("vllm", tiny_pair[0])
    assert isinstance(make_rollout_engine("auto", tiny_pair[0]), HFRolloutEngine)


@needs_vllm
def test_vllm_engine_serves_each_new_adapter_fresh():
    """On CUDA (its CPU build cannot run the tiny student's head size 16: tests/test_vllm_engine.py
    covers adapter swaps there on the sandbox student)."""
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
    from fedopd.engine.round import ClientModels, RoundPlan, load_client_models, score_round, train_round
    from fedopd.models.lora import increment

    cfg = parse_run_config(TINY)
    models = load_client_models(cfg.model.student, cfg.model.teacher, lora=cfg.lora, backend="hf", seed=0)
    assert models.student.device.type == "cuda" and models.student.dtype == torch.bfloat16
    models = ClientModels(models.student, models.teacher, HFRolloutEngine(models.student))
    prompts = encode_prompts(models.student.tokenizer, tiny_arith_partition(0, 3, 16, 42), 2048)
    theta = models.student.get_lora_arrays()
    plan = RoundPlan(
        server_round=1,
        seed=1,
        rollout=dataclasses.replace(cfg.rollout, per_round=8, max_new_tokens=16),
        cache=cfg.cache,
        train=dataclasses.replace(cfg.train, exact_kl=True),
        step_offset=0,
        total_steps=2,
        teacher_batch=2,
    )
    out = train_round(models, theta, prompts, plan)
    assert out.metrics["kl_after"] < out.metrics["kl_before"]
    j, k = score_round(models, theta, increment(out.arrays, theta), out.cache, [0.0, 1.0])
    # Empirical, not derived: an a priori bound for bf16 layers (u = 2^-8 at every stage output,
    # logit error ~0.1 by precision.logit_error's model) is vacuous for a KL between two evaluations
    # of the same distribution; unverified on CPU-only machines.
    assert k[0] == pytest.approx(0.0, abs=1e-6)


@needs_cuda
def test_fp32_head_on_bf16_cuda_gives_the_fp32_product_of_the_bf16_values():
    from fedopd.models import fp32_head

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(64, 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(1000, 256, device="cuda", generator=g).bfloat16()
    saved = torch.backends.cuda.matmul.allow_tf32
    out = fp32_head(h, w)
    assert out.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 == saved
    reference = h.detach().double() @ w.double().T
    # bf16 values are exact in TF32 and their products exact in fp32; tensor cores accumulate in
    # fp32 but may truncate (Fasi et al., PeerJ CS 2021): no mean-zero rounding, so the worst case
    # with one ulp (2u) per addition, γ_n·Σ|h_i w_i| with γ_n = n·2u/(1 − n·2u), n = 256.
    n = h.shape[-1]
    gamma = n * 2 * U32 / (1 - n * 2 * U32)
    bound = gamma * (h.detach().double().abs() @ w.double().abs().T)
    assert torch.all((out.double() - reference).abs() <= bound)
    assert ((h.detach() @ w.T).double() - reference).abs().max() > bound.max()  # bf16 logits would be told apart
    out.sum().backward()
    # dL/dh = ones @ w: 1000-term fp32 (TF32) sums of exact bf16 values, error e ≤ γ_1000·Σ|w|, then
    # rounded to bf16: |bf16(a) − b| ≤ e(1 + 2^-8) + 2^-8·|b|.
    column = w.double().sum(0).expand(64, -1)
    m = w.shape[0]
    e = m * 2 * U32 / (1 - m * 2 * U32) * w.double().abs().sum(0).expand(64, -1)
    assert torch.all((h.grad.double() - column).abs() <= e * (1 + UBF16) + UBF16 * column.abs())


@needs_cuda
def test_batched_candidate_scores_on_cuda_equal_one_pass_per_candidate():
    from fedopd.config import CacheSettings, LoraSettings
    from fedopd.distill.cache import build_scoring_cache, score_candidates
    from fedopd.models import load_pair
    from fedopd.rollout import Rollouts

    student, teacher = load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=LoraSettings(), seed=0)
    rng = np.random.default_rng(3)
    theta = {n: 0.2 * rng.standard_normal(a.shape).astype(np.float32) for n, a in student.get_lora_arrays().items()}
    delta = {n: 0.05 * rng.standard_normal(a.shape).astype(np.float32) for n, a in theta.items()}
    student.set_lora_arrays(theta)
    rollouts = Rollouts([[258, 70, 71], [258, 80]], [[60, 61, 62, 63, 64], [90, 91, 92, 93, 94, 95]], [False, False])
    cache = build_scoring_cache(student, teacher, rollouts, CacheSettings(rollouts=2, positions=4, top_k=3), seed=0)
    batched = score_candidates(student, cache, theta, delta, [0.5, 1.0, 3.0, 10.0])
    sequential = score_candidates(student, cache, theta, delta, [0.5, 1.0, 3.0, 10.0], batched=False)
    # bf16 base layers, batched differently. Empirical, not derived: precision's a priori model with
    # u = 2^-8 gives logit errors ~0.1 and a vacuous KL bound; unverified on CPU-only machines.
    np.testing.assert_allclose(batched, sequential, rtol=2e-2, atol=1e-4)
