#!/usr/bin/env bash
# The running-total study of docs/results.md: SmolLM2-135M-Instruct warm-started on the task's format
# (`sparserl sft`, README), then RL where compression binds (answers of 150-210 tokens against an R-KV budget of
# 64; configs/smollm2-running-total.yaml): dense, naive-sparse, sparse-rl and geo-rs, seeds 0 and 1, two runs side
# by side with one torch thread each. Needs the warm-started model at models/smollm2-running-total:
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
run() {
  .venv/bin/sparserl compare --config configs/smollm2-running-total.yaml --model models/smollm2-running-total \
      --threads 1 --modes "$modes" --seeds "$1" --out "$out/b64"
}
for seed in $seeds; do
  run "$seed" &
done
wait
# What the table and the checker read, without the checkpoints (540 MB each).
for run_dir in "$out"/b*/*/seed*; do
  keep="docs/results/running_total/${run_dir#"$out"/}"
  mkdir -p "$keep"
  cp "$run_dir"/{metrics.jsonl,config.yaml,final_eval.json,samples.jsonl} "$keep"/
done
