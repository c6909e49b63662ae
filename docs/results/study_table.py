"""The table of a real-model study (docs/results.md), from the runs its `run.sh` keeps in its directory
(`<dir>/b<budget>/<mode>/seed<k>/`: metrics.jsonl, config.yaml, final_eval.json):

    python docs/results/study_table.py docs/results/smollm2 > docs/results/smollm2/table.md
    python docs/results/study_table.py docs/results/running_total > docs/results/running_total/table.md

Cells are mean (min–max) over the seeds found. Held-out accuracy is greedy, on the run's held-out problems,
under dense and under sparse inference (R-KV at the run's budget), at step 0 and after the last step
(`final_eval.json`). Reward is the training batch's mean first two and last two steps.
B is the R-KV budget of the sparse rollouts and of sparse inference (a dense run uses it only
there). The α tail is the lowest per-length-bin 5th percentile of α over the sparse rollouts, mean
over steps; KV peak is the rollouts' measured peak as a share of dense's on the same rows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

# Rows in this order; any other mode found follows, by name.
ORDER = ("dense", "naive-sparse", "sparse-rl", "geo-rs", "sparrow")


def cell(values: list[float], form: str) -> str:
    if not values:
        return "—"
    mean, low, high = (form.format(v) for v in (statistics.mean(values), min(values), max(values)))
    return mean if low == high else f"{mean} ({low}–{high})"


def runs(budget_dir: Path, mode: str) -> list[tuple[list[dict], dict, dict]]:
    """(step records, config, final_eval) of every finished seed of `mode`."""
    found = []
    for run in sorted((budget_dir / mode).glob("seed*")):
        if not (run / "final_eval.json").exists():
            continue
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        found.append((records, yaml.safe_load((run / "config.yaml").read_text()),
                      json.loads((run / "final_eval.json").read_text())))
    return found


def row(budget: int, mode: str, found) -> str:
    steps = [[s for s in r if s.get("step", 0) >= 1 and "reward_mean" in s] for r, _, _ in found]
    start = [r[0] for r, _, _ in found]
    mean = lambda key, rows: statistics.mean(s[key] for s in rows if key in s)  # noqa: E731
    cells = [
        cell([s["eval_accuracy_dense"] for s in start], "{:.1%}"),
        cell([f["dense"]["accuracy"] for _, _, f in found], "{:.1%}"),
        cell([s["eval_accuracy_sparse"] for s in start], "{:.1%}"),
        cell([f["sparse"]["accuracy"] for _, _, f in found], "{:.1%}"),
        cell([statistics.mean(s["reward_mean"] for s in r[:2]) for r in steps], "{:.2f}"),
        cell([statistics.mean(s["reward_mean"] for s in r[-2:]) for r in steps], "{:.2f}"),
        cell([mean("alpha_tail", r) for r in steps if any("alpha_tail" in s for s in r)], "{:.2f}"),
        cell([mean("kv_peak_bytes", r) / mean("kv_dense_bytes", r) for r in steps], "{:.0%}"),
        cell([r[0].get("flagged_veto_frac", 0.0) for r in steps], "{:.0%}"),
        cell([mean("rejected_token_frac", r) for r in steps], "{:.0%}"),
        cell([mean("step_s", r) for r in steps], "{:.0f}"),
        " / ".join(cell([mean(k, r) for r in steps], "{:.1f}") for k in ("rollout_s", "recompute_s", "update_s")),
    ]
    return f"| {mode} | {budget} | {len(found)} | " + " | ".join(cells) + " |"


def main(study: Path) -> None:
    print("| mode | B | seeds | acc dense inf., step 0 | after | acc sparse inf., step 0 | after | "
          "reward, first 2 steps | last 2 | α tail | KV peak / dense | step-1 veto | rejected tokens | "
          "step s | rollout / recompute / update s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for budget_dir in sorted(study.glob("b*"), key=lambda d: -int(d.name[1:])):
        modes = sorted((d.name for d in budget_dir.iterdir() if d.is_dir()),
                       key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
        for mode in modes:
            found = runs(budget_dir, mode)
            if found:
                print(row(int(budget_dir.name[1:]), mode, found))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python docs/results/study_table.py STUDY_DIR  (e.g. docs/results/smollm2)")
    main(Path(sys.argv[1]))
