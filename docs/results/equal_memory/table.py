"""The equal-memory study's table (docs/results.md), from the runs `run.sh` writes beside this file.

    python docs/results/equal_memory/table.py > docs/results/equal_memory/table.md

Cells are mean (min–max) over the seeds found. Accuracy is the held-out greedy accuracy (dense
inference, 200 prompts) at the last evaluation (step 80) and at step 0; times are means over steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

HERE = Path(__file__).parent
MODES = ("dense", "geo-rs", "sparse-rl")
COLUMNS = (("prompts per step", lambda r, c: c["rollout"]["prompts_per_step"], "{:.0f}"),
           ("rows in flight", lambda r, c: max(s["rows_in_flight"] for s in r), "{:.0f}"),
           ("waves per step", lambda r, c: statistics.mean(s["rollout_waves"] for s in r), "{:.2f}"),
           ("peak KV MiB", lambda r, c: max(s["kv_peak_bytes"] for s in r) / 2**20, "{:.2f}"),
           ("rollout s / step", lambda r, c: statistics.mean(s["rollout_s"] for s in r), "{:.2f}"),
           ("step s", lambda r, c: statistics.mean(s["step_s"] for s in r), "{:.2f}"),
           ("rollout tokens / s", lambda r, c: statistics.mean(s["tokens_per_s"] for s in r), "{:.0f}"),
           ("step-1 veto rate", lambda r, c: r[0]["flagged_veto_frac"], "{:.1%}"),
           ("rejected tokens", lambda r, c: statistics.mean(s["rejected_token_frac"] for s in r), "{:.1%}"))


def cell(values: list[float], form: str) -> str:
    mean = form.format(statistics.mean(values))
    return mean if len(values) == 1 or min(values) == max(values) else \
        f"{mean} ({form.format(min(values))}–{form.format(max(values))})"


def main() -> None:
    print("| mode | seeds | held-out acc, step 80 | acc, step 0 | " + " | ".join(n for n, _, _ in COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for mode in MODES:
        finished, configs = [], []
        for run in sorted(HERE.glob(f"{mode}_s*")):
            if not (run / "metrics.jsonl").exists():
                continue
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            if records and records[-1]["step"] == 80:
                finished.append(records)
                configs.append(yaml.safe_load((run / "config.yaml").read_text()))
        if not finished:
            continue
        steps = [[s for s in r if s["step"] >= 1 and "reward_mean" in s] for r in finished]
        final = [r[-1]["eval_accuracy_dense"] for r in finished]
        start = [r[0]["eval_accuracy_dense"] for r in finished]
        cells = [cell([get(s, c) for s, c in zip(steps, configs)], form) for _, get, form in COLUMNS]
        print(f"| {mode} | {len(finished)} | {cell(final, '{:.1%}')} | {cell(start, '{:.1%}')} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
