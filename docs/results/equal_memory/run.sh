#!/usr/bin/env bash
# The equal-memory study of docs/results.md: stress regime (B = 56), three seeds, 80 steps, one torch
# thread. Dense trains on 8 prompts x 8 per step; geo-rs and sparse-rl on the 16 x 8 that the same KV
# memory holds for them (13.5 MiB: what 8 x 8 dense rows of the built-in task reach). About 45 minutes
# on one core. Then: python docs/results/equal_memory/table.py
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/results/equal_memory
export OMP_NUM_THREADS=1
for seed in 0 1 2; do
  .venv/bin/sparserl train --out "$out/dense_s$seed" --mode dense --seed "$seed" --kv-budget 56 \
      --prompts-per-step 8 --rollout-kv-memory 13.5MiB --threads 1 --resume auto --log-with none
  for mode in geo-rs sparse-rl; do
    .venv/bin/sparserl train --out "$out/${mode}_s$seed" --mode "$mode" --seed "$seed" --kv-budget 56 \
        --prompts-per-step 16 --rollout-kv-memory 13.5MiB --threads 1 --resume auto --log-with none
  done
done
