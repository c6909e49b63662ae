#!/usr/bin/env bash
# The running-total study of docs/results.md: SmolLM2-135M-Instruct warm-started on the task's format
# (`sparserl sft`, README), then RL where compression binds (answers of 150-210 tokens against an R-KV budget of
# 64; configs/smollm2-running-total.yaml): dense, naive-sparse, sparse-rl and geo-rs, seeds 0 and 1, two runs side
# by side with one torch thread each, micro-batches of 8 (a SmolLM2 update over 24 rows of ~290 tokens holds 8-10 GB
# of activations at 24; the kept dense seed-1 run used 24, which changes float rounding only). A sparse-rl or geo-rs
# run stops after 3 steps with every token rejected (the regime's answer, docs/results.md); `|| true` goes on.
# Needs the warm-started model at models/smollm2-running-total:
#     sparserl sft --model models/smollm2-135m --task running_total --chat-template true \
#         --out models/smollm2-running-total --threads 2 --probe-every 10
# One mode and seed alone (as the issue's check reruns it): MODES=sparse-rl SEEDS=0 bash docs/results/running_total/run.sh
# Then:
#     python docs/results/study_table.py docs/results/running_total > docs/results/running_total/table.md
#     python docs/results/running_total/check_outputs.py docs/results/running_total
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-runs/running-total-study}
modes=${MODES:-dense,sparse-rl,naive-sparse,geo-rs}
seeds=${SEEDS:-0 1}
export OMP_NUM_THREADS=1
run() {  # one mode at a time, so that a mode that stops does not stop the others
  for mode in ${modes//,/ }; do
    .venv/bin/sparserl compare --config configs/smollm2-running-total.yaml --model models/smollm2-running-total \
        --threads 1 --micro-batch-size 8 --modes "$mode" --seeds "$1" --out "$out/b64" || true
  done
}
for seed in $seeds; do
  run "$seed" &
done
wait
# What the table and the checker read, without the checkpoints (540 MB each).
for run_dir in "$out"/b*/*/seed*; do
  keep="docs/results/running_total/${run_dir#"$out"/}"
  mkdir -p "$keep"
  cp "$run_dir"/{metrics.jsonl,config.yaml,samples.jsonl} "$keep"/
  if [ -f "$run_dir/final_eval.json" ]; then cp "$run_dir/final_eval.json" "$keep"/; fi
done
