#!/usr/bin/env bash
# The quantized-KV study of docs/results/quantized.md: the built-in stress regime (configs/stress-regime.yaml: R-KV,
# w 8, Δ 8, one torch thread, float32 model; 80 steps of 8 x 8 rollouts), every sparse cell trained with the
# recommended correction (geo-rs), plus dense:
#
#   dense      --mode dense                      (its sparse-inference figure: R-KV 56, as in every stress study)
#   rkv56      R-KV B = 56, kv_dtype auto        (eviction alone)
#   fp8        kv_dtype fp8,  --kv-budget 4096   (quantization alone: no row of the task reaches 4096 tokens, so the
#   int8       kv_dtype int8, --kv-budget 4096    sampler never evicts; its cache is then the dense one, quantized)
#   rkv56-fp8  R-KV B = 56 with kv_dtype fp8     (both)
#   nemo-fp8   --modes nemo-fp8                  (the field's preset: a full FP8 cache, token TIS at cap 2,
#                                                 beside fp8's full FP8 cache under geo-rs)
#
# Each cell is a `sparserl compare` directory under runs/quantized/ (resumable: a finished run is skipped, an
# interrupted one resumes from its checkpoint). Seed 0 of every cell first, then seed 1, then seed 2. After each
# seed's dense run, the dense-trained model is also evaluated under each quantized cell's sparse inference
# (`sparserl eval`, same 200 held-out prompts), to tell what training with the quantized sampler adds over serving a
# dense-trained model through it. A failed job is logged and the others go on; rerun the script to retry it.
# About 15 minutes a run on one loaded core (18 runs). CELLS and SEEDS pick a subset, in their order. Then:
# python docs/results/quantized/table.py
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
out=${QUANTIZED_OUT:-runs/quantized}
seeds=${SEEDS:-0 1 2}
cells=${CELLS:-dense rkv56 fp8 int8 rkv56-fp8 nemo-fp8}
bin=.venv/bin/sparserl
mkdir -p "$out"
failed=()

cell_flags() {
  case "$1" in
    dense) echo "--modes dense" ;;
    rkv56) echo "--modes geo-rs" ;;
    fp8) echo "--modes geo-rs --kv-dtype fp8 --kv-budget 4096" ;;
    int8) echo "--modes geo-rs --kv-dtype int8 --kv-budget 4096" ;;
    rkv56-fp8) echo "--modes geo-rs --kv-dtype fp8" ;;
    nemo-fp8) echo "--modes nemo-fp8" ;;  # the preset sets --sparsity none --kv-dtype fp8
  esac
}

for seed in $seeds; do
  for cell in $cells; do
    # shellcheck disable=SC2046
    if ! $bin compare --out "$out/$cell" --config configs/stress-regime.yaml $(cell_flags "$cell") \
        --seeds "$seed" --threads 1 --log-with none >"$out/$cell.seed$seed.log" 2>&1; then
      echo "$(date -Is) FAILED: $cell seed $seed (see $out/$cell.seed$seed.log)" | tee -a "$out/failures.log"
      failed+=("$cell/seed$seed")
    fi
  done
  # The dense-trained model through each quantized sampler (what serving it there costs, without training for it).
  dense_run="$out/dense/dense/seed$seed"
  if [ -f "$dense_run/final_eval.json" ]; then
    for sampler in fp8 int8 rkv56-fp8; do
      target="$out/dense_model_under/$sampler.seed$seed.json"
      [ -f "$target" ] && continue
      case "$sampler" in
        fp8) flags="--kv-dtype fp8 --kv-budget 4096" ;;
        int8) flags="--kv-dtype int8 --kv-budget 4096" ;;
        rkv56-fp8) flags="--kv-dtype fp8 --kv-budget 56" ;;
      esac
      # shellcheck disable=SC2086
      $bin eval --model "$dense_run" --out "$target" --inference sparse --samples 0 --n 200 $flags \
          >"$out/dense_model_under.$sampler.seed$seed.log" 2>&1 \
        || { echo "$(date -Is) FAILED: dense model under $sampler, seed $seed" | tee -a "$out/failures.log"
             failed+=("dense_model_under/$sampler/seed$seed"); }
    done
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}; rerun the script to retry them" >&2
  exit 1
fi
echo "done: python docs/results/quantized/table.py"
