"""Mean phase times and reward of a run's training steps, from its metrics.jsonl (bench/checkouts.sh prints one
line per run with it).

    python bench/phase_means.py RUN_DIR/metrics.jsonl [--label "current round 1"]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) > 0 and "step_s" in r]
    if not steps:
        raise SystemExit(f"{args.metrics}: no training steps")
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steps)  # noqa: E731
    print(f"{args.label or args.metrics.parent.name}: {len(steps)} steps, step {mean('step_s'):.2f} s = rollout "
          f"{mean('rollout_s'):.2f} + recompute (with alpha) {mean('recompute_s'):.2f} + update {mean('update_s'):.2f} s "
          f"(means); reward {mean('reward_mean'):.3f}")


if __name__ == "__main__":
    main()
