"""The RL tables of docs/results.md ("The paper's regime on a real model"), from the run records in this folder.

    python docs/results/paper_regime/rl_table.py [--at STEP] [RECORDS_DIR]

Per run (a folder with metrics.jsonl and eval_step<STEP>.json from `sparserl eval --inference both`; without --at,
each run's last step): held-out greedy accuracy under dense and SnapKV inference at step 0 and at STEP, the batch
accuracy (the exact-answer reward) over the first and last seven steps, how many steps took an optimizer step, the
training wall time, and the regime of the rollouts: the share of sequences the most active filter touched (modes
with filters: Sparse-RL's band or veto, Geo-RS's bounds or veto), ξ's 1% quantile and the α tail (means over the
steps that measured them), and peak KV saved against the dense run of the same setting and seed at the same steps
(the prompts of a step depend on the seed and the batch, not the policy: `sparse-rl-b32_s0` is compared with
`dense-b32_s0`). Then per setting, over its seeds: the held-out accuracies at STEP as mean [min-max], and their
shares of the dense setting's means (under SnapKV inference: the sparse-trained model against the dense-trained
one, both read through the compressed cache). Step 0 is the same for every mode of a seed (the warm start, greedy,
on the seed's 200 held-out prompts): it is read from the seed's first dense attempt, which evaluated it
(`first_attempt_kl1e-4/dense_s<seed>/metrics.jsonl`), or from `sparserl eval` of the warm start
(`warm_start_s<seed>/eval_step0.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def shown(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def dense_setting_of(run: Path) -> str:
    """The dense setting the run is compared with: its name with the mode (from its config) read as dense,
    `sparse-rl-b32_s0` -> `dense-b32`; a variant with no dense runs of its own is compared with the setting it
    varies, `sparse-rl-b32-credit-veto0.5_s0` -> `dense-b32-credit`."""
    mode = yaml.safe_load((run / "config.yaml").read_text())["train"]["mode"]
    setting = "dense" + setting_of(run)[len(mode):]
    while "-" in setting and not any(run.parent.glob(f"{setting}_s*")):
        setting = setting.rsplit("-", 1)[0]
    return setting


def setting_of(run: Path) -> str:
    """The run's name without its seed: `sparse-rl-b32_s0` -> `sparse-rl-b32`."""
    return run.name.rsplit("_s", 1)[0]


def seed_of(run: Path) -> str:
    """The run's seed, from its name: `sparse-rl-b32_s0` -> `0`."""
    return run.name.rsplit("_s", 1)[1]


def start_of(root: Path, seed: str) -> tuple[float, float]:
    """The warm start's held-out greedy accuracy on `seed`'s prompts, dense and SnapKV, the same for every mode: from
    the seed's first dense attempt, which evaluated step 0, or from `sparserl eval` of the warm start
    (warm_start_s<seed>/eval_step0.json)."""
    evaluation = root / f"warm_start_s{seed}/eval_step0.json"
    if evaluation.exists():
        found = json.loads(evaluation.read_text())
        return found["dense"]["accuracy"], found["sparse"]["accuracy"]
    start = next(r for r in records(root / f"first_attempt_kl1e-4/dense_s{seed}/metrics.jsonl") if r["step"] == 0)
    return start["eval_accuracy_dense"], start["eval_accuracy_sparse"]


def evaluation_at(run: Path, at: int | None) -> tuple[int, dict] | None:
    """The step read (`at`, default the run's last) and the run's held-out evaluation there, if it has one."""
    last = at or max(r["step"] for r in records(run / "metrics.jsonl"))
    evaluation = run / f"eval_step{last}.json"
    return (last, json.loads(evaluation.read_text())) if evaluation.exists() else None


def spread(values: list[float]) -> str:
    return f"{mean(values):.1%} [{min(values):.1%}-{max(values):.1%}]"


