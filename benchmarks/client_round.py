"""Benchmark: seconds per phase of one client round, and the memory the chunked loss saves.

    python benchmarks/client_round.py                  # both parts, tiny models, CPU or GPU
    python benchmarks/client_round.py --part round --rollouts 32 --max-new-tokens 64
    python benchmarks/client_round.py --part loss --positions 1024 2048 4096 --vocab 151936
    python benchmarks/client_round.py --part round --models paper --max-new-tokens 1024   # GPU
    python benchmarks/client_round.py --part loss --liger       # GPU: + liger-kernel's fused linear JSD

``--models paper`` builds, in memory and with random weights (nothing is downloaded), a student
of Qwen3-0.6B's architecture and a teacher of Qwen3-8B's (``--teacher-arch 1.7b`` for a smaller
one), both with Qwen's 151,936-token vocabulary and a word-level tokenizer of that size, and runs
the paper's client round on them (32 rollouts, mini-/micro-batch 8/4, activation checkpointing,
HF rollouts). A random student's rollouts run to ``--max-new-tokens`` (the cap-hit worst case).
It also times one training pass over micro-batches of unequal length, padded against packed.

Part "round" loads the built-in tiny student and teacher and runs one client round (rollouts,
grading, scoring cache, teacher pass, local OPD) and the candidate scores of the query, printing
seconds per phase and the process's peak memory.

Part "loss" measures the extra peak memory of one forward+backward pass of the reverse-KL loss at
P positions × V vocabulary from hidden states of width H (Qwen3-0.6B: H = 1024), once with
:func:`fedopd.distill.opd.reverse_kl_sum_from_hidden` (chunked, checkpointed) and once unchunked (full
P × V logits). Each measurement runs in a fresh subprocess; on CPU "peak" is the rise of the
resident set's high-water mark over the inputs, on GPU ``torch.cuda.max_memory_allocated``.
An unchunked case whose predicted need exceeds the free memory is reported as skipped.

Prints figures; asserts nothing. Timings are for the machine it runs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch

GiB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_device_bytes() -> int:
    """Peak GPU memory allocated since the last reset; on CPU the process's peak resident set."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _peak_rss_bytes()


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------
# Part 1: one client round
# ---------------------------------------------------------------------------------------------


QWEN3_ARCH = {  # the configs of the hub's Qwen3 models (hidden, layers, heads, kv heads, ffn, tied, head dim)
    "0.6b": (1024, 28, 16, 8, 3072, True, 128),
    "1.7b": (2048, 28, 16, 8, 6144, True, 128),
    "8b": (4096, 36, 32, 8, 12288, False, 128),
    # the same shapes scaled down, for CPU dry runs of the scripts that build these (--tiny)
    "tiny-student": (64, 2, 4, 2, 128, True, 16),
    "tiny-teacher": (128, 2, 4, 2, 256, False, 32),
}
QWEN3_VOCAB = 151936


def word_level_tokenizer(vocab: int = QWEN3_VOCAB):
    """A tokenizer with ``vocab`` entries and Qwen's special-token ids (eos <|im_end|> = 151645)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words["<|endoftext|>"], words["<|im_end|>"] = 151643, 151645
    del words["t151643"], words["t151645"]
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return fast


def paper_models(teacher_arch: str, seed: int = 0, *, layers: int | None = None, dtype: torch.dtype | None = None, student_arch: str = "0.6b"):
    """Random-weight Qwen3 student (0.6B architecture, LoRA attached) and teacher, bf16 on the GPU
    (fp32 on the CPU, for a smoke run); ``layers``: that many layers of each instead of the
    architecture's, ``dtype``: another dtype, ``student_arch``: another student's shape."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from fedopd.config import LoraSettings
    from fedopd.models import CausalLM, attach_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = word_level_tokenizer()
    out = []
    for arch, name in ((student_arch, "student"), (teacher_arch, "teacher")):
        h, arch_layers, heads, kv, ffn, tied, head_dim = QWEN3_ARCH[arch]
        n_layers = layers or arch_layers
        config = Qwen3Config(
            vocab_size=QWEN3_VOCAB,
            hidden_size=h,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=ffn,
            tie_word_embeddings=tied,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            bos_token_id=151643,
            eos_token_id=151645,
            pad_token_id=151643,
        )
        torch.manual_seed(seed + len(out))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        out.append(CausalLM(model, tokenizer, device, dtype, QWEN3_VOCAB, f"random Qwen3-{arch} ({name})"))
    return attach_lora(out[0], LoraSettings(), seed), out[1]


