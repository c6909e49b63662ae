#!/usr/bin/env bash
# The paper-regime study (issue 42): dense, naive-sparse, sparse-rl and geo-rs, seeds 0-2, each run by run_mode.sh
# (28 steps, held-out evaluations at 14 and 28), two runs at a time on one thread each. The dense seeds first (the
# issue asks dense to gain before a correction is compared), then every mode of seed 0, of seed 1, of seed 2. Run
# it again to go on: a finished run is skipped, a stopped one resumes from its last checkpoint (never beside a
# run_mode.sh of the same run still going). One log per run in runs/cp2/.
#
#   bash docs/results/paper_regime/study.sh [NAME [TRAIN_FLAGS...]]
#
# NAME (default b32-credit, the config's settings) and TRAIN_FLAGS as run_mode.sh's; every mode gets the same ones.
set -uo pipefail
name=${1:-b32-credit}
shift $(($# < 1 ? $# : 1))
runs=("dense 0" "dense 1" "dense 2" "sparse-rl 0" "naive-sparse 0" "geo-rs 0"
      "sparse-rl 1" "naive-sparse 1" "geo-rs 1" "sparse-rl 2" "naive-sparse 2" "geo-rs 2")
mkdir -p runs/cp2

lane() {  # lane FIRST FLAGS...: the runs at positions FIRST, FIRST + 2, ... in turn; a failed one is reported
  local index mode seed first=$1
  shift
  for ((index = first; index < ${#runs[@]}; index += 2)); do
    read -r mode seed <<< "${runs[index]}"
    if ! bash docs/results/paper_regime/run_mode.sh "$mode" "$seed" "$name" "$@" \
        >> "runs/cp2/$mode-${name}_s$seed.log" 2>&1; then
      echo "study: $mode seed $seed failed, see runs/cp2/$mode-${name}_s$seed.log" >&2
    fi
  done
}

lane 0 "$@" &
lane 1 "$@" &
wait
