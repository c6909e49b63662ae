"""Does a sparse draft pay on this machine? An early measurement for lossless speculative rollouts
(issue 26), before building the sampler.

    python bench/speculative_estimate.py --threads 1 [--lengths 1024,4096] [--batch 32]

Self-speculative decoding with a sparse draft costs, per cycle, γ draft steps over the kept cache
plus one dense verification forward of γ + 1 tokens over the whole cache, and yields on average
(1 − α^(γ+1)) / (1 − α) tokens, α being the per-token acceptance rate (Sparrow's α). Against dense
decoding (one dense step per token) its speedup is

    E[tokens per cycle] · t_dense / (γ · t_draft + t_verify)

This bench measures t_dense (one token over a cache of L tokens), t_verify (γ + 1 tokens over the
same cache) and t_draft (one token over the B + Δ tokens an R-KV cache at B = L/4 holds at most, the
compression's own cost left out, so the draft is the cheapest it can be) with transformers' own
cache on the random built-in architecture (8192 positions), and prints the predicted speedup for a
range of α. A prediction from measured step costs, not a measured speculative sampler.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch
from common import compression_interval
from transformers import DynamicCache, LlamaForCausalLM

from sparserl.model.loading import builtin_model_config

# transformers 5.24 renamed the forward's `past_key_values` to `cache` (the engine checks the same way).
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
GAMMAS = (2, 4, 8)
ALPHAS = (0.8, 0.9, 0.95, 0.98)


def step_seconds(model, batch: int, cached: int, new: int, repeats: int) -> float:
    """Median seconds of one forward of `new` tokens per row over a cache of `cached` tokens."""
    cache = DynamicCache()
    prompt = torch.randint(3, 97, (batch, cached))
    with torch.no_grad():
        model(input_ids=prompt, **{CACHE_KEYWORD: cache}, use_cache=True)
        times = []
        for _ in range(repeats):
            tokens = torch.randint(3, 97, (batch, new))
            positions = torch.arange(cached, cached + new).expand(batch, -1)
            started = time.perf_counter()
            model(input_ids=tokens, position_ids=positions, **{CACHE_KEYWORD: cache}, use_cache=True)
            times.append(time.perf_counter() - started)
            cache.crop(-new)  # back to the `cached` tokens
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(builtin_model_config(97, max_position_embeddings=8192)).eval()
    print("| L | t_dense ms | t_draft ms (B=L/4) | " + " | ".join(f"t_verify γ={g} ms" for g in GAMMAS) + " |")
    print("|---|---|---|" + "---|" * len(GAMMAS))
    predictions = []
    for length in map(int, args.lengths.split(",")):
        kept = length // 4 + compression_interval(length)
        dense = step_seconds(model, args.batch, length, 1, args.repeats)
        draft = step_seconds(model, args.batch, kept, 1, args.repeats)
        verify = {g: step_seconds(model, args.batch, length, g + 1, args.repeats) for g in GAMMAS}
        print(f"| {length} | {dense * 1e3:.2f} | {draft * 1e3:.2f} | "
              + " | ".join(f"{verify[g] * 1e3:.2f}" for g in GAMMAS) + " |")
        for alpha in ALPHAS:
            for gamma in GAMMAS:
                tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
                predictions.append((length, alpha, gamma, tokens * dense / (gamma * draft + verify[gamma])))
    print("\nPredicted speedup of lossless speculative rollouts over dense (PREDICTION from the step costs above)\n")
    print("| L | α | " + " | ".join(f"γ={g}" for g in GAMMAS) + " |")
    print("|---|---|" + "---|" * len(GAMMAS))
    for length in map(int, args.lengths.split(",")):
        for alpha in ALPHAS:
            cells = [f"{s:.2f}x" for ln, a, g, s in predictions if ln == length and a == alpha]
            print(f"| {length} | {alpha} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
