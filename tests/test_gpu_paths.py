"""GPU paths: vLLM rollouts (where vLLM and CUDA exist), and the client round, the fp32 head and the
batched candidate scores at bf16 (marked gpu: on CUDA where there is one and on the CPU in bf16
always, tests/devices.py), against bounds derived from bf16's precision (tests/precision.py)."""

import dataclasses

import numpy as np
import pytest
import torch
from devices import CUDA, on_bf16_devices
from model_fixtures import VLLM_GPU_HEAD_SIZE
from precision import (
    PAIR,
    U32,
    UBF16,
    coarse_rounding_kl,
    coarse_rounding_kl_change,
    head_rounding,
    head_rows,
    hidden_error_bf16,
    kl_change_from_logit_shift,
    logit_shift_e_max,
    logit_shift_kl,
    lse_error,
)

import fedopd.distill.cache as cache_module
from fedopd.rollout import HFRolloutEngine, SamplingParams, make_rollout_engine
from fedopd.rollout.vllm_engine import request_seeds, vllm_available

needs_vllm = pytest.mark.skipif(not (vllm_available() and CUDA), reason="vLLM is not installed or no CUDA device is present")


def test_request_seeds_are_distinct_and_reproducible():
    seeds = request_seeds(0, 16)
    assert len(set(seeds)) == 16 and seeds == request_seeds(0, 16) and seeds != request_seeds(1, 16)


@pytest.mark.skipif(vllm_available(), reason="vLLM and CUDA are present: the refusal does not apply")
def test_asking_for_vllm_without_it_is_a_clear_error(tiny_pair):
    with pytest.raises(ValueError, match="rollout.backend = 'vllm' needs vLLM with a CUDA GPU, or vLLM's CPU build"):
        make_rollout_engine("vllm", tiny_pair[0])
    assert isinstance(make_rollout_engine("auto", tiny_pair[0]), HFRolloutEngine)