def summary(runs: list[Path], at: int | None) -> list[str]:
    """Per setting and step read, over its seeds: held-out accuracy under dense and SnapKV inference, and each one's
    share of the dense setting's at the same step on the same seeds (a setting with fewer seeds so far is compared
    with dense on those seeds only: the seed picks the held-out prompts and the training prompts)."""
    by_setting: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    dense_settings: dict[str, str] = {}
    for run in runs:
        found = evaluation_at(run, at)
        if found:
            step, end = found
            dense_settings[setting_of(run)] = dense_setting_of(run)
            by_setting.setdefault((setting_of(run), step), {})[seed_of(run)] = (end["dense"]["accuracy"],
                                                                                end["sparse"]["accuracy"])
    lines = ["| setting | step | seeds | held-out dense | held-out SnapKV 64 | dense inference / the dense setting's | "
             "SnapKV inference / the dense setting's |",
             "|---|---|---|---|---|---|---|"]
    for (setting, step), found in sorted(by_setting.items()):
        baseline = by_setting.get((dense_settings[setting], step), {})
        seeds = sorted(found.keys() & baseline.keys())
        which = "" if len(seeds) == len(baseline) else f" (seeds {', '.join(seeds)})"
        shares = [f"{mean([found[s][i] for s in seeds]) / mean([baseline[s][i] for s in seeds]):.0%}{which}"
                  if seeds else "—" for i in (0, 1)]
        results = list(found.values())
        lines.append(f"| {setting} | {step} | {', '.join(sorted(found))} | {spread([d for d, _ in results])} | "
                     f"{spread([s for _, s in results])} | {shares[0]} | {shares[1]} |")
    return lines


def row(root: Path, run: Path, at: int | None) -> str | None:
    seed = seed_of(run)
    found = evaluation_at(run, at)
    if found is None:
        return None
    last, end = found
    steps = [r for r in records(run / "metrics.jsonl") if 0 < r["step"] <= last]
    start = start_of(root, seed)
    dense_run = root / f"{dense_setting_of(run)}_s{seed}/metrics.jsonl"
    dense_peaks = {r["step"]: r["kv_peak_bytes"] for r in records(dense_run) if r["step"] > 0} \
        if dense_run.exists() else {}
    sparse = [r for r in steps if r.get("kv_compressions", 0) > 0]  # rollouts of a compressed cache
    saved = mean([1 - r["kv_peak_bytes"] / dense_peaks[r["step"]] for r in sparse if r["step"] in dense_peaks])
    alpha_tails = [r["alpha_tail"] for r in sparse if "alpha_tail" in r]  # measured every `alpha_every` steps
    filtered = [[v for k, v in r.items() if k.startswith("applied_") and k.endswith("_seq_frac")] for r in steps]
    touched = mean([max(shares) for shares in filtered if shares])  # the filter touching most sequences, a step
    exact = [r.get("reward_task_mean", r["reward_mean"]) for r in steps]  # the task's own, whatever was trained on
    first7, last7 = exact[:7], exact[-7:]
    return (f"| {run.name} | {last} | {start[0]:.1%} → {end['dense']['accuracy']:.1%} | "
            f"{start[1]:.1%} → {end['sparse']['accuracy']:.1%} | "
            f"{mean(first7):.2f} → {mean(last7):.2f} | {sum(r.get('grad_norm', 0.0) > 0 for r in steps)} of {last} | "
            f"{shown(touched, '.0%')} | {shown(mean([r['xi_q01'] for r in sparse]), '.3f')} | "
            f"{shown(mean(alpha_tails), '.3f')} | {shown(saved, '.1%')} | "
            f"{sum(r['step_s'] for r in steps) / 60:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="?", type=Path, default=Path(__file__).parent / "rl")
    parser.add_argument("--at", type=int, default=None, help="the step to read (default: each run's last)")
    args = parser.parse_args()
    print("| run | steps | held-out dense: step 0 → end | held-out SnapKV 64: step 0 → end | batch accuracy, first 7 "
          "steps → last 7 | steps with an update | sequences a filter touched | ξ q01 | α tail | peak KV saved | "
          "training wall (min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs = sorted(p for p in args.records.iterdir() if (p / "metrics.jsonl").exists() and "_s" in p.name)
    for run in runs:
        line = row(args.records, run, args.at)
        if line:
            print(line)
    print()
    print("\n".join(summary(runs, args.at)))


if __name__ == "__main__":
    main()
