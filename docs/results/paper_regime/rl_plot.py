"""The plot of docs/results.md ("The paper's regime on a real model"): held-out greedy accuracy against training step,
under dense and under SnapKV 64 inference, one line per setting (the mean over its seeds, the band their min-max).

    python docs/results/paper_regime/rl_plot.py [--settings REGEX] [--out FILE] [RECORDS_DIR]

Reads the runs' eval_step<N>.json (every step a run was evaluated at) and step 0 as rl_table.py does. A setting is
the run's name without its seed (`dense-b32` for `dense-b32_s0`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

from rl_table import setting_of, start_of  # noqa: E402 - this folder's table script


def curves(root: Path, run: Path) -> dict[int, tuple[float, float]]:
    """Step -> (dense, SnapKV) held-out accuracy of one run, step 0 included."""
    points = {0: start_of(root, run.name.rsplit("_s", 1)[1])}
    for evaluation in run.glob("eval_step*.json"):
        found = json.loads(evaluation.read_text())
        points[int(evaluation.stem.removeprefix("eval_step"))] = (found["dense"]["accuracy"],
                                                                 found["sparse"]["accuracy"])
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="?", type=Path, default=Path(__file__).parent / "rl")
    parser.add_argument("--settings", default=".", help="a regular expression the settings plotted must match")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "rl_heldout.png")
    args = parser.parse_args()
    runs = sorted(p for p in args.records.iterdir() if list(p.glob("eval_step*.json")) and "_s" in p.name)
    by_setting: dict[str, list[dict[int, tuple[float, float]]]] = {}
    for run in runs:
        if re.search(args.settings, setting_of(run)):
            by_setting.setdefault(setting_of(run), []).append(curves(args.records, run))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for setting, evaluated in sorted(by_setting.items()):
        last = max(max(points) for points in evaluated)
        seeds = [points for points in evaluated if last in points]  # a run still going waits for its end
        steps = sorted(set.intersection(*(set(points) for points in seeds)))  # steps every seed was evaluated at
        for index, (axis, inference) in enumerate(zip(axes, ("dense", "SnapKV 64"))):
            values = [[100 * points[step][index] for points in seeds] for step in steps]
            line, = axis.plot(steps, [sum(v) / len(v) for v in values], marker="o",
                              label=f"{setting} ({len(seeds)} seed{'s' * (len(seeds) > 1)})")
            axis.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                              alpha=0.15)
            axis.set_title(f"held-out greedy accuracy, {inference} inference")
            axis.set_xlabel("training step")
    axes[0].set_ylabel("% exact answers (200 held-out prompts)")
    axes[1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
