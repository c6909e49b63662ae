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

Every held-out accuracy carries ± its binomial standard error (points, on the run's held-out prompts). Then the paired
comparisons over seeds (`sparserl.report.paired`, as `sparserl compare`'s report.md): each setting against its dense
setting and each correction against naive-sparse of the same setting, at the same step on the seeds both have: the
per-seed differences, their mean, 95% t-interval and p, the ratio of the means with its interval, the seeds a 5-point
gap needs and the verdict; and issue 54's rule on Sparse-RL − naive-sparse.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from sparserl.report.paired import paired_note, paired_table, rule_sentence, standard_error


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def shown(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def mode_of(run: Path) -> str:
    return yaml.safe_load((run / "config.yaml").read_text())["train"]["mode"]


def counterpart_of(run: Path, mode: str) -> str:
    """The setting of `mode` the run is compared with: its name with its own mode (from its config) read as `mode`,
    `sparse-rl-b32_s0` -> `dense-b32`; a variant with no runs of `mode` of its own is compared with the setting it
    varies, `sparse-rl-b32-credit-veto0.5_s0` -> `dense-b32-credit`."""
    setting = mode + setting_of(run)[len(mode_of(run)):]
    while "-" in setting[len(mode):] and not any(run.parent.glob(f"{setting}_s*")):
        setting = setting.rsplit("-", 1)[0]
    return setting


def dense_setting_of(run: Path) -> str:
    """The dense setting the run is compared with (`counterpart_of` for dense)."""
    return counterpart_of(run, "dense")


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


def spread(values: list[float], prompts: int | None) -> str:
    return f"{mean(values):.1%}{standard_error(mean(values), prompts)} (min-max {min(values):.1%}-{max(values):.1%})"


# Per (setting, step): {seed: (held-out accuracy under dense inference, under SnapKV, held-out prompts)}.
Results = dict[tuple[str, int], dict[str, tuple[float, float, int]]]


def results(runs: list[Path], at: int | None) -> tuple[Results, dict[str, dict[str, str]]]:
    """Every run's held-out accuracies at the step read, by setting and step; and per setting its mode and
    counterparts ({"mode": its mode, "dense": its dense setting, "naive-sparse": its naive-sparse setting})."""
    by_setting: Results = {}
    counterparts: dict[str, dict[str, str]] = {}
    for run in runs:
        found = evaluation_at(run, at)
        if found:
            step, end = found
            counterparts[setting_of(run)] = {"mode": mode_of(run), "dense": counterpart_of(run, "dense"),
                                             "naive-sparse": counterpart_of(run, "naive-sparse")}
            by_setting.setdefault((setting_of(run), step), {})[seed_of(run)] = (
                end["dense"]["accuracy"], end["sparse"]["accuracy"], end.get("examples"))
    return by_setting, counterparts


def summary(by_setting: Results, counterparts: dict[str, dict[str, str]]) -> list[str]:
    """Per setting and step read, over its seeds: held-out accuracy under dense and SnapKV inference, and each one's
    share of the dense setting's at the same step on the same seeds (a setting with fewer seeds so far is compared
    with dense on those seeds only: the seed picks the held-out prompts and the training prompts)."""
    lines = ["| setting | step | seeds | held-out dense | held-out SnapKV 64 | dense inference / the dense setting's | "
             "SnapKV inference / the dense setting's |",
             "|---|---|---|---|---|---|---|"]
    for (setting, step), found in sorted(by_setting.items()):
        baseline = by_setting.get((counterparts[setting]["dense"], step), {})
        seeds = sorted(found.keys() & baseline.keys(), key=int)
        which = "" if len(seeds) == len(baseline) else f" (seeds {', '.join(seeds)})"
        shares = [f"{mean([found[s][i] for s in seeds]) / mean([baseline[s][i] for s in seeds]):.0%}{which}"
                  if seeds else "—" for i in (0, 1)]
        values = list(found.values())
        prompts = min(v[2] for v in values) if all(v[2] for v in values) else None
        lines.append(f"| {setting} | {step} | {', '.join(sorted(found, key=int))} | "
                     f"{spread([v[0] for v in values], prompts)} | {spread([v[1] for v in values], prompts)} | "
                     f"{shares[0]} | {shares[1]} |")
    return lines


def pairs(by_setting: Results, counterparts: dict[str, dict[str, str]]) -> list[tuple[str, str, int, list[str]]]:
    """(A, B, step, the seeds both have) of the paired comparisons: each setting against its dense setting, then
    each correction against its naive-sparse setting."""
    found = []
    for against in ("dense", "naive-sparse"):
        for (setting, step), seeds in sorted(by_setting.items()):
            other = counterparts[setting][against]
            if counterparts[setting]["mode"] in ("dense", against):
                continue
            both = sorted(seeds.keys() & by_setting.get((other, step), {}).keys(), key=int)
            if both:
                found.append((setting, other, step, both))
    return found


def runs_fallen(root: Path, found: dict[str, tuple[float, float, int]], seeds: list[str]) -> int:
    """Issue 54's secondary measure: of `seeds`, the runs whose held-out dense accuracy ended more than 7 points below
    the warm start's on the same seed's prompts."""
    return sum(found[seed][0] < start_of(root, seed)[0] - 0.07 for seed in seeds)


def paired_sections(root: Path, by_setting: Results, counterparts: dict[str, dict[str, str]]) -> list[str]:
    """The paired comparisons under dense and under SnapKV inference, and issue 54's rule (with its secondary
    measure) wherever a Sparse-RL setting has a naive-sparse one."""
    compared = pairs(by_setting, counterparts)
    prompts = min((v[2] for seeds in by_setting.values() for v in seeds.values() if v[2]), default=None)
    lines = ["Paired comparisons over seeds. " + paired_note(prompts), ""]
    for i, inference in enumerate(("dense inference", "SnapKV 64 inference")):
        rows = [(f"{a} − {b} (step {step}; seeds {', '.join(seeds)})", [by_setting[(a, step)][s][i] for s in seeds],
                 [by_setting[(b, step)][s][i] for s in seeds]) for a, b, step, seeds in compared]
        lines += [f"Held-out accuracy, {inference}:", "", paired_table(rows), ""]
    for a, b, step, seeds in compared:
        if a.startswith("sparse-rl") and a[len("sparse-rl"):] == b[len("naive-sparse"):]:  # the preset, no variant
            differences = [100 * (by_setting[(a, step)][s][0] - by_setting[(b, step)][s][0]) for s in seeds]
            lines.append(f"Issue 54's rule, {a} − {b} at step {step} (dense inference): {rule_sentence(differences)}")
            fallen = [runs_fallen(root, by_setting[(name, step)], seeds) for name in (a, b)]
            lines.append(f"Secondary: runs ending more than 7 points below their start at step {step}: {a} "
                         f"{fallen[0]} of {len(seeds)}, {b} {fallen[1]} of {len(seeds)}.")
    return lines


def regime(run: Path, steps: list[dict]) -> str:
    """The rollouts' regime cells: the share of sequences the most active filter touched, ξ's 1% quantile, the α
    tail, and peak KV saved against the dense run of the same setting and seed at the same steps."""
    dense_run = run.parent / f"{dense_setting_of(run)}_s{seed_of(run)}/metrics.jsonl"
    dense_peaks = {r["step"]: r["kv_peak_bytes"] for r in records(dense_run) if r["step"] > 0} \
        if dense_run.exists() else {}
    sparse = [r for r in steps if r.get("kv_compressions", 0) > 0]  # rollouts of a compressed cache
    saved = mean([1 - r["kv_peak_bytes"] / dense_peaks[r["step"]] for r in sparse if r["step"] in dense_peaks])
    alpha_tails = [r["alpha_tail"] for r in sparse if "alpha_tail" in r]  # measured every `alpha_every` steps
    filtered = [[v for k, v in r.items() if k.startswith("applied_") and k.endswith("_seq_frac")] for r in steps]
    touched = mean([max(shares) for shares in filtered if shares])  # the filter touching most sequences, a step
    return (f"{shown(touched, '.0%')} | {shown(mean([r['xi_q01'] for r in sparse]), '.3f')} | "
            f"{shown(mean(alpha_tails), '.3f')} | {shown(saved, '.1%')}")


def row(root: Path, run: Path, at: int | None) -> str | None:
    found = evaluation_at(run, at)
    if found is None:
        return None
    last, end = found
    steps = [r for r in records(run / "metrics.jsonl") if 0 < r["step"] <= last]
    start = start_of(root, seed_of(run))
    prompts = end.get("examples")
    accuracies = [f"{start[i]:.1%}{standard_error(start[i], prompts)} → {end[kind]['accuracy']:.1%}"
                  f"{standard_error(end[kind]['accuracy'], prompts)}" for i, kind in enumerate(("dense", "sparse"))]
    exact = [r.get("reward_task_mean", r["reward_mean"]) for r in steps]  # the task's own, whatever was trained on
    return (f"| {run.name} | {last} | {accuracies[0]} | {accuracies[1]} | "
            f"{mean(exact[:7]):.2f} → {mean(exact[-7:]):.2f} | {sum(r.get('grad_norm', 0.0) > 0 for r in steps)} of "
            f"{last} | {regime(run, steps)} | {sum(r['step_s'] for r in steps) / 60:.0f} |")


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
    by_setting, counterparts = results(runs, args.at)
    print()
    print("\n".join(summary(by_setting, counterparts)))
    print()
    print("\n".join(paired_sections(args.records, by_setting, counterparts)))


if __name__ == "__main__":
    main()
