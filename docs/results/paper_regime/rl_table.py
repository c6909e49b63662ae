"""The RL tables of docs/results.md ("The paper's regime on a real model"), from the run records in this folder.

    python docs/results/paper_regime/rl_table.py [--at STEP] [RECORDS_DIR]

Per run (a folder with metrics.jsonl and eval_step<STEP>.json from `sparserl eval --inference both`; without
--at, each run's last step): held-out greedy accuracy under dense and SnapKV inference at step 0 and at STEP, the
batch reward over the first and last seven steps, how many steps took an optimizer step, the training wall time,
and the regime of the rollouts: the share of sequences Sparse-RL's band or veto touched (sparse-rl only), ξ's 1%
quantile and the α tail (means over steps), and peak KV saved against the dense run of the same seed at the same
steps (the prompts of a step depend on the seed, not the policy). Step 0 is the same for every mode of a seed (the
warm start, greedy, on the seed's 200 held-out prompts): it is read from the seed's first dense attempt, which
evaluated it (`first_attempt_kl1e-4/dense_s<seed>/metrics.jsonl`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def shown(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def row(root: Path, run: Path, at: int | None) -> str | None:
    seed = run.name.rsplit("_s", 1)[1]
    steps = [r for r in records(run / "metrics.jsonl") if r["step"] > 0]
    last = at or max(r["step"] for r in steps)
    evaluation = run / f"eval_step{last}.json"
    if not evaluation.exists():
        return None
    steps = [r for r in steps if r["step"] <= last]
    start = next(r for r in records(root / f"first_attempt_kl1e-4/dense_s{seed}/metrics.jsonl") if r["step"] == 0)
    end = json.loads(evaluation.read_text())
    dense_peaks = {r["step"]: r["kv_peak_bytes"] for r in records(root / f"dense_s{seed}/metrics.jsonl")
                   if r["step"] > 0}
    sparse = [r for r in steps if "alpha_tail" in r]  # rollouts of a compressed cache
    saved = mean([1 - r["kv_peak_bytes"] / dense_peaks[r["step"]] for r in sparse if r["step"] in dense_peaks])
    touched = mean([max(r.get("applied_band_seq_frac", 0.0), r.get("applied_veto_seq_frac", 0.0))
                    for r in steps if "applied_band_seq_frac" in r])
    first7 = [r["reward_mean"] for r in steps if r["step"] <= 7]
    last7 = [r["reward_mean"] for r in steps if r["step"] > last - 7]
    return (f"| {run.name} | {last} | {start['eval_accuracy_dense']:.1%} → {end['dense']['accuracy']:.1%} | "
            f"{start['eval_accuracy_sparse']:.1%} → {end['sparse']['accuracy']:.1%} | "
            f"{mean(first7):.2f} → {mean(last7):.2f} | {sum(r.get('grad_norm', 0.0) > 0 for r in steps)} of {last} | "
            f"{shown(touched, '.0%')} | {shown(mean([r['xi_q01'] for r in sparse]), '.3f')} | "
            f"{shown(mean([r['alpha_tail'] for r in sparse]), '.3f')} | {shown(saved, '.1%')} | "
            f"{sum(r['step_s'] for r in steps) / 60:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="?", type=Path, default=Path(__file__).parent / "rl")
    parser.add_argument("--at", type=int, default=None, help="the step to read (default: each run's last)")
    args = parser.parse_args()
    print("| run | steps | held-out dense: step 0 → end | held-out SnapKV 64: step 0 → end | batch reward, first 7 "
          "steps → last 7 | steps with an update | sequences band/veto touched | ξ q01 | α tail | peak KV saved | "
          "training wall (min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in sorted(p for p in args.records.iterdir() if (p / "metrics.jsonl").exists() and "_s" in p.name):
        line = row(args.records, run, args.at)
        if line:
            print(line)


if __name__ == "__main__":
    main()
