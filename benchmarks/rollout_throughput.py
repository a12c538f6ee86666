"""Benchmark: rollout throughput of vLLM against the HF engine, side by side in one run.

    python benchmarks/rollout_throughput.py                  # sandbox student, the default preset's batch
    python benchmarks/rollout_throughput.py --repeats 8 --batch 64 --max-new-tokens 256

Needs vLLM (on a CPU: its CPU build, ``scripts/install.sh cpu-vllm``). Loads the sandbox student
(fp32 on a CPU, bf16 on a GPU, as ``model.dtype = auto`` does) with a non-zero LoRA adapter, starts
both engines once, and times, alternating the engines (A B B A ...):

- **rollouts**: one batch of the default preset's size (``rollout.per-round`` = 32 sandbox prompts,
  ``rollout.max-new-tokens`` = 128, T = 1, top-p 1, a new seed per repeat); tokens per second =
  response tokens generated / wall time, response tokens counted to the stop token;
- **adapter swap**: what a new round's adapter costs before its first token: ``set_adapter`` and a
  one-prompt, one-token request under the new adapter, minus the same request under the adapter
  already loaded;
- **engine start**: loading the HF student, and starting vLLM's engine (once each; not alternated).

The two engines sample different tokens (different random streams), so their response lengths
differ by chance; tokens per second is the comparable figure. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def adapters(student, count: int, seed: int = 0) -> list[dict]:
    """``count`` different non-zero adapters (B drawn at the scale a few rounds of training reach)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = student.get_lora_arrays()
    return [{n: a if "lora_A" in n else 0.02 * rng.standard_normal(a.shape).astype(np.float32) for n, a in base.items()} for _ in range(count)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=4, help="timed batches per engine (after one warm-up each)")
    p.add_argument("--batch", type=int, default=32, help="prompts per batch (rollout.per-round)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="rollout.max-new-tokens")
    p.add_argument("--swaps", type=int, default=6, help="adapter swaps timed per engine")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share (default: 0.1 on a CPU, 0.3 on a GPU)")
    args = p.parse_args(argv)

    import torch

    from fedopd.config import LoraSettings
    from fedopd.data import encode_prompts
    from fedopd.models import attach_lora, load_causal_lm, resolve_model_path
    from fedopd.rollout import HFRolloutEngine, SamplingParams
    from fedopd.rollout.vllm_engine import VLLMRolloutEngine, torch_dtype_name, vllm_platform
    from fedopd.sandbox.task import client_partition

    platform = vllm_platform()
    if platform is None:
        print("vLLM cannot run here: install it (scripts/install.sh cpu-vllm or gpu-vllm, docs/install.md)", file=sys.stderr)
        return 1
    name = "builtin:sandbox-student"
    student, load_s = timed(lambda: attach_lora(load_causal_lm(name), LoraSettings(), seed=0))
    stop = [int(student.tokenizer.convert_tokens_to_ids("<|im_end|>"))]
    memory = args.gpu_memory_utilization or (0.1 if platform == "cpu" else 0.3)
    vllm, start_s = timed(
        lambda: VLLMRolloutEngine(
            resolve_model_path(name),
            student.lora_names(),
            student.lora_config,
            max_model_len=512,
            gpu_memory_utilization=memory,
            dtype=torch_dtype_name(student.dtype),
            seed=0,
            stop_token_ids=stop,
        )
    )
    engines = {"vLLM": vllm, "HF": HFRolloutEngine(student, stop_token_ids=stop)}
    prompts = [q.token_ids for q in encode_prompts(student.tokenizer, client_partition(0, 3, args.batch, 42), 384)]
    one = prompts[:1]
    pool = adapters(student, 2 + args.swaps)
    device = "GPU" if torch.cuda.is_available() else "CPU"
    print(
        f"sandbox student ({torch_dtype_name(student.dtype)}, {device}, vLLM platform {platform}), batch {len(prompts)} x {args.max_new_tokens} new tokens"
    )

    for engine in engines.values():  # warm-up: first batch and first adapter load
        engine.set_adapter(pool[0])
        engine.generate(prompts, SamplingParams(args.max_new_tokens, seed=0))

    rates: dict[str, list[float]] = {k: [] for k in engines}
    lengths: dict[str, list[float]] = {k: [] for k in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for key in order:
            out, seconds = timed(lambda: engines[key].generate(prompts, SamplingParams(args.max_new_tokens, seed=1 + rep)))
            tokens = int(out.response_lengths.sum())
            rates[key].append(tokens / seconds)
            lengths[key].append(float(out.response_lengths.mean()))
            print(
                f"  repeat {rep + 1}/{args.repeats} {key:<5s} {tokens:5d} tokens in {seconds:6.2f} s = {tokens / seconds:7.1f} tokens/s", flush=True
            )

    swap: dict[str, list[float]] = {k: [] for k in engines}
    tiny = SamplingParams(1, seed=0)
    for i in range(args.swaps):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for key in order:
            engine = engines[key]

            def swapped(engine=engine, arrays=pool[1 + i]):
                engine.set_adapter(arrays)
                engine.generate(one, tiny)

            _, with_swap = timed(swapped)
            _, without = timed(lambda engine=engine: engine.generate(one, tiny))
            swap[key].append(with_swap - without)

    def med(values):
        return statistics.median(values)

    print(f"\n== rollouts: sandbox student, {len(prompts)} prompts x up to {args.max_new_tokens} tokens, {args.repeats} repeats (median, range) ==")
    for key in engines:
        print(
            f"  {key:<5s} {med(rates[key]):8.1f} tokens/s ({min(rates[key]):.1f}-{max(rates[key]):.1f}), "
            f"mean response {statistics.mean(lengths[key]):.0f} tokens, adapter swap {1000 * med(swap[key]):.0f} ms"
        )
    ratios = [v / h for v, h in zip(rates["vLLM"], rates["HF"])]
    print(f"  vLLM / HF tokens per second: {med(ratios):.2f} (per repeat {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"  start: HF student {load_s:.1f} s, vLLM engine {start_s:.1f} s")
    vllm.close()
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps the child from re-running this
    raise SystemExit(main())
