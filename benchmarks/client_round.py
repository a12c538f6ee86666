"""Benchmark: seconds per phase of one client round, and the memory the chunked loss saves.

    python benchmarks/client_round.py                  # both parts, tiny models, CPU or GPU
    python benchmarks/client_round.py --part round --rollouts 32 --max-new-tokens 64
    python benchmarks/client_round.py --part loss --positions 1024 2048 4096 --vocab 151936

Part "round" loads the built-in tiny student and teacher and runs one client round (rollouts,
grading, scoring cache, teacher pass, local OPD) and the candidate scores of the query, printing
seconds per phase and the process's peak memory.

Part "loss" measures the extra peak memory of one forward+backward pass of the reverse-KL loss at
P positions × V vocabulary from hidden states of width H (Qwen3-0.6B: H = 1024), once with
:func:`fedopd.opd.reverse_kl_sum_from_hidden` (chunked, checkpointed) and once unchunked (full
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

import torch

GiB = 1024**3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------
# Part 1: one client round
# ---------------------------------------------------------------------------------------------


def bench_round(args) -> None:
    from fedopd.config import RunConfig
    from fedopd.data import encode_prompts, tiny_arith_partition
    from fedopd.lora import increment
    from fedopd.round import load_client_models, score_round, train_round

    cfg = RunConfig()
    t0 = time.perf_counter()
    models = load_client_models(cfg.model.student, cfg.model.teacher, lora=cfg.lora, backend="hf", seed=cfg.seed)
    load_s = time.perf_counter() - t0
    prompts = encode_prompts(models.student.tokenizer, tiny_arith_partition(0, 3, 64, cfg.seed), 2048)
    theta = models.student.get_lora_arrays()
    rollout = dataclasses.replace(cfg.rollout, per_round=args.rollouts, max_new_tokens=args.max_new_tokens)
    if models.student.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = train_round(
        models, theta, prompts, rollout=rollout, cache=cfg.cache, train=cfg.train,
        server_round=1, seed=cfg.seed, step_offset=0, total_steps=cfg.total_local_steps,
    )
    t1 = time.perf_counter()
    score_round(models, theta, increment(out.arrays, theta), out.cache, cfg.strategy.candidates)
    score_s = time.perf_counter() - t1
    m = out.metrics
    print(f"\n== one client round: tiny models on {models.student.device}, {args.rollouts} rollouts "
          f"(mean {m['response_length']:.1f} tokens, max {args.max_new_tokens}), torch threads {torch.get_num_threads()} ==")
    rows = [
        ("load models (once per process)", load_s),
        ("rollouts (HF generate)", m["rollout_s"]),
        ("grading", m["grade_s"]),
        ("scoring cache", m["cache_s"]),
        ("teacher pass", m["teacher_s"]),
        ("local OPD (incl. KL before/after)", m["opd_s"] - m["teacher_s"]),
        (f"candidate scores ({len(cfg.strategy.candidates)} candidates)", score_s),
        ("round total (without load)", m["total_s"] + score_s),
    ]
    for name, seconds in rows:
        print(f"  {name:<42s} {seconds:8.3f} s")
    print(f"  {'peak resident memory (process)':<42s} {_peak_rss_bytes() / GiB:8.3f} GiB")
    if models.student.device.type == "cuda":
        print(f"  {'peak GPU memory allocated':<42s} {torch.cuda.max_memory_allocated() / GiB:8.3f} GiB")


# ---------------------------------------------------------------------------------------------
# Part 2: chunked against unchunked loss
# ---------------------------------------------------------------------------------------------


def loss_case(case: str, positions: int, vocab: int, hidden: int, chunk: int) -> dict:
    """Runs in a subprocess: extra peak bytes of one forward+backward of the loss."""
    from fedopd.opd import reverse_kl_sum_from_hidden, token_reverse_kl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    w_s = torch.randn(vocab, hidden, device=device, generator=gen) * 0.02
    w_t = torch.randn(vocab, hidden, device=device, generator=gen) * 0.02
    h_s = torch.randn(positions, hidden, device=device, generator=gen).requires_grad_(True)
    h_t = torch.randn(positions, hidden, device=device, generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    if case == "chunked":
        loss = reverse_kl_sum_from_hidden(h_s, lambda h: h @ w_s.T, h_t, lambda h: h @ w_t.T, chunk)
    else:
        with torch.no_grad():
            t_logits = h_t @ w_t.T
        loss = token_reverse_kl(h_s @ w_s.T, t_logits).sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes() - base
    return {"case": case, "positions": positions, "vocab": vocab, "peak_bytes": peak,
            "seconds": time.perf_counter() - t0, "loss": float(loss), "device": device.type}


def _free_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def bench_loss(args) -> None:
    print(f"\n== reverse-KL loss, forward+backward, H = {args.hidden}, V = {args.vocab}, chunk = {args.chunk} ==")
    print(f"  {'positions':>9s}  {'chunked peak':>14s}  {'unchunked peak':>15s}  {'saving':>8s}  {'chunked s':>9s}  {'unchunked s':>11s}")
    for positions in args.positions:
        results = {}
        for case in ("chunked", "unchunked"):
            need = 9 * positions * args.vocab * 4 if case == "unchunked" else 0  # ~9 fp32 P×V buffers
            if need > 0.8 * _free_bytes():
                results[case] = None
                continue
            cmd = [sys.executable, __file__, "--loss-case", case, "--positions", str(positions),
                   "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                results[case] = None
                continue
            results[case] = json.loads(done.stdout.strip().splitlines()[-1])
        c, u = results["chunked"], results["unchunked"]
        fmt = lambda r: f"{r['peak_bytes'] / GiB:11.3f} GiB" if r else "    skipped"  # noqa: E731
        saving = f"{u['peak_bytes'] / max(c['peak_bytes'], 1):7.1f}x" if c and u else "       -"
        print(f"  {positions:9d}  {fmt(c):>14s}  {fmt(u):>15s}  {saving:>8s}  "
              f"{(c['seconds'] if c else float('nan')):9.1f}  {(u['seconds'] if u else float('nan')):11.1f}")
        if u is None:
            print(f"  {'':9s}  unchunked at {positions} positions skipped: needs about "
                  f"{9 * positions * args.vocab * 4 / GiB:.1f} GiB, {_free_bytes() / GiB:.1f} GiB free")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("round", "loss", "all"), default="all")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--loss-case", choices=("chunked", "unchunked"), help=argparse.SUPPRESS)
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
