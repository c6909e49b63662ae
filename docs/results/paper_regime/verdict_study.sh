#!/usr/bin/env bash
# The nine-seed verdict of issue 54: Sparse-RL against naive-sparse at step 14 of the paper-regime study. The rule,
# decided before these runs (docs/results.md, "Sparse-RL against naive-sparse: nine seeds"): D = Sparse-RL − naive
# per seed, held-out greedy accuracy at step 14; "hurts" if mean D <= −5 points with one-sided paired p < 0.05; "no
# detectable harm" if the 90% CI of D lies within ±7 points; "inconclusive" otherwise.
#
# Seeds 0-2 come from the study (study.sh). This runs seeds 3-8, each run on one thread: per seed, the warm start's
# evaluation on the seed's held-out prompts (step 0), then sparse-rl and naive-sparse to step 14 (run_mode.sh, the
# study's config and settings). Run it again to go on: a finished part is skipped, a stopped run resumes from its last
# checkpoint (every 7 steps). Logs in runs/cp2/.
#
# Each part holds a lock (runs/cp2/locks/) while it runs, and another copy of this script skips a part that is held,
# so two copies started side by side share the parts between two cores. Results do not depend on how many run at once
# (one thread each, fixed seeds).
#
#   bash docs/results/paper_regime/verdict_study.sh
set -uo pipefail
export OMP_NUM_THREADS=1 STOPS=14
model=models/smollm2-cp-k1-n12-16
if [ ! -f "$model/model.safetensors" ]; then
  echo "verdict_study: no warm start at $model; make it with the two commands of docs/results.md's paper-regime" \
       "section (sparserl model smollm2-135m ..., then sparserl sft ...)" >&2
  exit 1
fi
mkdir -p runs/cp2/locks
held=75  # flock's exit status here when another copy holds the part
run_part() {  # NAME LOG COMMAND...: run COMMAND under NAME's lock unless another copy holds it
  local name=$1 log=$2
  shift 2
  flock -n -E "$held" "runs/cp2/locks/$name" "$@" >> "$log" 2>&1
  local status=$?
  if [ "$status" -eq "$held" ]; then
    echo "verdict_study: $name is running in another copy; skipped here"
  elif [ "$status" -ne 0 ]; then
    echo "verdict_study: $name failed, see $log" >&2
  fi
}
for seed in 3 4 5 6 7 8; do
  warm=docs/results/paper_regime/rl/warm_start_s$seed
  if [ ! -f "$warm/eval_step0.json" ]; then
    mkdir -p "$warm"
    run_part "warm_start_s$seed" "runs/cp2/warm_start_s$seed.log" \
      sparserl eval --config configs/smollm2-counted-progression.yaml --model "$model" --seed "$seed" --threads 1 \
        --inference both --samples 0 --alpha false --n 200 --out "$warm/eval_step0.json" \
        --answers "$warm/answers_step0.jsonl"
  fi
  for mode in sparse-rl naive-sparse; do
    run_part "$mode-b32-credit_s$seed" "runs/cp2/$mode-b32-credit_s$seed.log" \
      bash docs/results/paper_regime/run_mode.sh "$mode" "$seed"  # (run_mode.sh skips a finished run)
  done
done