def paper_prompts(n: int, length: int, seed: int = 0):
    from fedopd.data import Prompt

    rng = np.random.default_rng(seed)
    return [Prompt(f"p{i}", "0", "random", tuple(int(t) for t in rng.integers(0, 151000, size=length))) for i in range(n)]


def bench_padding(models, args) -> None:
    """One training pass (forward+backward of the loss) over micro-batches of unequal length."""
    from fedopd.distill.opd import make_micro_batches, micro_batches, minibatch_gradient, teacher_pass
    from fedopd.rollout import Rollouts

    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(args.max_new_tokens // 8, args.max_new_tokens + 1, size=8)]
    prompts = [list(p.token_ids) for p in paper_prompts(8, 128, seed=2)]
    responses = [[int(t) for t in rng.integers(0, 151000, size=n)] for n in lengths]
    rollouts = Rollouts(prompts, responses, [False] * 8)
    plan = micro_batches(8, 8, 4)
    student, teacher = models.student, models.teacher
    student.model.train()
    print(
        f"\n== one mini-batch (8 responses of {min(lengths)}-{max(lengths)} tokens, micro-batch 4), "
        f"forward+backward of the loss, attention {student.attn_implementation} =="
    )
    for packed in (False, True, False, True):
        batches = make_micro_batches(rollouts, plan, 151643, student.device, packed=packed)
        hidden = teacher_pass(teacher, batches, 2)
        _sync()
        _reset_peak()
        t0 = time.perf_counter()
        loss = minibatch_gradient(student, teacher, list(batches.values()), list(hidden.values()), 1024)
        _sync()
        seconds = time.perf_counter() - t0
        student.model.zero_grad(set_to_none=True)
        computed = sum(b.input_ids.numel() for b in batches.values())
        print(
            f"  {'packed' if packed else 'padded':<7s} {seconds:7.3f} s  tokens computed {computed:6d}  "
            f"loss {loss:.6f}  peak {_peak_device_bytes() / GiB:6.2f} GiB"
        )
    student.model.eval()


def bench_paper_round(args) -> None:
    from fedopd.config import parse_run_config
    from fedopd.distill.cache import score_candidates
    from fedopd.engine.round import ClientModels, RoundPlan, score_round, train_round
    from fedopd.models.lora import increment
    from fedopd.rollout import HFRolloutEngine

    cfg = parse_run_config({})
    t0 = time.perf_counter()
    student, teacher = paper_models(args.teacher_arch)
    models = ClientModels(student, teacher, HFRolloutEngine(student))
    load_s = time.perf_counter() - t0
    prompts = paper_prompts(64, args.prompt_tokens)
    theta = student.get_lora_arrays()
    rollout = dataclasses.replace(cfg.rollout, per_round=args.rollouts, max_new_tokens=args.max_new_tokens)
    train = dataclasses.replace(cfg.train, lr=3e-6, mini_batch=8, micro_batch=4, gradient_checkpointing=True)
    _reset_peak()
    rows = []
    for server_round in (1, 2):  # round 1 warms up kernels and allocator; round 2 is reported
        plan = RoundPlan(
            server_round=server_round, seed=0, rollout=rollout, cache=cfg.cache, train=train, step_offset=0, total_steps=8, teacher_batch=2
        )
        out = train_round(models, theta, prompts, plan)
        delta = increment(out.arrays, theta)
        _sync()
        t1 = time.perf_counter()
        score_round(models, theta, delta, out.cache, cfg.strategy.candidates)
        _sync()
        score_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        score_candidates(models.student, out.cache, theta, delta, cfg.strategy.candidates, batched=False)
        _sync()
        sequential_s = time.perf_counter() - t1
    m = out.metrics
    gen_tokens = m["response_length"] * args.rollouts
    train_tokens = m["tokens"]
    total = m["total_s"] + score_s
    print(f"\n== one client round, paper architectures with random weights on {_device_name()} ==")
    print(
        f"  student {student.name}, teacher {teacher.name}; {args.rollouts} rollouts of {args.prompt_tokens}-token "
        f"prompts, mean response {m['response_length']:.0f} tokens (cap {args.max_new_tokens}, cap-hit "
        f"{100 * m['cap_hit_rate']:.0f} %), {str(student.dtype).removeprefix('torch.')}, "
        f"{student.attn_implementation} attention, activation checkpointing"
    )
    rows = [
        ("build both models (once per process)", load_s, ""),
        ("rollouts (HF generate)", m["rollout_s"], f"{gen_tokens / m['rollout_s']:9.0f} tok/s"),
        ("grading", m["grade_s"], ""),
        ("teacher pass (every rollout, once)", m["teacher_s"], f"{train_tokens / m['teacher_s']:9.0f} tok/s"),
        ("scoring cache (student on 4 rollouts)", m["cache_s"], ""),
        ("local OPD (4 steps)", m["opd_s"], f"{train_tokens / m['opd_s']:9.0f} tok/s"),
        (f"candidate scores, batched ({len(cfg.strategy.candidates)})", score_s, ""),
        ("candidate scores, one pass each", sequential_s, ""),
        ("round total (without load)", total, ""),
    ]
    for name, seconds, rate in rows:
        print(f"  {name:<42s} {seconds:8.3f} s {rate}")
    print(f"  {'FedTOPS cost (cache + scores) / round':<42s} {100 * (m['cache_s'] + score_s) / total:7.1f} %")
    print(f"  {'peak memory':<42s} {_peak_device_bytes() / GiB:8.2f} GiB")
    bench_padding(models, args)


def bench_round(args) -> None:
    if args.models == "paper":
        return bench_paper_round(args)
    from fedopd.config import parse_run_config
    from fedopd.data import encode_prompts, tiny_arith_partition
    from fedopd.engine.round import RoundPlan, load_client_models, score_round, train_round
    from fedopd.models.lora import increment

    cfg = parse_run_config({})
    t0 = time.perf_counter()
    models = load_client_models(cfg.model.student, cfg.model.teacher, lora=cfg.lora, backend="hf", seed=cfg.seed)
    load_s = time.perf_counter() - t0
    prompts = encode_prompts(models.student.tokenizer, tiny_arith_partition(0, 3, 64, cfg.seed), 2048)
    theta = models.student.get_lora_arrays()
    rollout = dataclasses.replace(cfg.rollout, per_round=args.rollouts, max_new_tokens=args.max_new_tokens)
    if models.student.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    plan = RoundPlan(
        server_round=1, seed=cfg.seed, rollout=rollout, cache=cfg.cache, train=cfg.train, step_offset=0, total_steps=cfg.total_local_steps
    )
    out = train_round(models, theta, prompts, plan)
    t1 = time.perf_counter()
    score_round(models, theta, increment(out.arrays, theta), out.cache, cfg.strategy.candidates)
    score_s = time.perf_counter() - t1
    m = out.metrics
    print(
        f"\n== one client round: {cfg.model.student} / {cfg.model.teacher} on {models.student.device}, {args.rollouts} rollouts "
        f"(mean {m['response_length']:.1f} tokens, max {args.max_new_tokens}), torch threads {torch.get_num_threads()} =="
    )
    rows = [
        ("load models (once per process)", load_s),
        ("rollouts (HF generate)", m["rollout_s"]),
        ("grading", m["grade_s"]),
        ("scoring cache", m["cache_s"]),
        ("teacher pass", m["teacher_s"]),
        ("local OPD", m["opd_s"]),
        (f"candidate scores ({len(cfg.strategy.candidates)} candidates)", score_s),
        ("round total (without load)", m["total_s"] + score_s),
    ]
    for name, seconds in rows:
        print(f"  {name:<42s} {seconds:8.3f} s")
    print(f"  {'peak resident memory (process)':<42s} {_peak_rss_bytes() / GiB:8.3f} GiB")
    if models.student.device.type == "cuda":
        print(f"  {'peak GPU memory allocated':<42s} {torch.cuda.max_memory_allocated() / GiB:8.3f} GiB")


# ---------------------------------------------------------------------------------------------
# Part 2: the loss: chunked against unchunked, and liger-kernel's fused linear JSD
# ---------------------------------------------------------------------------------------------


def loss_case(case: str, positions: int, vocab: int, hidden: int, chunk: int) -> dict:
    """Runs in a subprocess: extra peak bytes and seconds of one forward+backward of the loss.

    On GPU the hidden states and head weights are bf16, as the models give them. ``app`` is the
    loss as local OPD runs it (:func:`fedopd.distill.opd.minibatch_gradient`): chunked, the
    gradient taken in the forward pass (``fused_scale`` = 1 / positions, the sum divided by the
    positions), fp32 logits from :func:`fedopd.models.fp32_head` (TF32 matmuls, exact for bf16 values). ``chunked`` and ``unchunked`` upcast to fp32 and multiply in
    plain fp32 (the earlier head; unchunked = full P × V logits). ``liger-bf16`` is
    liger-kernel's fused linear JSD at beta = 1 (reverse KL, hard-loss weight 0) on the bf16
    tensors (bf16 logits), ``liger-fp32`` the same on fp32 copies. One untimed call first (kernel
    selection, torch.compile for liger), then the timed one.
    """
    import torch.nn.functional as F

    from fedopd.distill.opd import divergence_sum_from_hidden, reverse_kl_sum_from_hidden, token_reverse_kl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    w_s = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(dtype)
    w_t = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(dtype)
    h_s = torch.randn(positions, hidden, device=device, generator=gen).to(dtype).requires_grad_(True)
    h_t = torch.randn(positions, hidden, device=device, generator=gen).to(dtype)
    head_s = lambda h: F.linear(h.float(), w_s.float())  # noqa: E731  (fedopd.models.CausalLM.logits)
    head_t = lambda h: F.linear(h.float(), w_t.float())  # noqa: E731

    if case.startswith("liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, chunk_size=chunk)
        labels = torch.zeros(positions, dtype=torch.long, device=device)
        if case == "liger-fp32":
            w_s, w_t = w_s.float(), w_t.float()
            h_s, h_t = h_s.detach().float().requires_grad_(True), h_t.float()

        def run():
            return jsd(h_s, w_s, h_t, w_t, labels) * positions  # liger returns the token mean
    elif case == "chunked":

        def run():
            return reverse_kl_sum_from_hidden(h_s, head_s, h_t, head_t, chunk)
    elif case == "app":  # local OPD's loss: the fused gradient, fedopd.models.fp32_head (TF32 for bf16 values on CUDA)
        from fedopd.models import fp32_head

        scale = float(torch.ones(()) / positions)  # as minibatch_gradient scales by 1 / tokens

        def run():
            head_s_app, head_t_app = (lambda h: fp32_head(h, w_s)), (lambda h: fp32_head(h, w_t))
            return divergence_sum_from_hidden(h_s, head_s_app, h_t, head_t_app, token_reverse_kl, chunk_size=chunk, fused_scale=scale) / positions
    else:

        def run():
            with torch.no_grad():
                t_logits = head_t(h_t)
            return token_reverse_kl(head_s(h_s), t_logits).sum()

    if device.type == "cuda":
        run().backward()  # warm-up
        h_s.grad = None
        _sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    loss = run()
    loss.backward()
    if device.type == "cuda":
        _sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes() - base
    return {
        "case": case,
        "positions": positions,
        "vocab": vocab,
        "peak_bytes": peak,
        "seconds": time.perf_counter() - t0,
        "loss": float(loss) if case == "app" else float(loss) / positions,  # the app's is the token mean already
        "device": device.type,
    }


def unchunked_need_bytes(positions: int, vocab: int) -> int:
    """What the unchunked loss needs: about nine fp32 (positions x vocabulary) buffers."""
    return 9 * positions * vocab * 4


def _free_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def bench_loss(args) -> None:
    # On CPU "chunked" (plain fp32 head) is the app's own path, so it is not repeated.
    cases = ["app", "unchunked"] + (["chunked"] if torch.cuda.is_available() else [])
    cases += ["liger-bf16", "liger-fp32"] if args.liger else []
    print(f"\n== reverse-KL loss, forward+backward, H = {args.hidden}, V = {args.vocab}, chunk = {args.chunk} ==")
    print(f"  {'positions':>9s}  {'case':<10s}  {'peak':>11s}  {'seconds':>8s}  {'loss / token':>13s}")
    for positions in args.positions:
        for case in cases:
            need = unchunked_need_bytes(positions, args.vocab) if case == "unchunked" else 0
            if need > 0.8 * _free_bytes():
                print(f"  {positions:9d}  {case:<10s}  skipped: needs about {need / GiB:.1f} GiB, {_free_bytes() / GiB:.1f} GiB free")
                continue
            cmd = [
                sys.executable,
                __file__,
                "--loss-case",
                case,
                "--positions",
                str(positions),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--chunk",
                str(args.chunk),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"  {positions:9d}  {case:<10s}  failed: {done.stderr.strip().splitlines()[-1][:150]}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"  {positions:9d}  {case:<10s}  {r['peak_bytes'] / GiB:7.3f} GiB  {r['seconds']:8.3f}  {r['loss']:13.6f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("round", "loss", "all"), default="all")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--models", choices=("tiny", "paper"), default="tiny")
    parser.add_argument("--teacher-arch", choices=tuple(QWEN3_ARCH), default="8b")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--liger", action="store_true", help="also time liger-kernel's fused linear JSD (beta 1)")
    parser.add_argument("--loss-case", choices=("app", "chunked", "unchunked", "liger-bf16", "liger-fp32"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loss_case:
        print(json.dumps(loss_case(args.loss_case, args.positions[0], args.vocab, args.hidden, args.chunk)))
        return
    if args.part in ("round", "all"):
        bench_round(args)
    if args.part in ("loss", "all"):
        bench_loss(args)


if __name__ == "__main__":
    main()
