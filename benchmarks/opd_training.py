"""Benchmark: local OPD training at the paper's widths, before and after a change of the code.

    python benchmarks/opd_training.py                          # this checkout only
    git worktree add /tmp/before <commit>                      # the code to compare against
    python benchmarks/opd_training.py --before /tmp/before     # both, alternating, in one run

Three parts, each measurement in a fresh subprocess (``PYTHONPATH`` = the checkout measured), the
checkouts alternating ``--repeats`` times:

- **loss**: the extra peak memory and the seconds of one forward+backward of the OPD loss
  (reverse KL) on ``--positions`` positions, from bf16 hidden states and bf16 heads of the paper's
  widths (student 1,024, teacher 4,096, vocabulary 151,936), as the checkout's
  ``minibatch_gradient`` evaluates it (the fused gradient where the checkout has it). The head
  options of this checkout are measured too: a whole fp32 copy of each head per call (the code
  before), the copy made once and kept (resident memory: reported apart), and the heads upcast a
  block of rows at a time (the code after).
- **train**: training tokens per second of ``local_opd`` (one epoch, mini-/micro-batch 8/4) on
  random-weight models of Qwen3-0.6B's width (student) and Qwen3-8B's (teacher) with ``--layers``
  layers each, in ``--train-dtype`` (bf16, the paper's, by default; a CPU without bf16 units runs
  it very slowly, so a CPU run uses float32), on rollouts of paper-like lengths times
  ``--length-scale``.
- **padding**: the padding share of a padded epoch, rollout order against micro-batches grouped
  by length, for the sandbox's own rollout lengths and for a long-tailed distribution of the
  paper's mean (responses of mean 1,343 tokens capped at 4,096: 6,445,612 response tokens over
  4,800 rollouts, "Trapped by Their Own Rollouts", appendix on efficiency; lognormal, σ = 1).

On CPU "peak" is the rise of the resident set's high-water mark over the inputs; on a GPU
``torch.cuda.max_memory_allocated`` over what was allocated before. Anchor: Liger-Kernel's fused
linear JSD keeps 1.75 GiB at 4,096 × 151,936 in bf16 on a GPU. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GiB = 1024**3
PAPER_RESPONSE_MEAN = 6_445_612 / 4_800  # response tokens per rollout, 0.6B at 1x LR
PAPER_RESPONSE_CAP = 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Reset the resident set's high-water mark (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``),
    so that the peak read afterwards is this measurement's, not the imports'."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """The resident set's high-water mark since the last reset (VmHWM), else the process's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- lengths -------------------------------------------------------------------------------------


def paper_lengths(n: int, scale: float = 1.0, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) token counts: responses lognormal (σ = 1) of the paper's mean, capped at
    its 4,096-token limit; prompts lognormal of mean 150 (chat-formatted math problems); both
    multiplied by ``scale`` (a CPU run uses shorter sequences of the same shape)."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(PAPER_RESPONSE_MEAN) - sigma**2 / 2
    responses = np.minimum(rng.lognormal(mu, sigma, n), PAPER_RESPONSE_CAP)
    prompts = rng.lognormal(np.log(150) - 0.125, 0.5, n)
    return [(max(2, round(p * scale)), max(1, round(r * scale))) for p, r in zip(prompts, responses)]


def sandbox_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) token counts of ``n`` rollouts of the built-in sandbox student, at the
    default preset's sampling (the HF engine, CPU)."""
    from fedopd.config import parse_run_config
    from fedopd.data import encode_prompts, partition_rows
    from fedopd.models import attach_lora, load_causal_lm
    from fedopd.rollout import HFRolloutEngine, SamplingParams

    cfg = parse_run_config({})
    student = attach_lora(load_causal_lm(cfg.model.student, dtype="float32"), cfg.lora, seed=0)
    prompts = encode_prompts(student.tokenizer, partition_rows(cfg.data, 0, 3)[:n], cfg.data.max_prompt_tokens)
    engine = HFRolloutEngine(student)
    engine.set_adapter(student.get_lora_arrays())
    out = engine.generate(
        [p.token_ids for p in prompts], SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, seed)
    )
    return [(len(p), len(r)) for p, r in zip(out.prompt_ids, out.response_ids)]


