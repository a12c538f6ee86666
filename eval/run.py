"""Evaluate the base model or adapters on math benchmarks with the paper's sampling.

    python -m eval.run --model Qwen/Qwen3-0.6B-Base --adapter runs/<run>/round-050 --base \\
        --benchmarks math500 amc23 minerva olympiadbench aime24 aime25 --out eval-results

Defaults are the paper's protocol: 8 samples per problem, temperature 1, top-p 0.8, at most
8,192 new tokens, seed 0, the chat template with ``enable_thinking=False`` and the paper's
instruction. Every response is written with its grade to ``<out>/<label>/responses.jsonl`` and the
metrics to ``<out>/<label>/summary.json`` (Avg@k, Pass@k, cap-hit rate per benchmark and their
macro averages, all in percent, unrounded).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from eval.benchmarks import BENCHMARKS, load_benchmark, read_jsonl
from eval.metrics import avg_at_k, cap_hit_rate, macro_average, pass_at_k
from fedopd.config import LoraSettings
from fedopd.data import render_prompt
from fedopd.data.grading import is_correct
from fedopd.models import ModelLoadError, attach_lora, load_causal_lm
from fedopd.models.lora import ADAPTER_CONFIG, load_adapter
from fedopd.rollout import SamplingParams, make_rollout_engine

METRICS = ("avg_at_k", "pass_at_k", "cap_hit")


def lora_settings_of(adapter: Path) -> LoraSettings:
    """Rank, alpha and targets of a PEFT adapter folder."""
    cfg = json.loads((adapter / ADAPTER_CONFIG).read_text())
    return LoraSettings(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), target_modules=tuple(sorted(cfg["target_modules"])))


def evaluation_stop_tokens(model: str, teacher: str | None, setting: str):
    """The stop set of an evaluation: the one training used (:func:`fedopd.models.vocab.resolve_stop_tokens`),
    from the model's files and, when given, the teacher's; no weights are read."""
    from fedopd.models.vocab import ModelFiles, check_same_vocabulary, resolve_stop_tokens

    student = ModelFiles.load(model)
    other = ModelFiles.load(teacher) if teacher else None
    if other is not None:
        check_same_vocabulary(student, other)
    return resolve_stop_tokens(setting, student, other)


def summarize(records: list[dict], samples: int) -> dict:
    """Per-benchmark metrics and their macro averages from graded response records."""
    per: dict[str, dict] = {}
    for name in dict.fromkeys(r["benchmark"] for r in records):
        rs = [r for r in records if r["benchmark"] == name]
        problems = max(r["index"] for r in rs) + 1
        correct = np.zeros((problems, samples))
        for r in rs:
            correct[r["index"], r["sample"]] = r["correct"]
        per[name] = {
            "avg_at_k": avg_at_k(correct),
            "pass_at_k": pass_at_k(correct),
            "cap_hit": cap_hit_rate([r["capped"] for r in rs]),
            "mean_response_tokens": float(np.mean([r["response_tokens"] for r in rs])),
            "problems": problems,
            "samples": samples,
        }
    macro = {m: macro_average({n: v[m] for n, v in per.items()}) for m in METRICS}
    return {"benchmarks": per, "macro": macro}


def encode_benchmarks(tokenizer, benchmarks: dict[str, list[dict]]) -> dict[str, list[list[int]]]:
    """Chat-rendered prompt ids of every problem (the paper's instruction, non-thinking)."""
    return {
        name: [tokenizer(render_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"] for r in rows]
        for name, rows in benchmarks.items()
    }


def evaluate(
    student,
    engine,
    benchmarks: dict[str, list[dict]],
    prompt_ids: dict[str, list[list[int]]],
    params: SamplingParams,
    samples: int,
    batch_size: int,
    progress: bool = True,
) -> list[dict]:
    """Generate ``samples`` responses per problem, grade them, return one record per response."""
    from tqdm.auto import tqdm

    tok = student.tokenizer
    total = sum(len(rows) for rows in benchmarks.values()) * samples
    bar = tqdm(total=total, desc="responses", unit="resp", disable=not progress)
    records = []
    for b_index, (name, rows) in enumerate(benchmarks.items()):
        prompts = prompt_ids[name]
        jobs = [(j, m) for j in range(len(rows)) for m in range(samples)]
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            seed = int(np.random.SeedSequence([params.seed, b_index, start]).generate_state(1)[0])
            out = engine.generate([prompts[j] for j, _ in chunk], SamplingParams(params.max_new_tokens, params.temperature, params.top_p, seed))
            texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
            for (j, m), text, ids, capped in zip(chunk, texts, out.response_ids, out.capped):
                records.append(
                    {
                        "benchmark": name,
                        "index": j,
                        "sample": m,
                        "problem": rows[j]["problem"],
                        "gold": rows[j]["answer"],
                        "response": text,
                        "correct": int(is_correct(text, rows[j]["answer"])),
                        "capped": bool(capped),
                        "response_tokens": len(ids),
                    }
                )
            bar.update(len(chunk))
    bar.close()
    return records


def cap_new_tokens(requested: int, longest_prompt: int, max_positions: int | None, model: str) -> tuple[int, str | None]:
    """(new-token cap that the model can hold, a note when it had to be lowered).

    A response can only be as long as the model's positions allow after the longest prompt;
    asking for more makes ``generate`` warn at every step and run past what the model was
    trained on. Raises ValueError when not even one new token fits.
    """
    if not max_positions or longest_prompt + requested <= max_positions:
        return requested, None
    fits = max_positions - longest_prompt
    if fits < 1:
        raise ValueError(f"the longest prompt has {longest_prompt} tokens, but {model} holds {max_positions} positions")
    return fits, (
        f"--max-new-tokens {requested} exceeds what {model} holds ({max_positions} positions, longest prompt "
        f"{longest_prompt} tokens): capped at {fits}"
    )


def _parse_files(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --benchmark-file expects NAME=PATH, got {item!r}")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="base student: hub id, local folder or builtin:tiny-student")
    p.add_argument("--adapter", action="append", default=[], type=Path, help="PEFT adapter folder (repeatable)")
    p.add_argument("--base", action="store_true", help="also evaluate the base model without adapter")
    p.add_argument("--label", action="append", default=[], help="output label per adapter (default: run-folder_round)")
    p.add_argument("--benchmarks", nargs="*", default=[], help=f"from: {', '.join(BENCHMARKS)}")
    p.add_argument("--data-dir", type=Path, help="read <benchmark>.jsonl from this folder instead of the hub")
    p.add_argument("--benchmark-file", action="append", default=[], help="NAME=PATH of a local JSONL benchmark (repeatable)")
    p.add_argument("--limit", type=int, help="first N problems of each benchmark (for smoke tests)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--teacher", default=None, help="the run's teacher (hub id or folder): its EOS ids join the stop set, as in training")
    p.add_argument(
        "--stop-tokens", default="auto", help="'auto' (the model's and --teacher's EOS ids) or comma-separated tokens, as rollout.stop-tokens"
    )
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of the GPU")
    p.add_argument("--batch-size", type=int, default=64, help="responses per generate call")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=Path("eval-results"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    # Everything checkable is checked before a model is loaded.
    if not args.adapter and not args.base:
        p.error("give at least one --adapter or --base")
    if args.label and len(args.label) != len(args.adapter):
        p.error(f"{len(args.label)} --label values for {len(args.adapter)} adapters")
    for a in args.adapter:
        if not (a / ADAPTER_CONFIG).is_file():
            p.error(f"--adapter '{a}' is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    if args.samples < 1 or args.max_new_tokens < 1 or not 0 < args.top_p <= 1 or args.temperature <= 0:
        p.error("--samples and --max-new-tokens must be >= 1, --top-p in (0, 1], --temperature > 0")
    try:
        benchmarks = {name: load_benchmark(name, args.data_dir) for name in args.benchmarks}
        benchmarks.update({name: read_jsonl(path) for name, path in _parse_files(args.benchmark_file).items()})
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not benchmarks:
        p.error("choose --benchmarks and/or --benchmark-file")
    if args.limit:
        benchmarks = {k: v[: args.limit] for k, v in benchmarks.items()}

    labels = args.label or [f"{a.resolve().parent.name}_{a.resolve().name}" for a in args.adapter]
    targets = ([("base", None)] if args.base else []) + list(zip(labels, args.adapter))
    lora = lora_settings_of(args.adapter[0]) if args.adapter else LoraSettings()
    try:
        stop = evaluation_stop_tokens(args.model, args.teacher, args.stop_tokens)
    except ModelLoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"note: responses end at {list(stop.tokens)}", file=sys.stderr)
    from fedopd.models.positions import model_positions

    student = attach_lora(load_causal_lm(args.model, dtype=args.dtype), lora, seed=0)
    prompt_ids = encode_benchmarks(student.tokenizer, benchmarks)
    longest = max(len(ids) for ids in (i for batch in prompt_ids.values() for i in batch))
    max_positions, _ = model_positions(student.causal_lm.config)  # as vLLM derives them
    try:
        args.max_new_tokens, note = cap_new_tokens(args.max_new_tokens, longest, max_positions, args.model)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if note:
        print(f"note: {note}", file=sys.stderr)
    engine = make_rollout_engine(
        args.backend,
        student,
        stop_token_ids=stop.ids,
        max_model_len=longest + args.max_new_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)

    for label, adapter in targets:
        if adapter is None:
            arrays = {n: np.zeros_like(a) for n, a in student.get_lora_arrays().items()}  # B = 0: the base model
        else:
            arrays = load_adapter(adapter, student.lora_names())
        engine.set_adapter(arrays)
        t0 = time.perf_counter()
        records = evaluate(student, engine, benchmarks, prompt_ids, params, args.samples, args.batch_size, not args.no_progress)
        summary = summarize(records, args.samples)
        summary.update(
            label=label,
            model=args.model,
            adapter=str(adapter) if adapter else None,
            seconds=time.perf_counter() - t0,
            sampling={
                "samples": args.samples,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "max_new_tokens": args.max_new_tokens,
                "seed": args.seed,
                "enable_thinking": False,
                "stop_tokens": list(stop.tokens),
            },
        )
        folder = args.out / label
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "responses.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        macro = summary["macro"]
        print(
            f"{label}: macro Avg@{args.samples} {macro['avg_at_k']:.2f}  Pass@{args.samples} {macro['pass_at_k']:.2f}  "
            f"cap-hit {macro['cap_hit']:.2f}  -> {folder / 'summary.json'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
