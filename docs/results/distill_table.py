"""The DistillSparse tables of docs/results.md: per mode, held-out accuracy (dense and sparse
inference, mean (min–max) over seeds), the α tail and α mean averaged over the first and the last
10 steps (per seed: a single step's tail is noisy), and the adapter's KL(dense ‖ sparse) at a few
steps. Usage:
python docs/results/distill_table.py runs/distill/block64 runs/distill/block64-distill"""

import sys
from pathlib import Path

from sparserl.report.common import cell
from sparserl.report.tables import load

WINDOW = 10
KL_STEPS = (1, 21, 41, 61)


def window_mean(steps: list[dict], key: str, last: bool) -> float | None:
    values = [r[key] for r in steps if key in r]
    chosen = values[-WINDOW:] if last else values[:WINDOW]
    return sum(chosen) / len(chosen) if chosen else None


def per_seed_arrow(seeds: list[dict], key: str) -> str:
    pairs = [(window_mean(s["steps"], key, False), window_mean(s["steps"], key, True)) for s in seeds]
    return ", ".join(f"{a:.3f}→{b:.3f}" if a is not None and b is not None else "—" for a, b in pairs)


def adapter_kl(seeds: list[dict]) -> str:
    """The adapter's KL at KL_STEPS, per seed; a mode without an adapter has none."""
    if not any("distill_kl" in r for s in seeds for r in s["steps"]):
        return "—"

    def at(steps: list[dict], step: int) -> str:
        row = next((r for r in steps if r["step"] == step and "distill_kl" in r), None)
        return f"{row['distill_kl']:.2f}" if row else "—"

    return ", ".join("/".join(at(s["steps"], step) for step in KL_STEPS) for s in seeds)


print(f"| | held-out acc, dense inf. | sparse inf. | α tail, first {WINDOW} steps → last {WINDOW} (per seed) "
      f"| α mean, first → last {WINDOW} (per seed) | adapter KL(dense ‖ sparse), steps "
      f"{' / '.join(map(str, KL_STEPS))} (per seed) |")
print("|---|---|---|---|---|---|")
for root in map(Path, sys.argv[1:]):
    _, runs = load(root)
    for mode, seeds in runs.items():
        print(f"| {mode} | {cell([s['acc_dense'] for s in seeds])} | {cell([s['acc_sparse'] for s in seeds])} "
              f"| {per_seed_arrow(seeds, 'alpha_tail')} | {per_seed_arrow(seeds, 'alpha_mean')} | {adapter_kl(seeds)} |")
