#!/usr/bin/env bash
# Time the same `sparserl train` command under two checkouts of the package, alternately, in one run: the
# current tree and a baseline (another checkout's src/, e.g. a git worktree of an earlier commit), so that the
# load of the machine falls on both alike. Prints each run's mean phase times from its metrics.jsonl.
#
#   bash bench/checkouts.sh BASELINE_SRC ROUNDS -- TRAIN_FLAGS...
#   e.g. git worktree add /tmp/before 647c377
#        bash bench/checkouts.sh /tmp/before/src 2 -- --model models/smollm2-135m \
#            --config configs/smollm2-word-addition.yaml --mode sparse-rl --steps 3 --eval-every 0 --threads 2
set -euo pipefail
baseline=$1; rounds=$2; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
py=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
for round in $(seq "$rounds"); do
  for side in baseline current; do
    src=$([ "$side" = baseline ] && echo "$baseline" || echo "$here/src")
    out="$work/$side-$round"
    PYTHONPATH=$src "$py" -m sparserl.cli train --out "$out" --log-with none "$@" > "$out.log" 2>&1
    "$py" bench/phase_means.py "$out/metrics.jsonl" --label "$side round $round"
  done
done
rm -rf "$work"
