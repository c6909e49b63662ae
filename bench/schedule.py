"""Predicted against measured rollout time: dense, a fixed KV budget and a budget schedule, in one run.

    python bench/schedule.py --threads 1 [--models builtin,30m] [--lengths 512,1024,2048,4096] [--batch 32]

The cost model (`sparserl.cost_model`) is probed once per model (matmul rate, bandwidth, the
model's per-step overhead and per-compression overhead at a tiny cache), then predicts each
configuration's rollout time from the model's shapes and the cache-length trajectory alone; the
engine then runs it (prompt 64 random tokens, L − 64 sampled tokens, EOS off, as bench/rollout.py):
- dense;
- fixed: R-KV at B = L/4, window 8, Δ = max(8, L/32);
- schedule: R-KV whose budget grows with the cached length, bins of L/4 with budgets
  L/8, 3L/16, L/4, L/4 (the same Δ and window).
Columns: predicted and measured seconds, speedups against dense (predicted from predictions,
measured from measurements), the error of the prediction, and the compression share of decode
time (measured, and predicted). The 30m model runs at --batch-30m rows and --lengths-30m only, as
its dense rollout at L = 4096 takes minutes on one core.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import contention_probe
from rollout import PROMPT_LEN, WINDOW, build_model, make_prompts, run_ours

from sparserl.cost_model import CostModel, Shapes, probe
from sparserl.rollout.engine import KVCompression
from sparserl.rollout.schedule import BinnedBudget, FixedBudget



def configurations(length: int) -> list[tuple[str, object]]:
    interval = max(8, length // 32)
    quarter = length // 4
    schedule = BinnedBudget(quarter, (length // 8, 3 * length // 16, quarter, quarter))
    return [("dense", None),
            (f"fixed B={quarter}", KVCompression("rkv", budget=quarter, window=WINDOW, interval=interval)),
            (f"schedule {list(schedule.budgets)}", KVCompression("rkv", budget=quarter, window=WINDOW,
                                                                   interval=interval, schedule=schedule))]


def bench_model(name: str, lengths: list[int], batch: int, seed: int) -> list[dict]:
    model = build_model(name, seed)
    started = time.perf_counter()
    cost = CostModel(probe(model, batch, "rkv"), Shapes.of(model))
    print(f"# {name}: probe {time.perf_counter() - started:.1f} s: {cost.rates}", flush=True)
    rows = []
    for length in lengths:
        prompts = make_prompts(batch, model.config.vocab_size, seed + length)
        dense_measured = dense_predicted = None
        for label, comp in configurations(length):
            schedule = None if comp is None else (comp.schedule or FixedBudget(comp.budget))
            predicted = cost.rollout_seconds(batch, PROMPT_LEN, length - PROMPT_LEN, schedule,
                                             interval=comp.interval if comp else 8)
            measured = run_ours(model, prompts, length, comp, seed)
            if comp is None:
                dense_measured, dense_predicted = measured["rollout_s"], predicted["total_s"]
            rows.append({"model": name, "L": length, "config": label, "batch": batch,
                         "predicted_s": predicted["total_s"], "measured_s": measured["rollout_s"],
                         "predicted_speedup": dense_predicted / predicted["total_s"],
                         "measured_speedup": dense_measured / measured["rollout_s"],
                         "predicted_compress_share": predicted["compress_s"] / predicted["total_s"],
                         "measured_compress_share": measured["compress_share"],
                         "compressions": measured["compressions"], "predicted_compressions": predicted["compressions"]})
            r = rows[-1]
            print(f"# {name} L={length} {label}: predicted {r['predicted_s']:.1f} s, measured {r['measured_s']:.1f} s",
                  flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | L | config | predicted s | measured s | error | predicted speedup | measured speedup "
             "| compress share predicted / measured |", "|" + "---|" * 10]
    for r in rows:
        error = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        speedups = ("", "") if r["config"] == "dense" else (f"{r['predicted_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x")
        share = "" if r["config"] == "dense" else \
            f"{r['predicted_compress_share']:.1%} / {r['measured_compress_share']:.1%}"
        lines.append(f"| {r['model']} | {r['batch']} | {r['L']} | {r['config']} | {r['predicted_s']:.1f} | "
                     f"{r['measured_s']:.1f} | {error:+.0%} | {speedups[0]} | {speedups[1]} | {share} |")
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    within = sum(e <= 0.2 for e in errors)
    lines.append(f"\nPrediction within 20% of measurement: {within} of {len(rows)} rows (worst {max(errors):.0%}).")
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
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# contention probe {contention_probe(args.threads):.3f} ms, load {os.getloadavg()}", flush=True)
    rows = []
    for name in args.models.split(","):
        lengths = args.lengths if name == "builtin" else args.lengths_30m
        rows += bench_model(name, [int(x) for x in lengths.split(",")],
                            args.batch if name == "builtin" else args.batch_30m, args.seed)
    print(table(rows))
    print(f"# contention probe at the end {contention_probe(args.threads):.3f} ms, load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
