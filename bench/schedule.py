"""Predicted against measured rollout time: dense, a fixed KV budget and a budget schedule, in one run.

    python bench/schedule.py --threads 1 [--models builtin,30m] [--lengths 512,1024,2048,4096] [--batch 32]

The cost model (`sparserl.rollout.engine.cost_model`) is probed once per model and batch (matmul rate,
bandwidth, per-step and per-cached-token cost at cache lengths 64 and max(L)/2, per-compression
cost), or read from the rates cache (`--rates`, default ~/.cache/sparserl/cost_rates.json;
`--reprobe` measures again), then predicts each configuration's rollout time from the model's
shapes and the cache-length trajectory alone; the engine then runs it (prompt 64 random tokens, L − 64 sampled tokens, EOS off, as bench/rollout.py):
- dense;
- fixed: R-KV at B = L/4, window 8, Δ = max(8, L/32);
- schedule: R-KV whose budget grows with the cached length, bins of L/4 with budgets
  L/8, 3L/16, L/4, L/4 (the same Δ and window).
Columns: predicted and measured seconds, the error of the prediction, speedups against dense
(predicted from predictions, measured from measurements), the compression share of the rollout
(predicted / measured), and the speedup with compression taken out (predicted: the sparse decode
time alone; measured: rollout seconds minus `kv.compress_seconds`), the most a budget can give. The 30m model runs at --batch-30m rows and --lengths-30m only, as
its dense rollout at L = 4096 takes minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from common import compression_interval, contention_probe
from rollout import PROMPT_LEN, WINDOW, build_model, make_prompts, run_ours

from sparserl.rollout.engine.cost_model import DEFAULT_CACHE, CostModel
from sparserl.rollout.sparsity.budgets import BinnedBudget
from sparserl.rollout.sparsity.eviction import KVCompression


def configurations(length: int) -> list[tuple[str, object]]:
    interval = compression_interval(length)
    quarter = length // 4
    schedule = BinnedBudget(quarter, (length // 8, 3 * length // 16, quarter, quarter))
    return [("dense", None),
            (f"fixed B={quarter}", KVCompression("rkv", budget=quarter, window=WINDOW, interval=interval)),
            (f"schedule {list(schedule.budgets)}", KVCompression("rkv", budget=quarter, window=WINDOW,
                                                                   interval=interval, schedule=schedule))]


def bench_model(name: str, lengths: list[int], batch: int, seed: int, rates: str, reprobe: bool) -> list[dict]:
    model = build_model(name, seed)
    started = time.perf_counter()
    cost = CostModel.probe(model, batch, "rkv", long_cache=max(lengths) // 2, cache=rates, reprobe=reprobe)
    print(f"# {name}: rates ({time.perf_counter() - started:.1f} s): {cost.rates}", flush=True)
    warm = make_prompts(batch, model.config.vocab_size, seed + 999)  # first-call costs stay out of the table
    run_ours(model, warm, 192, None, 0)
    run_ours(model, warm, 192, KVCompression("rkv", budget=64, window=WINDOW, interval=16), 0)
    rows = []
    for length in lengths:
        prompts = make_prompts(batch, model.config.vocab_size, seed + length)
        dense = None
        for label, comp in configurations(length):
            predicted = cost.predict_rollout_seconds(batch, PROMPT_LEN, length - PROMPT_LEN, comp)
            measured = run_ours(model, prompts, length, comp, seed)
            r = {"model": name, "L": length, "config": label, "batch": batch, "predicted": predicted,
                 "measured": measured, "predicted_s": predicted["total_s"], "measured_s": measured["rollout_s"]}
            if comp is None:
                dense = r
            else:
                r.update(predicted_speedup=dense["predicted_s"] / predicted["total_s"],
                         measured_speedup=dense["measured_s"] / measured["rollout_s"],
                         predicted_free=dense["predicted_s"] / predicted["decode_s"],
                         measured_free=dense["measured_s"] / (measured["rollout_s"] - measured["compress_s"]))
            rows.append(r)
            print(f"# {name} L={length} {label}: predicted {r['predicted_s']:.1f} s, measured {r['measured_s']:.1f} s",
                  flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | L | config | predicted s | measured s | error | predicted speedup | measured speedup "
             "| compress share predicted / measured | speedup, compression free: predicted / measured |",
             "|" + "---|" * 11]
    for r in rows:
        error = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        cells = [r["model"], str(r["batch"]), str(r["L"]), r["config"], f"{r['predicted_s']:.1f}",
                 f"{r['measured_s']:.1f}", f"{error:+.0%}", "", "", "", ""]
        if "predicted_speedup" in r:
            share = (r["predicted"]["compress_s"] / r["predicted_s"], r["measured"]["compress_share"])
            cells[7:] = [f"{r['predicted_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x",
                         f"{share[0]:.1%} / {share[1]:.1%}", f"{r['predicted_free']:.2f}x / {r['measured_free']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    speedup_errors = [abs(r["predicted_speedup"] - r["measured_speedup"]) / r["measured_speedup"]
                      for r in rows if "predicted_speedup" in r]
    lines.append(f"\nPrediction within 20% of measurement: {sum(e <= 0.2 for e in errors)} of {len(rows)} rows "
                 f"(worst {max(errors):.0%}); speedups within 20%: {sum(e <= 0.2 for e in speedup_errors)} of "
                 f"{len(speedup_errors)} (worst {max(speedup_errors, default=0):.0%}).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="builtin,30m")
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--lengths-30m", default="1024,2048")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-30m", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", default=str(DEFAULT_CACHE), help="the cost model's rates cache (JSON)")
    p.add_argument("--reprobe", action="store_true", help="measure the rates again even when cached")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# contention probe {contention_probe(args.threads):.3f} ms, load {os.getloadavg()}", flush=True)
    rows = []
    for name in args.models.split(","):
        lengths = args.lengths if name == "builtin" else args.lengths_30m
        rows += bench_model(name, [int(x) for x in lengths.split(",")],
                            args.batch if name == "builtin" else args.batch_30m, args.seed, args.rates,
                            args.reprobe)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    print(f"# contention probe at the end {contention_probe(args.threads):.3f} ms, load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