def padding_figures(lengths: list[tuple[int, int]], mini: int = 8, micro: int = 4) -> tuple[float, float]:
    """(padding share in rollout order, grouped by length) of a padded epoch (this checkout's
    :func:`fedopd.distill.opd.micro_batches` and :func:`~fedopd.distill.opd.padding_share`)."""
    from fedopd.distill.opd import micro_batches, padding_share

    seq = [p + r for p, r in lengths]
    return (
        padding_share(micro_batches(len(seq), mini, micro), seq),
        padding_share(micro_batches(len(seq), mini, micro, seq), seq),
    )


# --- measurements (run in a subprocess, PYTHONPATH = the checkout) -------------------------------


def measure_loss(args) -> dict:
    import torch
    import torch.nn.functional as F

    from fedopd.distill.opd import divergence_sum_from_hidden, token_reverse_kl
    from fedopd.models import fp32_head

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    w_s = torch.randn(args.vocab, args.student_width, device=device, generator=gen, dtype=dtype) * 0.02
    w_t = torch.randn(args.vocab, args.teacher_width, device=device, generator=gen, dtype=dtype) * 0.02
    h_s = torch.randn(args.positions, args.student_width, device=device, generator=gen, dtype=dtype).requires_grad_(True)
    h_t = torch.randn(args.positions, args.teacher_width, device=device, generator=gen, dtype=dtype)
    extra = {}
    if args.head == "copy-per-call":
        head_s = lambda h: F.linear(h.float(), w_s.float())  # noqa: E731 - the head before the change
        head_t = lambda h: F.linear(h.float(), w_t.float())  # noqa: E731
    elif args.head == "copy-kept":
        base = _rss()
        w_s32, w_t32 = w_s.float(), w_t.float()
        extra["resident_gib"] = (_rss() - base) / GiB
        head_s = lambda h: F.linear(h.float(), w_s32)  # noqa: E731
        head_t = lambda h: F.linear(h.float(), w_t32)  # noqa: E731
    else:  # the checkout's own head
        head_s = lambda h: fp32_head(h, w_s)  # noqa: E731
        head_t = lambda h: fp32_head(h, w_t)  # noqa: E731
    fused = "fused_scale" in inspect.signature(divergence_sum_from_hidden).parameters
    kwargs = {"fused_scale": 1.0 / args.positions} if fused else {}

    def run():
        loss = divergence_sum_from_hidden(h_s, head_s, h_t, head_t, token_reverse_kl, 0.5, args.chunk, **kwargs) / args.positions
        loss.backward()
        h_s.grad = None

    if cuda:
        run()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
        _reset_peak_rss()
    t0 = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - base
    return {"peak_gib": peak / GiB, "seconds": seconds, "fused": fused, **extra}


