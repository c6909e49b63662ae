#!/usr/bin/env bash
# The Gemma-3-270M DistillSparse runs of docs/results.md: the README's short chain_sum config (R-KV,
# B = 48, 64 response tokens), the policy frozen (lr 1e-12: Adam's steps fall below float32
# resolution) so that only the sampler's adapter can move α. Without the adapter and with it at its
# default lr (three seeds each), at 1e-5 (two seeds) and at 1e-3 (one). Two runs at a time, one
# thread each: about 75 minutes on a 2-core CPU.
# Usage: bash docs/results/gemma_distill.sh [OUT] (default runs/distill/gemma-frozen), then
#        python docs/results/gemma_distill_table.py OUT plain distill distill-lr1e-5 distill-lr1e-3
set -euo pipefail
out=${1:-runs/distill/gemma-frozen}
model=${MODEL:-models/gemma-3-270m}
mkdir -p "$out"
common=(--model "$model" --task reasoning_gym --gym-dataset chain_sum --mode sparse-tis --steps 10
        --prompts-per-step 2 --group-size 4 --max-new-tokens 64 --kv-budget 48 --kv-interval 8
        --micro-batch-size 4 --kl-coef 0 --lr 1e-12 --eval-every 0 --checkpoint-every 10
        --keep-checkpoints 1 --threads 1)

run() {  # NAME SEED [FLAGS...]
  local name=$1 seed=$2
  shift 2
  OMP_NUM_THREADS=1 sparserl train "${common[@]}" "$@" --seed "$seed" --out "$out/$name-s$seed" \
    > "$out/$name-s$seed.log" 2>&1
}

adapter=(--distill-sparse true)
( run distill 0 "${adapter[@]}"; run distill 1 "${adapter[@]}"; run plain 2
  run distill-lr1e-3 0 "${adapter[@]}" --distill-lr 1e-3 ) &
( run distill 2 "${adapter[@]}"; run plain 0; run plain 1
  run distill-lr1e-5 0 "${adapter[@]}" --distill-lr 1e-5; run distill-lr1e-5 2 "${adapter[@]}" --distill-lr 1e-5 ) &
wait
