"""KV saved against final held-out accuracy, one point per mode and regime (mean over seeds, bars:
min–max), from the study's run directories. Usage: python docs/results/pareto.py runs/study docs/results/pareto.png

KV saved is 1 − a run's peak KV bytes / the peak of the paper study's dense run of the same seed (the same prompts at
every step; a dense run's training does not read the budget), `rollout.batch.kv_saved`."""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sparserl.report.tables import load  # noqa: E402
from sparserl.rollout.batch import kv_saved  # noqa: E402

root, out = Path(sys.argv[1]), Path(sys.argv[2])
fig, ax = plt.subplots(figsize=(7, 4.5))
LABELS = {"paper": "B 80", "stress": "B 56", "sparrow": "calibrated: 84", "adaptive56": "adaptive from 56",
          "adaptive80": "adaptive from 80"}
dense_peaks = [s["kv_peak"] for s in load(root / "paper")[1]["dense"]]
for study in LABELS:
    if not (root / study / "compare.json").exists():
        continue
    _, runs = load(root / study)
    for mode, seeds in runs.items():
        if study != "paper" and mode == "dense":
            continue
        points = [(kv_saved(s["kv_peak"], dense), s["acc_dense"]) for s, dense in zip(seeds, dense_peaks)
                  if s.get("acc_dense") is not None and s.get("kv_peak") is not None]
        if not points:
            continue
        saved = [100 * p[0] for p in points]
        acc = [100 * p[1] for p in points]
        x, y = sum(saved) / len(saved), sum(acc) / len(acc)
        ax.errorbar(x, y, yerr=[[y - min(acc)], [max(acc) - y]], fmt="o", capsize=3)
        label = "dense" if mode == "dense" else f"{mode} ({LABELS[study]})"
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
ax.set(xlabel="peak KV bytes saved in training rollouts (%)", ylabel="final held-out accuracy, dense inference (%)",
       title="KV saved vs accuracy (mean over 3 seeds, bars: min–max)")
fig.tight_layout()
fig.savefig(out, dpi=100)
