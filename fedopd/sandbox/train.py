"""Regenerate the shipped sandbox models: ``python -m fedopd.sandbox.train``.

1. A BPE tokenizer (byte-level alphabet, digits always single tokens, Qwen's chat special tokens
   and a Qwen3-style chat template) trained on the sandbox texts, so words of the instruction are
   single tokens and arithmetic stays digit by digit.
2. A teacher (Qwen3 architecture, 4 layers, width 192) trained by supervised fine-tuning on
   step-by-step solutions from the three groups' training pools until it solves them almost
   perfectly; then a much smaller student (2 layers, width 128) trained the same way but only
   briefly, on purpose: it stops on the steep part of its learning curve, so distillation has
   something to teach and the federated dynamics are visible within a CPU budget. The student is
   left mid-training at a constant learning rate, not cooled down: continuing a cooled-down
   checkpoint at a re-warmed rate first undoes part of its training (measured: held-out accuracy
   fell in the first rounds of every learner tried, SFT included; docs/sandbox.md, "Why the sandbox student
   is left mid-training").
3. Both are written with ``save_pretrained`` (safetensors, bf16 to keep the package small) next
   to this module, then reloaded from disk and evaluated greedily on held-out problems with the
   math-verify grader; ``training.json`` records the recipe, timings and scores.

Everything derives from ``--seed``: same seed, same thread count, same files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fedopd.sandbox import MODELS_DIR
from fedopd.sandbox.task import GROUPS, problems
from fedopd.sandbox.tiny import CHAT_TEMPLATE, TinySpec, build_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

TEACHER = TinySpec(192, 4, 4, 2, 48, 512, True, 0.02, seed=11, max_positions=512)
STUDENT = TinySpec(128, 2, 4, 2, 32, 384, True, 0.02, seed=12, max_positions=512)


def build_tokenizer(corpus: list[str], vocab_size: int = 384):
    """A BPE tokenizer trained on ``corpus`` (deterministic), with the chat tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<think>", "</think>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sft_rows(seed: int, per_group: int) -> dict[str, list[dict]]:
    """Training-pool problems per group (all of a small group's pool if it has fewer)."""
    out = {}
    for group in GROUPS:
        n = per_group
        while True:
            try:
                out[group] = problems(group, n, seed)
                break
            except ValueError:
                n = int(n * 0.8)
    return out


