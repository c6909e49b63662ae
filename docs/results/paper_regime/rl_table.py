"""The RL table of docs/results.md ("The paper's regime on a real model"), from the run records in this folder.

    python docs/results/paper_regime/rl_table.py [docs/results/paper_regime/rl]

Per run (a folder with metrics.jsonl and eval_step*.json from `sparserl eval --inference both`): held-out greedy
accuracy under dense and SnapKV inference at step 0 and after training, the batch reward over the first and last
seven steps, how many steps took an optimizer step, and the training wall time. Step 0 is the same for every mode of
a seed (the warm start, greedy, on the seed's 200 held-out prompts): it is read from the seed's first dense attempt,
which evaluated it (`first_attempt_kl1e-4/dense_s<seed>/metrics.jsonl`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "rl")
    print("| run | steps | held-out dense: step 0 → end | held-out SnapKV 64: step 0 → end | batch reward, first 7 "
          "steps → last 7 | steps with an update | training wall (min) |")
    print("|---|---|---|---|---|---|---|")
    for run in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").exists() and list(p.glob("eval_step*.json"))):
        seed = run.name.rsplit("_s", 1)[1]
        start = next(r for r in records(root / f"first_attempt_kl1e-4/dense_s{seed}/metrics.jsonl")
                     if r["step"] == 0)
        steps = [r for r in records(run / "metrics.jsonl") if r["step"] > 0]
        last = max(r["step"] for r in steps)
        end = json.loads((run / f"eval_step{last}.json").read_text())
        first7 = [r["reward_mean"] for r in steps if r["step"] <= 7]
        last7 = [r["reward_mean"] for r in steps if r["step"] > last - 7]
        updates = sum(r.get("grad_norm", 0.0) > 0 for r in steps)
        print(f"| {run.name} | {last} | {start['eval_accuracy_dense']:.1%} → {end['dense']['accuracy']:.1%} | "
              f"{start['eval_accuracy_sparse']:.1%} → {end['sparse']['accuracy']:.1%} | "
              f"{sum(first7) / len(first7):.2f} → {sum(last7) / len(last7):.2f} | {updates} of {last} | "
              f"{sum(r['step_s'] for r in steps) / 60:.0f} |")


if __name__ == "__main__":
    main()
