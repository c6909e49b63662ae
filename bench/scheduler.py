"""Rows that leave and rows in flight: the rollout scheduler against a static batch, and dense against
sparse rollouts at equal KV memory.

    python bench/scheduler.py --threads 1 [--quick] [--repeats 3] [--json FILE]

Part 1, the built-in task: the warm-started built-in model, pointer-walk prompts of the default config,
temperature 1, EOS on (responses end at 18-84 tokens, as RL responses vary), 8 prompts x 8 samples:
- `static`: every row stays in the batch until the longest ends (`release_finished_rows=False`, the
  engine's shape before rows could leave);
- `dense`: rows leave the batch as they end;
- per decode step at equal batch (EOS off, 84 tokens each): R-KV at the stress budget B = 56 against dense;
- equal KV memory: the budget the 64 dense rows reach (`RolloutEngine.row_bytes` x 64); 16 prompts x 8
  requests; dense decodes what fits (64) at a time, waiting requests joining as rows end, R-KV at
  B = 56 fits more; and dense in waves of 64 (each wave waiting for its longest row: the scheduler
  before requests could join mid-flight).
Part 2, long-tailed lengths (as reasoning responses: most short, a few very long): the random built-in
architecture, whose near-uniform next token ends a response with EOS about once in 97 tokens
(geometric lengths, a few up to 5x the mean), 256 requests of 64-token prompts, up to 1024 new
tokens, at the KV memory 32 dense rows reach: dense with requests joining freed rows against dense
in waves of 32, and R-KV at B = 256 (window 8, interval 32) in the same bytes.
Part 3, long responses (random built-in architecture with 8192 positions, 64-token prompts, EOS off,
L = 4096): dense against R-KV at B = L/4 (window 8, interval L/32) at the KV memory 8 dense rows reach,
where R-KV fits 28 rows. 56 requests (--long-requests): whole waves for both, 7 of 8 dense rows and 2
of 28 compressed ones, as in the steady state of a large RL step; with 32 requests the compressed
sampler's last 4 rows decode 4032 steps alone, which measures the leftover wave, not the sampler.
Skipped by --quick (about 6 minutes).

Every row reports rows in flight (S), cohorts (groups of requests that started together), peak KV measured from the buffers (never above the budget),
the tokens generated, seconds (median of --repeats interleaved runs after one warm-up) and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import compression_interval, contention_probe

from sparserl.config.schema import load_config
from sparserl.model.loading import builtin_model_config, load_policy
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import (
    merge_waves,
    request_seed,
    rows_in_flight,
    schedule_rollouts,
)
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression
from sparserl.tasks.registry import max_new_tokens, task_from_config

STRESS_BUDGET = 56


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    p.add_argument("--quick", action="store_true", help="parts 1 and 2 only")
    p.add_argument("--long-requests", type=int, default=56, help="part 3's requests (56: whole waves for both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _run(engine: RolloutEngine, prompts, sampling: SamplingConfig, seed: int, in_waves: bool = False) -> dict:
    seeds = [request_seed(seed, i) for i in range(len(prompts))]
    started = time.perf_counter()
    if in_waves:
        rows = rows_in_flight(engine, sampling, sampling.prompt_width, len(prompts))
        batch = merge_waves([engine.generate(prompts[i:i + rows], sampling, seeds=seeds[i:i + rows])
                             for i in range(0, len(prompts), rows)], sampling.pad_token_id)
        batch.kv.rows_in_flight = rows
    else:
        batch = schedule_rollouts(engine, prompts, sampling, seeds)
    seconds = time.perf_counter() - started
    tokens = int(batch.response_lengths.sum())
    return {"seconds": seconds, "tokens": tokens, "rows_in_flight": batch.kv.rows_in_flight,
            "waves": batch.kv.waves, "kv_peak_mib": batch.kv.kv_peak_bytes / 2**20,
            "lengths": (int(batch.response_lengths.min()), int(batch.response_lengths.max()))}


def measure(configs: dict[str, tuple], repeats: int, seed: int) -> dict[str, dict]:
    """Each config once untimed, then `repeats` rounds of all of them, interleaved; median seconds."""
    for config in configs.values():
        _run(*config[:3], seed, *config[3:])
    runs = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            runs[name].append(_run(*config[:3], seed, *config[3:]))
    results = {}
    for name, done in runs.items():
        seconds = statistics.median(r["seconds"] for r in done)
        results[name] = {**done[0], "seconds": seconds, "spread": (min(r["seconds"] for r in done),
                                                                   max(r["seconds"] for r in done)),
                         "tokens_per_s": done[0]["tokens"] / seconds}
    return results


def builtin_task(seed: int):
    config = load_config()
    model, tokenizer = load_policy(None)
    task = task_from_config(config.task)
    steps = max_new_tokens(config.task, task)
    prompts = [tokenizer(e.prompt).input_ids for e in task.examples(16, seed=seed) for _ in range(8)]
    stress = KVCompression("rkv", budget=STRESS_BUDGET, window=config.rollout.kv_window,
                           interval=config.rollout.kv_interval)
    return model.eval(), tokenizer, prompts, steps, stress


def part_one(args) -> dict[str, dict]:
    model, tokenizer, prompts, steps, stress = builtin_task(args.seed)
    width = max(len(p) for p in prompts)
    eos = SamplingConfig(steps, 1.0, tokenizer.eos_token_id, tokenizer.pad_token_id, prompt_width=width)
    no_eos = SamplingConfig(steps, 1.0, None, tokenizer.pad_token_id, prompt_width=width)
    dense, sparse = RolloutEngine(model, record_evictions=False), RolloutEngine(model, stress, record_evictions=False)
    static = RolloutEngine(model, record_evictions=False, release_finished_rows=False)
    budget = 64 * dense.row_bytes(width, steps)  # what the 8 x 8 dense rows reach
    limited = SamplingConfig(**{**eos.__dict__, "kv_memory_bytes": budget})
    first = prompts[:64]
    results = measure({
        "static, 8x8": (static, first, eos),
        "dense, 8x8": (dense, first, eos),
        "dense, 8x8, EOS off": (dense, first, no_eos),
        "rkv B=56, 8x8, EOS off": (sparse, first, no_eos),
        "dense, 16x8, equal KV": (dense, prompts, limited),
        "dense, 16x8, equal KV, in waves": (dense, prompts, limited, True),
        "rkv B=56, 16x8, equal KV": (sparse, prompts, limited),
    }, args.repeats, args.seed)
    for name in results:
        results[name]["kv_budget_mib"] = budget / 2**20 if "equal KV" in name else None
    return results


def part_tails(args) -> dict[str, dict]:
    prompt, new_tokens, eos = 64, 1024, 2
    torch.manual_seed(args.seed)
    model = type(load_policy(None)[0])(builtin_model_config(97, max_position_embeddings=2048)).eval()
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 97, (prompt,), generator=generator).tolist() for _ in range(256)]
    sampling = SamplingConfig(new_tokens, 1.0, eos, 0, prompt_width=prompt)
    dense = RolloutEngine(model, record_evictions=False)
    sparse = RolloutEngine(model, KVCompression("rkv", budget=256, window=8, interval=32), record_evictions=False)
    budget = 32 * dense.row_bytes(prompt, new_tokens)
    limited = SamplingConfig(**{**sampling.__dict__, "kv_memory_bytes": budget})
    results = measure({"dense, long tails, joining": (dense, prompts, limited),
                       "dense, long tails, in waves": (dense, prompts, limited, True),
                       "rkv B=256, long tails, equal KV": (sparse, prompts, limited)}, args.repeats, args.seed)
    for name in results:
        results[name]["kv_budget_mib"] = budget / 2**20
    return results


def part_two(args) -> dict[str, dict]:
    length, prompt = 4096, 64
    torch.manual_seed(args.seed)
    model = type(load_policy(None)[0])(builtin_model_config(97, max_position_embeddings=8192)).eval()
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 97, (prompt,), generator=generator).tolist() for _ in range(args.long_requests)]
    sampling = SamplingConfig(length - prompt, 1.0, None, 0, prompt_width=prompt)
    dense = RolloutEngine(model, record_evictions=False)
    sparse = RolloutEngine(model, KVCompression("rkv", budget=length // 4, window=8,
                                                interval=compression_interval(length)), record_evictions=False)
    budget = 8 * dense.row_bytes(prompt, length - prompt)
    limited = SamplingConfig(**{**sampling.__dict__, "kv_memory_bytes": budget})
    results = measure({"dense, L=4096, equal KV": (dense, prompts, limited),
                       "rkv B=L/4, L=4096, equal KV": (sparse, prompts, limited)}, 1, args.seed)
    for name in results:
        results[name]["kv_budget_mib"] = budget / 2**20
    assert rows_in_flight(sparse, limited, prompt, len(prompts)) > 8
    return results


def table(results: dict[str, dict]) -> str:
    lines = ["| configuration | S | cohorts | KV budget MiB | peak KV MiB | lengths | tokens | s (min-max) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        budget = f"{r['kv_budget_mib']:.2f}" if r["kv_budget_mib"] else "-"
        lines.append(f"| {name} | {r['rows_in_flight']} | {r['waves']} | {budget} | {r['kv_peak_mib']:.2f} | "
                     f"{r['lengths'][0]}-{r['lengths'][1]} | {r['tokens']} | {r['seconds']:.2f} "
                     f"({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict]) -> list[str]:
    def per_token(name):
        return results[name]["seconds"] / results[name]["tokens"]

    out = [f"rows leaving vs static batch (8x8, EOS on): {results['static, 8x8']['seconds'] / results['dense, 8x8']['seconds']:.2f}x faster",
           f"sparse / dense per decode step at equal batch (EOS off): {per_token('rkv B=56, 8x8, EOS off') / per_token('dense, 8x8, EOS off'):.2f}x",
           f"equal KV memory, built-in task, rkv / dense tokens/s: "
           f"{results['rkv B=56, 16x8, equal KV']['tokens_per_s'] / results['dense, 16x8, equal KV']['tokens_per_s']:.2f}x",
           f"requests joining vs waves (dense, 16x8, equal KV): "
           f"{results['dense, 16x8, equal KV, in waves']['seconds'] / results['dense, 16x8, equal KV']['seconds']:.2f}x faster"]
    joining, waves = results["dense, long tails, joining"], results["dense, long tails, in waves"]
    out.append(f"long tails, requests joining vs waves (dense): {waves['seconds'] / joining['seconds']:.2f}x faster")
    out.append(f"long tails, equal KV memory, rkv B=256 / dense (joining) tokens/s: "
               f"{results['rkv B=256, long tails, equal KV']['tokens_per_s'] / joining['tokens_per_s']:.2f}x")
    if "rkv B=L/4, L=4096, equal KV" in results:
        out.append(f"equal KV memory, L=4096, rkv / dense tokens/s: "
                   f"{results['rkv B=L/4, L=4096, equal KV']['tokens_per_s'] / results['dense, L=4096, equal KV']['tokens_per_s']:.2f}x")
    for name, r in results.items():
        if r["kv_budget_mib"] and r["kv_peak_mib"] > r["kv_budget_mib"]:
            out.append(f"BUDGET EXCEEDED: {name}")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, contention probe {contention_probe(args.threads):.3f} ms")
    results = {**part_one(args), **part_tails(args)}
    if not args.quick:
        results.update(part_two(args))
    print(f"contention probe at end {contention_probe(args.threads):.3f} ms\n")
    print(table(results))
    print()
    print("\n".join(ratios(results)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
