"""Where do sparse rollouts pay on this CPU, on a real model? SmolLM2-135M-Instruct decoding at long contexts.

    python bench/real_model.py --model models/smollm2-135m --threads 2 [--lengths 1024,2048,4096] [--rows 4,16,64]
                               [--methods dense,rkv,snapkv,block,spec-window,spec-block] [--json FILE]

Each cell is one context length L and one batch of N rows: every row continues the same real text (a chat turn
asking to continue a document, Python's own documentation of its standard library, cut so that the prompt holds
L − n tokens), sampling n = 2Δ + 16 new tokens at temperature 1 with EOS off, a seed per row. The rows share
the prompt's prefill (as a GRPO group does). What is timed is decoding at position L, the state a long rollout
is in near its end, not the prefill:
- dense: the engine with the full cache; the decode steps after the first Δ + 1;
- rkv, snapkv: the engine with that KV policy at B = L/8 (window 8, interval Δ = max(16, L/64)), over the
  same steps: after the first compression (which cuts the prompt from L to B, a one-off a real rollout spreads
  over its length) and through one steady compression, whose cost is thereby included;
- block: Sparrow's block-sparse attention at the same B (pages of 16, 2 dense layers), the same steps;
- spec-window, spec-block: the lossless speculative sampler (`SpeculativeSampler`, adaptive γ ≤ 8) drafting
  with a window of B slots (64 sink slots) or with that block-sparse attention; its rounds' draft and verify
  seconds, and the tokens they emitted. Its samples are exactly the dense policy's (tests/test_speculative.py).

Per cell: decode tokens/s by CPU time (N × tokens / the process's CPU seconds over the timed steps; for the
speculative rows over its rounds, the first one's share estimated as the mean round's), so that other jobs on a
shared machine do not count, with `--threads 1` (a thread waiting for a busy core costs no CPU time, but an
OpenMP team's spinning does); the wall-clock rate beside it; the speedup against dense in the same cell, KV held per row,
and for the speculative rows the acceptance rate, tokens per verification and mean γ. The cost model
(`rollout/engine/cost_model.py`, rates probed on this machine at each N before the cell runs) predicts each
engine row's tokens/s; the speculative rows are predicted from it with the measured acceptance and γ.
`--equal-memory` adds the cell that binds dense by memory: the KV bytes of N = 16 dense rows at the longest L,
given to R-KV rows at B = L/8 (as many as fit at B + Δ slots each), measured at a prompt of 2B tokens (a
compressed row's step does not depend on how long its context was).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pydoc
import time

import torch
from common import contention_probe

from sparserl.model.loading import load_policy
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine.cost_model import CostModel, Shapes
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.rollout.speculative.drafts import WindowDraft
from sparserl.rollout.speculative.sampler import SpeculativeSampler

ENGINE_METHODS = ("dense", "rkv", "snapkv", "block")
SPECULATIVE_METHODS = ("spec-window", "spec-block")


def document() -> str:
    """A long English text that every machine with this Python has: the documentation of some stdlib modules."""
    import argparse as a
    import collections
    import json as j
    import textwrap
    import threading
    return "\n\n".join(pydoc.render_doc(m, renderer=pydoc.plaintext) for m in (a, collections, j, textwrap, threading))


def prompt_of(tokenizer, length: int, text: str) -> list[int]:
    """Chat-templated ids asking to continue `text`, cut so that the whole prompt is `length` tokens."""
    def ids(words: list[int]) -> list[int]:
        body = tokenizer.decode(words)
        return tokenizer.apply_chat_template([{"role": "user", "content": "Continue this document:\n\n" + body}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    words = tokenizer(text, add_special_tokens=False).input_ids
    if len(words) < length:
        raise ValueError(f"the document holds {len(words)} tokens, fewer than L = {length}")
    count = length - (len(ids(words[:1])) - 1)
    for _ in range(8):  # decoding and re-encoding a cut may merge or split a token at the seams
        prompt = ids(words[:count])
        if len(prompt) == length:
            break
        count += length - len(prompt)
    return prompt


def interval_for(length: int) -> int:
    return max(16, length // 64)


def sparsity_for(method: str, budget: int, interval: int):
    if method in ("rkv", "snapkv"):
        return KVCompression(method, budget=budget, window=8, interval=interval)
    if method in ("block", "spec-block"):
        return BlockSparsity(budget=budget, page_size=16, dense_layers=2)
    if method == "spec-window":
        return WindowDraft(budget=budget, sink=min(64, budget // 4))
    return None


def measure(model, method: str, prompt: list[int], rows: int, length: int, tokenizer) -> dict:
    """Decode tokens/s of one cell and method (see the module docstring)."""
    budget, interval = length // 8, interval_for(length)
    new = 2 * interval + 16
    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    seeds = [request_seed(length * 1000 + rows, row) for row in range(rows)]
    prompts = [prompt] * rows
    settings = sparsity_for(method, budget, interval)
    wall = time.perf_counter()
    if method in SPECULATIVE_METHODS:
        sampler = SpeculativeSampler(model, settings, draft_tokens="adaptive")
        rounds: list[float] = []
        batch = sampler.generate(prompts, sampling, seeds=seeds, on_step=lambda _: rounds.append(time.process_time()))
        stats = batch.speculation
        # The rounds' CPU time: from the end of the first round to the end of the last, scaled to all rounds (the
        # first one's start, after the prefill and the draft's set-up, has no stamp).
        out = {"decode_s": (rounds[-1] - rounds[0]) * len(rounds) / max(len(rounds) - 1, 1),
               "wall_decode_s": stats.draft_seconds + stats.verify_seconds, "tokens": stats.tokens, "acceptance": stats.acceptance_rate,
               "tokens_per_verification": stats.tokens / max(stats.verifications, 1),
               "gamma_mean": stats.gamma_sum / max(stats.rounds, 1)}
    else:
        stamps: list[tuple[float, float]] = []
        engine = RolloutEngine(model, settings, record_evictions=False)
        batch = engine.generate(prompts, sampling, seeds=seeds,
                                on_step=lambda _: stamps.append((time.process_time(), time.perf_counter())))
        skip = interval + 1  # past the first compression (engine rows: all methods over the same steps)
        out = {"decode_s": stamps[-1][0] - stamps[skip - 1][0], "wall_decode_s": stamps[-1][1] - stamps[skip - 1][1],
               "tokens": rows * (len(stamps) - skip)}
    out.update({"method": method, "length": length, "rows": rows, "budget": budget, "interval": interval,
                "new_tokens": new, "tok_s": out["tokens"] / out["decode_s"],
                "wall_tok_s": out["tokens"] / out["wall_decode_s"], "cell_wall_s": time.perf_counter() - wall,
                # What a row holds at position L: B + Δ slots under eviction, every slot otherwise (the speculative
                # sampler's buffers also keep a slack for rejected drafts, counted in its peak).
                "kv_row_mib": (budget + interval if method in ("rkv", "snapkv") else length)
                * Shapes.of(model).kv_bytes_per_token() / 2**20,
                "kv_peak_row_mib": batch.kv.kv_peak_bytes / rows / 2**20})
    return out


def predict(cost: CostModel, method: str, rows: int, length: int, measured: dict) -> float | None:
    """Predicted decode tokens/s of a cell's method; speculative rows from the measured acceptance and γ."""
    budget, interval = length // 8, interval_for(length)
    shapes, rates = cost.shapes, cost.rates
    if method == "dense":
        return rows / cost.step_seconds(rows, length)
    if method in ("rkv", "snapkv"):
        step = cost.step_seconds(rows, budget + interval / 2, sparse=True)
        step += cost.compression_seconds(rows, budget + interval, budget, interval, method) / interval
        return rows / step
    if method == "block":  # attends to B keys; page scoring left out: a bound
        return rows / cost.step_seconds(rows, budget, sparse=True)
    gamma, per_verification = measured["gamma_mean"], measured["tokens_per_verification"]
    draft = cost.step_seconds(rows, budget, sparse=True)
    # A verification: the weights' work for γ + 1 tokens a row, one read of the weights and of the cache.
    verify = (rates.overhead_s + shapes.weight_flops(rows * (gamma + 1)) / rates.flop_rate
              + shapes.weight_bytes() / rates.bandwidth + cost.step_seconds(rows, length) - cost.step_seconds(rows, 0))
    return rows * per_verification / (gamma * draft + verify)