def encode_sft(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(prompt + solution + EOS token ids, prompt length) per row."""
    from fedopd.data import render_prompt

    out = []
    for r in rows:
        prompt = tokenizer(render_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def batch_tensors(examples, pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, plen) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, plen : len(seq)] = torch.tensor(seq[plen:])  # loss on the response (and EOS) only
    return ids, mask, labels


SCHEDULES = ("cosine", "constant")  # after warmup: cosine to 0 (cooled down), or constant (left mid-training)


def lr_scale(step: int, steps: int, warmup: int, schedule: str = "cosine") -> float:
    """The learning-rate factor of SFT step ``step`` (0-based) of ``steps``: linear warmup over
    ``warmup`` steps, then cosine decay to 0 at the end (``"cosine"``) or 1 (``"constant"``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def sft(
    model,
    data: dict[str, list],
    *,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    seed: int,
    log_every: int = 100,
    schedule: str = "cosine",
):
    """AdamW at ``lr`` times :func:`lr_scale`; batches draw a group, then a problem, uniformly."""
    rng = np.random.default_rng(seed)
    pad = model.config.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    groups = list(data)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * lr_scale(step, steps, warmup, schedule)
        picks = [data[groups[int(rng.integers(len(groups)))]] for _ in range(batch)]
        examples = [rows[int(rng.integers(len(rows)))] for rows in picks]
        ids, mask, labels = batch_tensors(examples, pad)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"  step {step + 1}/{steps}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    return time.perf_counter() - t0


def heldout_accuracy(path: str, count: int, max_new_tokens: int = 192) -> dict[str, float]:
    """Greedy accuracy (percent) per group on ``count`` held-out problems, loaded from ``path``."""
    from fedopd.data import encode_prompts
    from fedopd.data.grading import is_correct
    from fedopd.models import load_causal_lm
    from fedopd.rollout import HFRolloutEngine, SamplingParams
    from fedopd.sandbox.task import EVAL_SEED

    lm = load_causal_lm(path, dtype="float32", device=torch.device("cpu"))
    engine = HFRolloutEngine(lm, batch_size=64)
    out = {}
    for group in GROUPS:
        rows = problems(group, count, EVAL_SEED, heldout=True)
        prompts = encode_prompts(lm.tokenizer, rows, 10_000)
        rollouts = engine.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens, temperature=0.0))
        texts = lm.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        out[group] = 100.0 * float(np.mean([is_correct(t, p.answer) for t, p in zip(texts, prompts)]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedopd.sandbox.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=MODELS_DIR, help="folder for sandbox-teacher/ and sandbox-student/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher-steps", type=int, default=1500)
    p.add_argument("--student-steps", type=int, default=270)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--student-lr", type=float, default=1e-3, help="the student's learning rate after warmup")
    p.add_argument(
        "--student-schedule", choices=SCHEDULES, default="constant", help="after warmup: cosine to 0, or constant (a student left mid-training)"
    )
    p.add_argument("--eval-problems", type=int, default=100, help="held-out problems per group for the record")
    p.add_argument("--only", choices=("teacher", "student"), help="retrain one model (the tokenizer must exist)")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rows = sft_rows(args.seed, 8000)
    from fedopd.data import render_prompt

    record_path = args.out / "training.json"
    record = json.loads(record_path.read_text()) if args.only and record_path.is_file() else {}
    if args.only:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.out / "sandbox-teacher")
    else:
        corpus_tok = build_tokenizer([])  # the chat template renders the prompts of the corpus
        corpus = [render_prompt(corpus_tok, r["problem"]) + r["solution"] for g in GROUPS for r in rows[g][:2000]]
        tokenizer = build_tokenizer(corpus)
    data = {g: encode_sft(tokenizer, rs) for g, rs in rows.items()}
    lengths = [len(ids) for rs in data.values() for ids, _ in rs]
    record.update(
        seed=args.seed,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        vocab_size=len(tokenizer),
        sft_problems={g: len(rs) for g, rs in rows.items()},
        sequence_tokens={"mean": float(np.mean(lengths)), "max": int(np.max(lengths))},
    )
    for name, spec, steps in (("sandbox-teacher", TEACHER, args.teacher_steps), ("sandbox-student", STUDENT, args.student_steps)):
        if args.only and not name.endswith(args.only):
            continue
        print(f"{name}: {steps} SFT steps", flush=True)
        model = build_model(spec, tokenizer)
        params = sum(p.numel() for p in model.parameters())
        is_student = name == "sandbox-student"
        lr = args.student_lr if is_student else args.lr
        schedule = args.student_schedule if is_student else "cosine"
        seconds = sft(model, data, steps=steps, batch=args.batch, lr=lr, warmup=min(50, steps // 5), seed=args.seed + spec.seed, schedule=schedule)
        target = args.out / name
        model.to(torch.bfloat16).save_pretrained(target)
        tokenizer.save_pretrained(target)
        accuracy = heldout_accuracy(str(target), args.eval_problems)
        print(f"{name}: held-out greedy accuracy {accuracy}", flush=True)
        record[name] = {
            "architecture": asdict(spec),
            "parameters": params,
            "sft": {
                "steps": steps,
                "batch": args.batch,
                "lr": lr,
                "schedule": "linear warmup min(50, steps/5), " + ("cosine to 0" if schedule == "cosine" else "then constant"),
                "optimizer": "AdamW betas (0.9, 0.98), weight decay 0.01, grad clip 1.0",
                "seconds": round(seconds, 1),
            },
            "stored_dtype": "bfloat16",
            "heldout_greedy_accuracy": {g: round(a, 1) for g, a in accuracy.items()},
            "heldout_problems_per_group": args.eval_problems,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
