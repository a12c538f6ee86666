"""Server time of the aggregation error (fedopd.models.lora.aggregation_errors) at the paper's adapter size.

    python benchmarks/aggregation_error.py [--clients 3] [--repeats 3]

Random factors with the shapes of rank-8 LoRA on Qwen3-0.6B's seven projections over 28 layers
(5,046,272 parameters), clients a small perturbation of θ_t; prints seconds per call (FedAvg and a
fixed multiplier call it once per round, FedTOPS twice).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# Qwen3-0.6B projections: (d_in, d_out)
SHAPES = {
    "q_proj": (1024, 2048),
    "k_proj": (1024, 1024),
    "v_proj": (1024, 1024),
    "o_proj": (2048, 1024),
    "gate_proj": (1024, 3072),
    "up_proj": (1024, 3072),
    "down_proj": (3072, 1024),
}


def paper_adapter(rng: np.random.Generator, layers: int = 28, rank: int = 8) -> dict[str, np.ndarray]:
    out = {}
    for layer in range(layers):
        for name, (d_in, d_out) in SHAPES.items():
            out[f"layers.{layer}.{name}.lora_A.weight"] = rng.standard_normal((rank, d_in)).astype(np.float32)
            out[f"layers.{layer}.{name}.lora_B.weight"] = rng.standard_normal((d_out, rank)).astype(np.float32)
    return out


def main() -> None:
    from fedopd.models.lora import aggregation_errors

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    theta = paper_adapter(rng)
    clients = [{k: v + np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32) for k, v in theta.items()} for _ in range(args.clients)]
    print(f"adapter: {sum(v.size for v in theta.values()):,} parameters, {args.clients} clients")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        aggregation_errors(theta, clients, [1.0] * args.clients, 2.0)
        print(f"aggregation_errors: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