def measure_train(args) -> dict:
    import torch
    from client_round import paper_models

    from fedopd.config import parse_run_config
    from fedopd.distill.opd import local_opd
    from fedopd.rollout import Rollouts

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cuda = torch.cuda.is_available()
    student, teacher = paper_models("8b", layers=args.layers, dtype=getattr(torch, args.train_dtype))
    lengths = json.loads(args.lengths_json)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 151000, size=p)] for p, _ in lengths]
    responses = [[int(t) for t in rng.integers(0, 151000, size=r)] for _, r in lengths]
    rollouts = Rollouts(prompts, responses, [False] * len(lengths))
    settings = parse_run_config({"train.mini-batch": 8, "train.micro-batch": 4}).train
    base = torch.cuda.memory_allocated() if cuda else _rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
    out = local_opd(student, teacher, rollouts, settings, step_offset=0, total_steps=len(lengths) // 8)
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - base
    m = out.metrics
    return {
        "tokens": m["tokens"],
        "train_s": m["train_s"],
        "teacher_s": m["teacher_s"],
        "tokens_per_s": m["tokens"] / m["train_s"],
        "peak_gib": peak / GiB,
    }


# --- the driver ----------------------------------------------------------------------------------


def _subprocess(code_dir: Path, argv: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_dir), str(HERE)])}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    return format(statistics.median(values), spec) + (f" ({format(min(values), spec)}-{format(max(values), spec)})" if len(values) > 1 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare against (git worktree add /tmp/before <commit>)")
    parser.add_argument("--part", choices=("loss", "train", "padding", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--student-width", type=int, default=1024)
    parser.add_argument("--teacher-width", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.125, help="the paper's lengths times this in part train (CPU: 1/8)")
    parser.add_argument(
        "--train-dtype", default="bfloat16", help="the models' dtype in part train (float32 runs far faster on CPUs without bf16 units)"
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--measure", choices=("loss", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--head", default="app", help=argparse.SUPPRESS)
    parser.add_argument("--lengths-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.measure:
        print(json.dumps(measure_loss(args) if args.measure == "loss" else measure_train(args)))
        return 0

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"
    checkouts = [("after", REPO)] + ([("before", args.before.resolve())] if args.before else [])
    common = ["--threads", str(args.threads), "--chunk", str(args.chunk)]
    print(f"device: {device}")

    if args.part in ("padding", "all"):
        print("\n== padding share of a padded epoch (mini-batch 8, micro-batch 4) ==")
        for name, lengths in (
            ("sandbox (64 rollouts of the default preset)", sandbox_lengths(64)),
            ("paper-like long tail (4,800 rollouts)", paper_lengths(4800)),
        ):
            order, grouped = padding_figures(lengths)
            mean_r = statistics.mean(r for _, r in lengths)
            print(f"{name}: mean response {mean_r:.0f} tokens; padding {order:.1%} in rollout order, {grouped:.1%} grouped by length")

    if args.part in ("loss", "all"):
        print(
            f"\n== the loss: {args.positions} positions, student {args.student_width} / teacher {args.teacher_width} wide, vocabulary {args.vocab}, bf16 =="
        )
        shape = [
            "--positions",
            str(args.positions),
            "--student-width",
            str(args.student_width),
            "--teacher-width",
            str(args.teacher_width),
            "--vocab",
            str(args.vocab),
        ]
        cases = [(name, path, "app") for name, path in checkouts] + [
            ("after, head copied once and kept", REPO, "copy-kept"),
            ("after, head copied per call", REPO, "copy-per-call"),
        ]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
        for _ in range(args.repeats):
            for name, path, head in cases:
                results[name].append(_subprocess(path, ["--measure", "loss", "--head", head, *shape, *common], args.timeout))
        print(f"{'code':<36} {'peak GiB':>22} {'seconds':>22}  notes")
        for name, rows in results.items():
            ok = [r for r in rows if "error" not in r]
            notes = "; ".join(sorted({r["error"] for r in rows if "error" in r}))
            if ok and "resident_gib" in ok[0]:
                notes = f"+ {ok[0]['resident_gib']:.2f} GiB kept fp32 heads " + notes
            if ok:
                notes = ("fused gradient " if ok[0]["fused"] else "checkpointed ") + notes
            print(f"{name:<36} {_fmt([r['peak_gib'] for r in ok], '.2f'):>22} {_fmt([r['seconds'] for r in ok], '.1f'):>22}  {notes}")

    if args.part in ("train", "all"):
        lengths = paper_lengths(args.rollouts, scale=args.length_scale, seed=3)
        print(
            f"\n== local OPD: {args.rollouts} rollouts (paper-like lengths x {args.length_scale:g}: "
            f"{sum(p + r for p, r in lengths)} tokens), {args.layers} layers of Qwen3-0.6B / Qwen3-8B width, {args.train_dtype} =="
        )
        argv_train = [
            "--measure",
            "train",
            "--layers",
            str(args.layers),
            "--train-dtype",
            args.train_dtype,
            "--lengths-json",
            json.dumps(lengths),
            *common,
        ]
        results = {name: [] for name, _ in checkouts}
        for _ in range(args.repeats):
            for name, path in checkouts:
                results[name].append(_subprocess(path, argv_train, args.timeout))
        print(f"{'code':<10} {'training tokens/s':>22} {'train s':>22} {'peak GiB':>22}")
        for name, rows in results.items():
            ok = [r for r in rows if "error" not in r]
            errors = "; ".join(sorted({r["error"] for r in rows if "error" in r}))
            print(
                f"{name:<10} {_fmt([r['tokens_per_s'] for r in ok], '.1f'):>22} {_fmt([r['train_s'] for r in ok], '.1f'):>22} "
                f"{_fmt([r['peak_gib'] for r in ok], '.2f'):>22}  {errors}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