@pytest.mark.slow
def test_the_vllm_gpu_student_has_a_head_size_vllm_runs(vllm_gpu_student):
    """The fixture of the vLLM GPU test below, checked where that test cannot run: it loads like any
    model folder, and its head size is one that vLLM's GPU backends and its CPU build take."""
    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm
    from fedopd.rollout.vllm_engine import cpu_head_size_problem

    student = attach_lora(load_causal_lm(vllm_gpu_student), LoraSettings(), seed=0)
    config = student.causal_lm.config
    assert config.head_dim == VLLM_GPU_HEAD_SIZE and cpu_head_size_problem(vllm_gpu_student, config) is None
    ids = student.tokenizer("1+1=")["input_ids"]
    out = HFRolloutEngine(student).generate([ids], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
    assert len(out.response_ids[0]) >= 1


@pytest.mark.gpu
@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_serves_each_new_adapter_fresh(vllm_gpu_student):
    """On CUDA, in bf16, on a tiny student with head size 64 (vLLM's GPU attention backends do not
    take the built-in tiny student's 16; tests/test_vllm_engine.py covers adapter swaps on vLLM's
    CPU build on the sandbox student)."""
    import os

    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm

    # Built locally (offline); FEDTOPS_VLLM_TEST_MODEL can name a hub model instead.
    name = os.environ.get("FEDTOPS_VLLM_TEST_MODEL") or vllm_gpu_student
    student = attach_lora(load_causal_lm(name, device=torch.device("cuda")), LoraSettings(), seed=0)
    assert student.dtype == torch.bfloat16  # model.dtype auto on CUDA; vLLM runs the same dtype
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


@pytest.mark.slow
@on_bf16_devices
@pytest.mark.parametrize("name", ["builtin:tiny-student", "builtin:sandbox-teacher"])
def test_a_bf16_forward_is_within_the_bf16_bound_of_the_float64_forward(device, name):
    """The model of one bf16 evaluation (precision.hidden_error_bf16) against the float64 forward of
    the same bf16 weights, where the bf16 roundings really happen (two bf16 passes of the tests
    below may agree bit for bit on a CPU): ||Δh|| within the bound, and the KL of the bf16
    distribution from the float64 one within precision.logit_shift_kl of that Δh. Of the built-in
    models, the tiny student comes closest to its bound in KL, the sandbox teacher in ||Δh||
    (about 44 % of it); an fp32 bound (u = 2^-24 in place of 2^-8) fails on both."""
    import copy

    from fedopd.models import load_causal_lm

    lm = load_causal_lm(name, dtype="bfloat16", device=torch.device(device))
    exact = copy.deepcopy(lm.causal_lm).double()
    exact.set_attn_implementation("sdpa")  # flash-attention 2 (a bf16 model's on CUDA, where installed) takes no float64
    seq_len = 60
    ids = torch.randint(3, 200, (4, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        h = lm.causal_lm.model(input_ids=ids).last_hidden_state
        h_exact = exact.model(input_ids=ids).last_hidden_state
        logits, logits_exact = lm.logits(h).double().cpu(), (h_exact @ exact.get_output_embeddings().weight[: lm.logit_width].T).cpu()
    dh = hidden_error_bf16(lm, seq_len)
    observed = (h.double() - h_exact).norm(dim=-1).max().item()
    assert observed <= dh, f"||Δh|| {observed:.3g} exceeds the bf16 bound {dh:.3g}"
    log_p = torch.log_softmax(logits_exact, -1)
    kl = (log_p.exp() * (log_p - torch.log_softmax(logits, -1))).sum(-1).flatten()
    bound = logit_shift_kl(log_p.exp().reshape(-1, lm.logit_width), head_rows(lm), dh, head_rounding(lm))
    assert torch.all(kl <= bound), f"KL {kl.max().item():.3g} above its bf16 bound at {int((kl > bound).sum())} positions"


def _capture_coarsened_logits(monkeypatch) -> list[torch.Tensor]:
    """The fp32 logits each call of fedopd.distill.cache.coarsen_logits receives, in call order."""
    seen = []
    original = cache_module.coarsen_logits
    monkeypatch.setattr(cache_module, "coarsen_logits", lambda z, ids: seen.append(z.detach().double().cpu()) or original(z, ids))
    return seen


@pytest.mark.slow
@on_bf16_devices
def test_client_round_at_bf16_with_the_hf_engine(device, monkeypatch):
    from conftest import TINY

    from fedopd.config import parse_run_config
    from fedopd.data import encode_prompts, tiny_arith_partition
    from fedopd.engine.round import ClientModels, RoundPlan, load_client_models, score_round, train_round
    from fedopd.models.lora import increment

    monkeypatch.setenv("FEDTOPS_DEVICE", device)  # where load_client_models puts the models
    # lr 2e-2 (TINY: 2e-3): one step moves the student by more than bf16 rounding could (below)
    cfg = parse_run_config({**TINY, "train.lr": 2e-2})
    models = load_client_models(cfg.model.student, cfg.model.teacher, lora=cfg.lora, backend="hf", dtype="bfloat16", seed=0)
    assert models.student.device.type == device and models.student.dtype == torch.bfloat16
    models = ClientModels(models.student, models.teacher, HFRolloutEngine(models.student))
    prompts = encode_prompts(models.student.tokenizer, tiny_arith_partition(0, 3, 16, 42), 2048)
    theta = models.student.get_lora_arrays()
    logits = _capture_coarsened_logits(monkeypatch)
    plan = RoundPlan(
        server_round=1,
        seed=1,
        rollout=dataclasses.replace(cfg.rollout, per_round=4, max_new_tokens=8),
        cache=cfg.cache,
        train=dataclasses.replace(cfg.train, exact_kl=True),
        step_offset=0,
        total_steps=1,
        teacher_batch=2,
    )
    out = train_round(models, theta, prompts, plan)
    assert out.metrics["kl_after"] < out.metrics["kl_before"]
    assert len(logits) == 2  # the cache's teacher rows, then its student rows
    cached = logits[1]
    _, k = score_round(models, theta, increment(out.arrays, theta), out.cache, [0.0, 3.0])
    # K̂(0) = mean KL(π̃_t ‖ π̃_{t,0}): two bf16 evaluations of θ_t (the cache's forward, and the
    # batched scoring pass with its stacked factors and twice the rows), so exactly 0 but for
    # rounding. Their final hidden states differ by ||Δh|| ≤ 2·hidden_error_bf16 (10 % of ||h||
    # each, a priori), their fp32 heads by |Δr| ≤ 2·head_rounding; the logits by e = W·Δh + Δr, and
    #   KL(p ‖ q) ≤ ψ(2·e_max)·(sqrt(λ_max(Cov_p(w)))·||Δh|| + |Δr|)²   (precision.logit_shift_kl:
    # KL = log E_p[exp(e − E_p e)], Bennett's inequality, Var_p(W·Δh) ≤ λ_max·||Δh||²), which
    # coarsening cannot increase, plus the fp32 logsumexps of the coarsening (coarse_rounding_kl).
    # p: the full softmax of the cached fp32 logits. Tiny student: ≈ 1.5e-3.
    student = models.student
    rows = head_rows(student)
    dh = PAIR * hidden_error_bf16(student, out.cache.input_ids.shape[1])
    r = PAIR * head_rounding(student)
    rounding = coarse_rounding_kl(lse_error(student), logit_shift_e_max(rows, dh, r))
    bound = logit_shift_kl(torch.softmax(cached, -1), rows, dh, r).mean().item() + rounding
    assert k[0] <= bound, f"K̂(0) = {k[0]:.3g} exceeds the bf16 bound {bound:.3g}"
    # Not vacuous: three times the round's own step moves π̃ by far more than the bound (K̂ grows
    # as a² for small steps: CPU K̂(1) ≈ 3e-3, so K̂(3) ≈ 3e-2, against a bound of ≈ 1.5e-3), so a
    # cache scored under θ_t + 3Δ would fail above. (a = 1 alone is only ~2x the bound on CPU: a
    # GPU's other rollouts could bring it under by chance.)
    assert k[1] > bound, f"K̂(3) = {k[1]:.3g} is within the bf16 bound {bound:.3g}: the test could not tell a = 3 from a = 0"


@on_bf16_devices
def test_fp32_head_on_bf16_gives_the_fp32_product_of_the_bf16_values(device):
    from fedopd.models import fp32_head

    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(64, 256, device=device, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(1000, 256, device=device, generator=g).bfloat16()
    saved = torch.backends.cuda.matmul.allow_tf32
    out = fp32_head(h, w)
    assert out.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 == saved
    reference = h.detach().double() @ w.double().T
    # bf16 values are exact in TF32 and their products exact in fp32; tensor cores accumulate in
    # fp32 but may truncate (Fasi et al., PeerJ CS 2021): no mean-zero rounding, so the worst case
    # with one ulp (2u) per addition, γ_n·Σ|h_i w_i| with γ_n = n·2u/(1 − n·2u), n = 256 (on the
    # CPU, fp32 rounded to nearest: within the same bound).
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


@pytest.mark.slow
@on_bf16_devices
def test_batched_candidate_scores_at_bf16_equal_one_pass_per_candidate(device, monkeypatch):
    from fedopd.config import CacheSettings, LoraSettings
    from fedopd.distill.cache import build_scoring_cache, coarsen_logits, score_candidates
    from fedopd.models import load_pair
    from fedopd.rollout import Rollouts

    on = torch.device(device)
    student, teacher = load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=LoraSettings(), seed=0, dtype="bfloat16", device=on)
    assert student.dtype == torch.bfloat16 and student.device.type == device
    rng = np.random.default_rng(3)
    theta = {n: 0.2 * rng.standard_normal(a.shape).astype(np.float32) for n, a in student.get_lora_arrays().items()}
    delta = {n: 0.05 * rng.standard_normal(a.shape).astype(np.float32) for n, a in theta.items()}
    student.set_lora_arrays(theta)
    rollouts = Rollouts([[258, 70, 71], [258, 80]], [[60, 61, 62, 63, 64], [90, 91, 92, 93, 94, 95]], [False, False])
    cache = build_scoring_cache(student, teacher, rollouts, CacheSettings(rollouts=2, positions=4, top_k=3), seed=0)
    candidates = [0.5, 1.0, 3.0, 10.0]
    logits = _capture_coarsened_logits(monkeypatch)  # what each path hands to coarsen_logits, candidate-major in both
    batched = score_candidates(student, cache, theta, delta, candidates)
    batched_logits = torch.cat(logits)
    logits.clear()
    sequential = score_candidates(student, cache, theta, delta, candidates, batched=False)
    sequential_logits = torch.cat(logits)

    # Both paths are bf16 evaluations of each candidate (stacked factors over 4x the rows, or PEFT
    # one candidate at a time): final hidden states within ||Δh|| ≤ 2·hidden_error_bf16, heads
    # within |Δr| ≤ 2·head_rounding (precision.py). Per candidate, the sequential distribution q
    # and the batched one are within KL ≤ ψ·(sqrt(λ_max(Cov_q(w)))·||Δh|| + |Δr|)²
    # (precision.logit_shift_kl, the proof there), ≈ 1.4e-3 for the tiny student, mean over positions.
    n, width = cache.num_positions, cache.input_ids.shape[1]
    rows, dh, r = head_rows(student), PAIR * hidden_error_bf16(student, width), PAIR * head_rounding(student)
    log_q = torch.log_softmax(sequential_logits, -1)
    q = log_q.exp()
    kl = (q * (log_q - torch.log_softmax(batched_logits, -1))).sum(-1)
    bound = logit_shift_kl(q, rows, dh, r)
    per_candidate = [(kl[c * n : (c + 1) * n].mean().item(), bound[c * n : (c + 1) * n].mean().item()) for c in range(len(candidates))]
    assert all(value <= limit for value, limit in per_candidate), per_candidate
    # Not vacuous: any two candidates' distributions are further apart than the bound (mean KL
    # ≥ 7.6e-3 on the CPU, 5x it), so a batched pass that ran a block under another candidate's
    # factors would fail above.
    for c, (_, limit) in enumerate(per_candidate):
        for other in range(len(candidates)):
            if other != c:
                mine, theirs = slice(c * n, (c + 1) * n), slice(other * n, (other + 1) * n)
                apart = (q[mine] * (log_q[mine] - log_q[theirs])).sum(-1).mean().item()
                assert apart > limit, f"candidates {candidates[c]} and {candidates[other]}: KL {apart:.3g} within the bound {limit:.3g}"

    # The scores, Ĵ = mean KL(q̃ ‖ π̃_a) and K̂ = mean KL(π̃_t ‖ π̃_a) with the cached rows fixed:
    # |ΔKL| ≤ ||Σ_S (p̃_i − q̃_i)·w_i||·||Δh|| + Σ_S|p̃_i − q̃_i|·|Δr| + |p̃_tail − q̃_tail|·e_max
    #        + ψ·Var_q(e)   (precision.kl_change_from_logit_shift), plus the coarsening's fp32
    # logsumexps (coarse_rounding_kl_change). First order in ||Δh||, through the mean head row of
    # the cached row against the candidate's: about a third of Ĵ and one to thirteen times K̂ here,
    # so the distributions above are where a fault shows; these bound the scores as reported.
    token_ids = torch.from_numpy(cache.token_ids)
    e_max = logit_shift_e_max(rows, dh, r)
    rounding = coarse_rounding_kl_change(lse_error(student), e_max)
    for c in range(len(candidates)):
        z = sequential_logits[c * n : (c + 1) * n]
        q_coarse = coarsen_logits(z.float(), token_ids)
        q_full = q[c * n : (c + 1) * n]
        for column, cached in ((0, cache.teacher), (1, cache.student)):
            limit = kl_change_from_logit_shift(torch.from_numpy(cached), q_coarse, q_full, token_ids, rows, dh, r).mean().item() + rounding
            got = (batched[column][c], sequential[column][c])
            assert abs(got[0] - got[1]) <= limit, (
                f"{('Ĵ', 'K̂')[column]}({candidates[c]}): batched {got[0]:.6g}, sequential {got[1]:.6g}, bound {limit:.3g}"
            )
