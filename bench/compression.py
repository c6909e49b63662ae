"""Milliseconds per KV compression of every policy (and per block-sparse selection step), at the shapes a rollout
compresses, all configurations measured in one run.

    python bench/compression.py --threads 1 [--shapes builtin,qwen1.5b] [--lengths 512,2048,4096]
                                [--budgets L/8,256] [--policies h2o,...] [--rows 8] [--interval 16]
                                [--repeats 3] [--max-cell-s 20] [--rollout] [--json FILE]

Per model shape, cached length L and budget B: the keys of `--rows` rows of every layer, stacked as
`eviction.compress_rows` stacks them (one call per compression), float32, every slot real. The keys share a
per-head mean direction, so that key cosine similarities spread around R-KV's threshold (0.5), as real keys'
do. Columns:
- `first`: a fresh policy state compresses L slots to B: score + `select_slots` + `before_keep` (the
  compression after a long prompt, and the only one that costs O(L²) for R-KV);
- `next`: the compression after it, B kept + Δ (`--interval`) appended slots back to B (the steady state of a
  rollout);
- block-sparse attention selects pages at every decode step instead: `block` is one step's selection
  (`page_scores` + `select_pages` per sparse layer, B/16 pages of 16) in `next`, and Δ steps of it in `first`,
  so that both columns price the same decoded tokens.
Shapes: `builtin` is the built-in model (3 layers, 2 KV heads, 4 query heads, head dim 32); `qwen1.5b` is
Qwen2.5-1.5B's attention (28 layers, 2 KV heads, 12 query heads, head dim 128).
Every cell is the median of `--repeats` interleaved rounds (fewer where a cell passed `--max-cell-s`).
`--rollout` adds the share of a rollout: the built-in model (random weights) continues an L - 8 token prompt of
`--rows` rows for 48 tokens (EOS off) at B and Δ, dense and each policy, interleaved; compression seconds over
rollout seconds, and the rollout's seconds over dense's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import contention_probe

WINDOW = 8
PAGE = 16


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int


SHAPES = {"builtin": Shape(3, 2, 4, 32), "qwen1.5b": Shape(28, 2, 12, 128)}


def parse_args(argv=None) -> argparse.Namespace:
    from sparserl.rollout.sparsity.policies import POLICIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default="builtin,qwen1.5b")
    p.add_argument("--lengths", default="512,2048,4096")
    p.add_argument("--budgets", default="L/8,256", help="comma list of budgets: numbers or L/k")
    p.add_argument("--policies", default=",".join(sorted(POLICIES)) + ",block")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--interval", type=int, default=16, help="Δ, the slots appended between compressions")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-cell-s", type=float, default=20.0, help="stop repeating a cell once it took this long")
    p.add_argument("--rollout", action="store_true", help="add the rollout share (built-in model, L = 2048)")
    p.add_argument("--rollout-lengths", default="2048")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.shape_list = args.shapes.split(",")
    args.length_list = [int(x) for x in args.lengths.split(",")]
    args.policy_list = args.policies.split(",")
    unknown = set(args.shape_list) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    return args


def budgets_for(spec: str, length: int) -> list[int]:
    found = []
    for part in spec.split(","):
        budget = length // int(part[2:]) if part.startswith("L/") else int(part)
        if budget < length and budget not in found:
            found.append(budget)
    return found


def scoring_inputs(shape: Shape, rows: int, length: int, seed: int):
    from sparserl.rollout.sparsity.policies import ScoringInputs

    g = torch.Generator().manual_seed(seed)
    n = rows * shape.layers
    direction = torch.randn(n, shape.kv_heads, 1, shape.head_dim, generator=g)
    keys = direction + 0.9 * torch.randn(n, shape.kv_heads, length, shape.head_dim, generator=g)
    return ScoringInputs(
        keys=keys, queries=torch.randn(n, shape.q_heads, WINDOW, shape.head_dim, generator=g),
        query_real=torch.ones(n, WINDOW, dtype=torch.bool), real=torch.ones(n, 1, length, dtype=torch.bool),
        columns=torch.arange(length).expand(n, 1, length).clone(),
        attention_mass=torch.rand(n, shape.kv_heads, length, generator=g), layers=tuple(range(shape.layers)))


def kept_then_appended(inputs, slots: torch.Tensor, appended: int, seed: int):
    """The next compression's inputs: the kept slots at the front, then `appended` new slots."""
    from sparserl.rollout.sparsity.policies import ScoringInputs

    g = torch.Generator().manual_seed(seed)
    n, heads, _, dim = inputs.keys.shape
    kept = inputs.keys.gather(2, slots.expand(n, heads, -1)[..., None].expand(-1, -1, -1, dim))
    new = inputs.keys[:, :, :1] + 0.9 * torch.randn(n, heads, appended, dim, generator=g)
    budget = slots.shape[-1]
    length = budget + appended
    start = int(inputs.columns[0, 0, -1]) + 1
    columns = torch.cat([inputs.columns.gather(2, slots), torch.arange(start, start + appended).expand(n, 1, -1)], 2)
    mass = torch.rand(n, heads, length, generator=g)
    return ScoringInputs(keys=torch.cat([kept, new], dim=2), queries=inputs.queries, query_real=inputs.query_real,
                         real=torch.ones(n, 1, length, dtype=torch.bool), columns=columns, attention_mass=mass,
                         layers=inputs.layers)


