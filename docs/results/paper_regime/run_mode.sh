#!/usr/bin/env bash
# One mode and seed of the paper-regime study (issue 42), from the warm start models/smollm2-cp-k1-n12-16 (its sft
# command: docs/results.md). Settings: configs/smollm2-counted-progression.yaml (GRPO, 4 prompts x 8 rollouts at
# T = 0.5, lr 5e-6, no KL, the exact-answer reward plus half the line-prefix credit, 28 steps, one thread). The run
# stops at step 14 for a held-out evaluation (the seed's 200 held-out prompts, greedy, dense and SnapKV 64), then
# resumes to 28 and is evaluated again. A stopped or killed run is resumed from its last checkpoint (every 7 steps)
# by running the same line again; never edit this file while it runs (bash reads it as it goes).
#
#   bash docs/results/paper_regime/run_mode.sh MODE SEED [NAME TRAIN_FLAGS...]
#
# STOPS (environment, default "14 28") names the steps at which the run stops to be evaluated; the nine-seed verdict
# study (verdict_study.sh) stops at 14 only.
#
# NAME (default b32-credit, the config's settings) names a setting; TRAIN_FLAGS override the config's (e.g.
# `b32-lr1e-5 --lr 1e-5`; the exact-answer reward alone: `b32 --reward-funcs task --reward-weights 1`). The run goes
# to runs/cp2/MODE-NAME_sSEED; its records (metrics.jsonl, samples.jsonl, config.yaml, eval_step14/28.json and every
# answer, answers_step14/28.jsonl) to docs/results/paper_regime/rl/MODE-NAME_sSEED. Time on one thread of
# this machine, two runs at a time: dense 1 h 40-55 min (2026-11-27); the sparse modes recompute the dense
# policy's log-probs as well, and α at steps 1, 8, 15 and 22.
set -euo pipefail
mode=$1
seed=$2
name=${3:-b32-credit}
shift $(($# < 3 ? $# : 3))
out=runs/cp2/${mode}-${name}_s${seed}
records=docs/results/paper_regime/rl/${mode}-${name}_s${seed}
export OMP_NUM_THREADS=1
mkdir -p "$records"
for steps in ${STOPS:-14 28}; do
  if [ ! -f "$records/eval_step$steps.json" ]; then
    sparserl train --config configs/smollm2-counted-progression.yaml --model models/smollm2-cp-k1-n12-16 \
        --mode "$mode" --seed "$seed" --steps "$steps" --out "$out" --resume auto "$@"
    sparserl eval --model "$out" --inference both --samples 0 --alpha false --n 200 \
        --out "$records/eval_step$steps.json" --answers "$records/answers_step$steps.jsonl"
    for file in metrics.jsonl samples.jsonl config.yaml; do  # (a failed step stopped the script: set -e)
      if [ -f "$out/$file" ]; then cp "$out/$file" "$records/"; fi
    done
  fi
done