def equal_memory(model, tokenizer, text: str, length: int, dense_rows: int, dense_tok_s: float) -> dict:
    """R-KV rows in the KV bytes of `dense_rows` dense rows at `length`, and their decode tokens/s."""
    budget, interval = length // 8, interval_for(length)
    rows = dense_rows * length // (budget + interval)
    short = prompt_of(tokenizer, 2 * budget, text)
    sparse = measure(model, "rkv", short, rows, length, tokenizer)
    bytes_per_slot = Shapes.of(model).kv_bytes_per_token()
    return {"length": length, "dense_rows": dense_rows, "dense_kv_gib": dense_rows * length * bytes_per_slot / 2**30,
            "rkv_rows": rows, "rkv_kv_gib": rows * (budget + interval) * bytes_per_slot / 2**30,
            "dense_tok_s": dense_tok_s, "rkv_tok_s": sparse["tok_s"], "ratio": sparse["tok_s"] / dense_tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the SmolLM2-135M-Instruct directory (`sparserl model`)")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--rows", default="4,16,64")
    parser.add_argument("--methods", default=",".join(ENGINE_METHODS + SPECULATIVE_METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--equal-memory", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.model, torch.float32)
    model.eval()
    text = document()
    lengths, row_counts = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.rows.split(",")]
    methods = args.methods.split(",")
    probe_start = contention_probe(args.threads)
    results, costs = [], {}
    with torch.no_grad():
        for rows in row_counts:
            costs[rows] = CostModel.probe(model, rows, "rkv", long_cache=1024)
            for length in lengths:
                prompt = prompt_of(tokenizer, length - 2 * interval_for(length) - 16, text)
                for method in methods:
                    result = measure(model, method, prompt, rows, length, tokenizer)
                    result["predicted_tok_s"] = predict(costs[rows], method, rows, length, result)
                    results.append(result)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}),
                          flush=True)
        extra = None
        if args.equal_memory:
            longest = max(lengths)
            dense = next((r for r in results if r["method"] == "dense" and r["length"] == longest and r["rows"] == 16),
                         None)
            if dense is None:
                dense = measure(model, "dense", prompt_of(tokenizer, longest - 2 * interval_for(longest) - 16, text),
                                16, longest, tokenizer)
            extra = equal_memory(model, tokenizer, text, longest, 16, dense["tok_s"])
    probe_end = contention_probe(args.threads)
    print(report(results, extra, args, probe_start, probe_end))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "equal_memory": extra, "threads": args.threads,
                       "machine": platform.platform(), "cpus": os.cpu_count()}, handle, indent=2)