def compress(policy, inputs, budget: int) -> tuple[float, torch.Tensor]:
    from sparserl.rollout.sparsity.policies import select_slots

    started = time.perf_counter()
    slots = select_slots(policy.score(inputs), inputs.real, inputs.columns, budget, WINDOW)
    policy.before_keep(inputs, slots)
    return time.perf_counter() - started, slots


def block_step_seconds(shape: Shape, rows: int, length: int, budget: int, seed: int) -> float:
    """One decode step's page selection in every layer (the selector runs layer by layer, `rows` rows each)."""
    from sparserl.rollout.sparsity.block_sparse import page_scores, select_pages

    g = torch.Generator().manual_seed(seed)
    pages = -(-length // PAGE)
    centroids = torch.randn(rows, shape.kv_heads, pages, shape.head_dim, generator=g)
    counts = torch.full((rows, pages), float(PAGE))
    query = torch.randn(rows, shape.q_heads, 1, shape.head_dim, generator=g)
    current = torch.full((rows,), pages - 1)
    forced = torch.stack([torch.zeros_like(current), current - 1, current], dim=1)
    keep = max(3, budget // PAGE)
    started = time.perf_counter()
    for _ in range(shape.layers):
        select_pages(page_scores(query, centroids, counts), forced, keep)
    return time.perf_counter() - started


def cell(args, shape_name: str, length: int, budget: int) -> dict:
    """ms per compression of every policy at one (shape, L, B): first and next, medians of interleaved rounds."""
    from sparserl.rollout.sparsity.policies import POLICIES

    shape = SHAPES[shape_name]
    inputs = scoring_inputs(shape, args.rows, length, args.seed)
    times: dict[str, dict[str, list[float]]] = {p: {"first": [], "next": []} for p in args.policy_list}
    policies = {p: POLICIES[p]() for p in args.policy_list if p != "block"}
    started = time.perf_counter()
    for round_ in range(args.repeats):
        for name in args.policy_list:
            gc.collect()
            if name == "block":
                step = block_step_seconds(shape, args.rows, length, budget, args.seed + round_)
                times[name]["first"].append(step * args.interval)
                times[name]["next"].append(step)
                continue
            policy = policies[name]
            policy.begin_rollout()
            first, slots = compress(policy, inputs, budget)
            following = kept_then_appended(inputs, slots, args.interval, args.seed + 1)
            times[name]["first"].append(first)
            times[name]["next"].append(compress(policy, following, budget)[0])
            del following
        if time.perf_counter() - started > args.max_cell_s:
            break
    rounds = len(times[args.policy_list[0]]["first"])
    result = {"shape": shape_name, "length": length, "budget": budget, "rounds": rounds,
              "ms": {name: {k: statistics.median(v) * 1e3 for k, v in t.items()} for name, t in times.items()}}
    print(f"# {shape_name} L={length} B={budget}: " + ", ".join(
        f"{n} {m['first']:.1f}/{m['next']:.2f}" for n, m in result["ms"].items()), file=sys.stderr, flush=True)
    return result


def rollout_share(args, length: int, budget: int) -> dict:
    """Seconds of a short rollout after a long prompt, dense and each policy, interleaved; compression share."""
    from rollout import build_model

    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine
    from sparserl.rollout.sparsity.block_sparse import BlockSparsity
    from sparserl.rollout.sparsity.eviction import KVCompression

    model = build_model("builtin", args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(2, model.config.vocab_size, (args.rows, length - 8), generator=g).tolist()
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0, eos_token_id=None)
    engines = {"dense": RolloutEngine(model, None, record_evictions=False)}
    for name in args.policy_list:
        sparsity = BlockSparsity(budget=budget, page_size=PAGE, dense_layers=0) if name == "block" else \
            KVCompression(name, budget=budget, window=WINDOW, interval=args.interval)
        engines[name] = RolloutEngine(model, sparsity, record_evictions=False)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for round_ in range(args.repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            gc.collect()
            batch = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(args.seed))
            if round_:
                runs[name].append((batch.rollout_seconds, batch.kv.compress_seconds))
    return {"length": length, "budget": budget, "modes": {name: {
        "rollout_s": statistics.median(t for t, _ in r),
        "vs_dense": statistics.median(t / d for (t, _), (d, _) in zip(r, runs["dense"])),
        "compress_share": statistics.median(c / t for t, c in r)} for name, r in runs.items()}}


def table(cells: list[dict], args) -> str:
    lines = [f"ms per compression ({args.rows} rows of every layer stacked, float32, {args.threads} thread(s); "
             f"first: L slots to B from a fresh state; next: B + Δ = {args.interval} back to B; block: page "
             f"selection over Δ decode steps / one step); medians of interleaved rounds", "",
             "| shape | L | B | rounds | " + " | ".join(f"{p} first | {p} next" for p in args.policy_list) + " |",
             "|---|---|---|---|" + "---|---|" * len(args.policy_list)]
    for c in cells:
        lines.append(f"| {c['shape']} | {c['length']} | {c['budget']} | {c['rounds']} | " + " | ".join(
            f"{c['ms'][p]['first']:.1f} | {c['ms'][p]['next']:.2f}" for p in args.policy_list) + " |")
    return "\n".join(lines)


def share_table(shares: list[dict], args) -> str:
    lines = [f"Rollout share (built-in model, random weights, {args.rows} rows, prompt L - 8, 48 new tokens, EOS off, "
             f"Δ {args.interval}; medians of {args.repeats} interleaved rounds)", "",
             "| L | B | mode | rollout s | / dense | compression share |", "|---|---|---|---|---|---|"]
    for s in shares:
        for name, m in s["modes"].items():
            lines.append(f"| {s['length']} | {s['budget']} | {name} | {m['rollout_s']:.3f} | {m['vs_dense']:.2f} | "
                         + (f"{m['compress_share']:.1%} |" if name not in ("dense", "block") else "- |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results: dict = {"args": {k: v for k, v in vars(args).items() if k != "json"},
                     "load_avg_start": os.getloadavg(), "probe_ms_start": contention_probe(args.threads)}
    torch.set_num_threads(args.threads)
    cells = [cell(args, shape, length, budget) for shape in args.shape_list for length in args.length_list
             for budget in budgets_for(args.budgets, length)]
    results["cells"] = cells
    if args.rollout:
        results["rollout"] = [rollout_share(args, int(length), 256) for length in args.rollout_lengths.split(",")]
    results["probe_ms_end"] = contention_probe(args.threads)
    results["load_avg_end"] = os.getloadavg()
    results["wall_s"] = time.perf_counter() - started
    print(table(cells, args))
    if args.rollout:
        print("\n" + share_table(results["rollout"], args))
    print(f"\nload average (1/5/15 min) at start {tuple(round(x, 2) for x in results['load_avg_start'])}, at end "
          f"{tuple(round(x, 2) for x in results['load_avg_end'])}; {os.cpu_count()} CPUs; contention probe (median "
          f"ms of one small linear) {results['probe_ms_start']:.3f} at start, {results['probe_ms_end']:.3f} at end; "
          f"wall {results['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
