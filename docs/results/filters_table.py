"""Per-filter figures of the corrections study: what each applied filter removed at step 1 (the
start model) and on average, the net advantage left on kept rows, and the reward of kept vs
removed rollouts; mean (min–max) over seeds. Usage:
python docs/results/filters_table.py runs/corr/paper runs/corr/stress > docs/results/corrections/filters.md"""

import sys
from pathlib import Path

from sparserl.report.common import cell
from sparserl.report.tables import load


def per_seed(seeds, key, step=None):
    values = []
    for s in seeds:
        rows = [r for r in s.get("steps", []) if key in r and (step is None or r["step"] == step)]
        values.append(sum(r[key] for r in rows) / len(rows) if rows else None)
    return values


for root in map(Path, sys.argv[1:]):
    meta, runs = load(root)
    print(f"### {root.name} regime (KV budget {meta['config']['rollout']['kv_budget']})\n")
    print("| mode | filter | removed at step 1: seq. / tokens | removed, mean over steps: seq. / tokens | "
          "kept advantage sum / step | reward kept / removed |")
    print("|---|---|---|---|---|---|")
    for mode, seeds in runs.items():
        filters = sorted({k[len("applied_"):-len("_seq_frac")] for s in seeds for r in s.get("steps", []) for k in r
                          if k.startswith("applied_") and k.endswith("_seq_frac")})
        advantage = cell(per_seed(seeds, "kept_advantage_sum"), ".2f")
        rewards = f"{cell(per_seed(seeds, 'reward_kept_mean'), '.3f')} / {cell(per_seed(seeds, 'reward_rejected_mean'), '.3f')}"
        for name in filters or ["—"]:
            if name == "—":
                print(f"| {mode} | none | — | — | {advantage} | — |")
                continue
            first = f"{cell(per_seed(seeds, f'applied_{name}_seq_frac', 1))} / {cell(per_seed(seeds, f'applied_{name}_token_frac', 1))}"
            mean = f"{cell(per_seed(seeds, f'applied_{name}_seq_frac'))} / {cell(per_seed(seeds, f'applied_{name}_token_frac'))}"
            print(f"| {mode} | {name} | {first} | {mean} | {advantage} | {rewards} |")
    print()