def report(results: list[dict], extra: dict | None, args, probe_start: float, probe_end: float) -> str:
    dense = {(r["length"], r["rows"]): r["tok_s"] for r in results if r["method"] == "dense"}
    lines = [f"\nSmolLM2-135M-Instruct, float32, {args.threads} threads; decode at position L (B = L/8); "
             f"contention probe {probe_start:.3f} / {probe_end:.3f} ms (start / end)\n",
             "| L | rows | method | tok/s (CPU time) | vs dense | tok/s (wall) | predicted tok/s | pred / meas | "
             "KV MiB/row | acceptance | tokens/verif. | mean γ |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = dense.get((r["length"], r["rows"]))
        speed = f"{r['tok_s'] / base:.2f}x" if base else "—"
        predicted = r.get("predicted_tok_s")
        spec = r["method"].startswith("spec")
        lines.append(
            f"| {r['length']} | {r['rows']} | {r['method']} | {r['tok_s']:.1f} | {speed} | {r['wall_tok_s']:.1f} | "
            f"{predicted:.1f} | {predicted / r['tok_s']:.2f} | {r['kv_row_mib']:.1f} | "
            + (f"{r['acceptance']:.3f} | {r['tokens_per_verification']:.2f} | {r['gamma_mean']:.2f} |" if spec
               else "— | — | — |"))
    if extra:
        lines.append(f"\nEqual KV memory at L = {extra['length']}: dense {extra['dense_rows']} rows "
                     f"({extra['dense_kv_gib']:.2f} GiB) {extra['dense_tok_s']:.1f} tok/s; R-KV {extra['rkv_rows']} "
                     f"rows ({extra['rkv_kv_gib']:.2f} GiB) {extra['rkv_tok_s']:.1f} tok/s: **{extra['ratio']:.2f}x**")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
