#!/usr/bin/env bash
# The SmolLM2-135M-Instruct study of docs/results.md: word additions in the chat template, 8 steps of
# 4 prompts x 6 (configs/smollm2-word-addition.yaml); dense, geo-rs and sparse-rl at R-KV B = 128 (α tail
# about 0.87) with seeds 0, 1 and 2, and geo-rs and sparse-rl at B = 64 with seeds 0 and 1; two seeds side by
# side, one torch thread each. 8-15 minutes per run, about 90 minutes in all on the 2-core machine.
# Needs the model: sparserl model smollm2-135m --out models/smollm2-135m (README). Then:
#     python docs/results/study_table.py docs/results/smollm2 > docs/results/smollm2/table.md
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/smollm2-study}
export OMP_NUM_THREADS=1
run() {
  .venv/bin/sparserl compare --config configs/smollm2-word-addition.yaml --model models/smollm2-135m \
      --threads 1 --alpha-every 1 --kv-budget "$1" --modes "$2" --seeds "$3" --out "$out/b$1"
}
for seed in 0 1; do
  (run 128 dense,geo-rs,sparse-rl "$seed" && run 64 geo-rs,sparse-rl "$seed") &
done
wait
run 128 dense,geo-rs,sparse-rl 2
# What the table reads, without the checkpoints (540 MB each).
for run_dir in "$out"/b*/*/seed*; do
  keep="docs/results/smollm2/${run_dir#"$out"/}"
  mkdir -p "$keep"
  cp "$run_dir"/{metrics.jsonl,config.yaml,final_eval.json} "$keep"/
done
