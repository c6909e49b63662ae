#!/usr/bin/env bash
# SmolLM2's step-0 greedy gap and peak KV at equal bytes (docs/results/quantized.md): eviction alone (SnapKV B) against
# SnapKV 2B stored as fp8, and fp8 alone; the warm start on seed 0's first 100 held-out prompts, float32, one thread.
# Resumable (a finished report is skipped); about 5 minutes an eval on a free core. Then:
# python docs/results/quantized/smollm2_regime.py
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
out=docs/results/quantized/smollm2
mkdir -p $out
run() {  # name, flags...
  name=$1; shift
  [ -f $out/$name.json ] && return
  .venv/bin/sparserl eval --config configs/smollm2-counted-progression.yaml --model models/smollm2-cp-k1-n12-16 \
      --seed 0 --threads 1 --samples 0 --alpha false --n 100 --out $out/$name.json "$@" > $out/$name.log 2>&1
}
run snapkv48 --inference both --kv-budget 48
run snapkv96-fp8 --inference sparse --kv-budget 96 --kv-dtype fp8
run snapkv64 --inference sparse --kv-budget 64
run snapkv128-fp8 --inference sparse --kv-budget 128 --kv-dtype fp8
run fp8 --inference sparse --sparsity none --kv-dtype fp8
echo "done $(date -Is)"
