"""A prediction, not a measurement: the rollout speedup a KV budget buys for a 1.5B model (or SmolLM2-135M) with
4k-token responses on one 80 GB GPU, from the cost model (`sparserl.rollout.engine.cost_model`) fed with
stated hardware rates instead of probed ones.

    python bench/predict_gpu.py [--model qwen2.5-1.5b|smollm2-135m] [--requests 1024] [--prompt 256] [--max-response 4096]

Every input is printed with the result. The rates are assumptions about an H100 SXM (80 GB HBM3):
a share of its peak bf16 FLOP rate and memory bandwidth, a fixed per-step overhead of a decode
loop without CUDA graphs, and R-KV's similarity work at a lower FLOP efficiency. The shapes are
Qwen2.5-1.5B's or SmolLM2-135M's (`--model`). Response lengths are drawn uniformly between a quarter of and the whole maximum
(seeded), in queue order. KV memory is what is left of 90% of the GPU after the weights and an
activation reserve; each row reserves what its cache can reach (`Shapes.row_bytes`).
"""

from __future__ import annotations

import argparse
import random

from sparserl.rollout.engine.cost_model import CostModel, Rates, Shapes
from sparserl.rollout.sparsity.eviction import KVCompression

GPU_BYTES = 80e9
PEAK_FLOPS, FLOP_EFFICIENCY = 989e12, 0.6  # H100 SXM bf16 dense
PEAK_BANDWIDTH, BANDWIDTH_EFFICIENCY = 3.35e12, 0.8  # HBM3
STEP_OVERHEAD_S, SPARSE_OVERHEAD_S = 2e-3, 0.2e-3  # launches, sampling, the cache's bookkeeping
COMPRESS_FLOP_EFFICIENCY, COMPRESS_OVERHEAD_S = 0.3, 1e-4  # per compression and layer
ACTIVATION_RESERVE = 4e9
QWEN_1_5B = Shapes(layers=28, hidden=1536, q_heads=12, kv_heads=2, head_dim=128, vocab=151_936,
                   body_params=1_310_000_000, width=2)
# SmolLM2-135M: 30 layers of 576, 9 query heads, 3 KV heads of 64; 134.5M parameters, 28.3M of them the (tied)
# embedding.
SMOLLM2_135M = Shapes(layers=30, hidden=576, q_heads=9, kv_heads=3, head_dim=64, vocab=49_152,
                      body_params=106_200_000, width=2)
MODELS = {"qwen2.5-1.5b": ("Qwen2.5-1.5B", QWEN_1_5B), "smollm2-135m": ("SmolLM2-135M", SMOLLM2_135M)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--requests", type=int, default=1024, help="a step's rollouts (128 prompts x 8)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-response", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    name, shapes = MODELS[args.model]
    bandwidth = PEAK_BANDWIDTH * BANDWIDTH_EFFICIENCY
    rates = Rates(flop_rate=PEAK_FLOPS * FLOP_EFFICIENCY, bandwidth=bandwidth,
                  cached_token_s=shapes.kv_bytes_per_token() / bandwidth,  # one row reads its K and V once
                  overhead_s=STEP_OVERHEAD_S, sparse_overhead_s=SPARSE_OVERHEAD_S,
                  compress_overhead_s=COMPRESS_OVERHEAD_S,
                  compress_unit_s=2 * shapes.head_dim * shapes.kv_heads / (PEAK_FLOPS * COMPRESS_FLOP_EFFICIENCY))
    model = CostModel(rates, shapes, probe_rows=1)
    weights = (shapes.body_params + shapes.hidden * shapes.vocab) * shapes.width
    kv_memory = 0.9 * GPU_BYTES - weights - ACTIVATION_RESERVE
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.max_response // 4, args.max_response) for _ in range(args.requests)]
    print("PREDICTION (cost model with assumed rates; nothing here was measured on a GPU)")
    print(f"inputs: {name} shapes, bf16; H100 80 GB: {FLOP_EFFICIENCY:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s, "
          f"{BANDWIDTH_EFFICIENCY:.0%} of {PEAK_BANDWIDTH / 1e12:.2f} TB/s, {STEP_OVERHEAD_S * 1e3:.1f} ms per decode "
          f"step (+{SPARSE_OVERHEAD_S * 1e3:.1f} ms sparse), R-KV at {COMPRESS_FLOP_EFFICIENCY:.0%} FLOP efficiency")
    print(f"KV memory {kv_memory / 1e9:.1f} GB (90% of 80 GB - weights {weights / 1e9:.1f} GB - "
          f"activations {ACTIVATION_RESERVE / 1e9:.0f} GB); {args.requests} requests, prompt {args.prompt}, "
          f"responses {min(lengths)}-{max(lengths)} tokens (uniform, seed {args.seed})\n")
    print("| rollout | row MiB | rows in flight | cohorts | decode s | compress s | total s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    dense_total = None
    for budget in (None, args.max_response // 2, args.max_response // 4, args.max_response // 8):
        compression = KVCompression("rkv", budget=budget, window=8, interval=max(8, args.max_response // 32)) \
            if budget else None
        row = shapes.row_bytes(args.prompt, args.max_response, compression)
        rows = min(args.requests, int(kv_memory // row))
        result = model.predict_scheduled(lengths, args.prompt, rows, compression)
        dense_total = dense_total or result["total_s"]
        name = "dense" if budget is None else f"R-KV B={budget}"
        print(f"| {name} | {row / 2**20:.1f} | {rows} | {result['cohorts']} | {result['decode_s']:.1f} | "
              f"{result['compress_s']:.1f} | {result['total_s']:.1f} | {dense_total / result['total_s']:.2f}x |")


if __name__ == "__main__":
    main()
