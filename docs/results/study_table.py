"""The table of a real-model study (docs/results.md), from the runs its `run.sh` keeps in its directory
(`<dir>/b<budget>/<mode>/seed<k>/`: metrics.jsonl, config.yaml, final_eval.json):

    python docs/results/study_table.py docs/results/smollm2 > docs/results/smollm2/table.md
    python docs/results/study_table.py docs/results/running_total > docs/results/running_total/table.md

Cells are mean (min–max) over the seeds that finished; a seed that stopped early is named in the seeds column
("seed1 stopped at step 3 of 10") and counted in no cell. Held-out accuracy is greedy, on the run's held-out problems,
under dense and under sparse inference (R-KV at the run's budget), at step 0 and after the last step
(`final_eval.json`). Reward is the training batch's mean first two and last two steps.
B is the R-KV budget of the sparse rollouts and of sparse inference (a dense run uses it only
there). The α tail is the lowest per-length-bin 5th percentile of α over the sparse rollouts, mean
over steps. KV saved is 1 − the run's measured peak KV bytes (largest over its steps) / the peak of the dense run of
the same seed (at any budget: a dense run's training does not read it), which sampled the same prompts at every step
(`rollout.batch.kv_saved`); "no dense run" where the study has none for that seed. Every held-out accuracy carries ±
its binomial standard error (points, one seed's figure at the mean, on the run's held-out problems).

Then the paired comparisons over seeds (`sparserl.report.paired`, as `sparserl compare`'s report.md), per budget: each
mode against dense and each correction against naive-sparse, on the seeds both finished, under dense inference (a
dense run from any budget, its training and dense-inference evaluation do not read it) and under sparse inference
(the same budget only); and issue 54's rule on Sparse-RL − naive-sparse where both ran.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

from sparserl.report.paired import paired_note, paired_table, rule_sentence, standard_error
from sparserl.rollout.batch import kv_saved

# Rows in this order; any other mode found follows, by name.
ORDER = ("dense", "naive-sparse", "sparse-rl", "geo-rs", "sparrow")


def cell(values: list[float], form: str) -> str:
    if not values:
        return "—"
    mean, low, high = (form.format(v) for v in (statistics.mean(values), min(values), max(values)))
    return mean if low == high else f"{mean} ({low}–{high})"


def runs(budget_dir: Path, mode: str) -> tuple[list[tuple[list[dict], dict, dict]], list[str]]:
    """(step records, config, final_eval) of every finished seed of `mode`, and a note for each seed that stopped
    before its last step (no final_eval.json: a correction that rejected everything, a crash): "seed1 stopped at
    step 3 of 10"."""
    found, stopped = [], []
    for run in sorted((budget_dir / mode).glob("seed*")):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
            if (run / "metrics.jsonl").exists() else []
        config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
        if not (run / "final_eval.json").exists():
            last = max((r.get("step", 0) for r in records), default=0)
            planned = config.get("train", {}).get("steps", "?")
            stopped.append(f"{run.name} stopped at step {last} of {planned}")
            continue
        found.append((records, config, json.loads((run / "final_eval.json").read_text())))
    return found, stopped


def dense_peaks(study: Path) -> dict[int, float]:
    """The dense runs' peak KV bytes by seed (their largest over steps), stopped runs included, from any budget's
    directory: a dense run's training does not read the budget (only its sparse-inference evaluation does)."""
    peaks = {}
    for run in sorted(study.glob("b*/dense/seed*")):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [r["kv_peak_bytes"] for r in records if "kv_peak_bytes" in r]
        if steps:
            peaks[int(run.name[4:])] = max(steps)
    return peaks


def accuracy_cell(values: list[float], prompts: int | None) -> str:
    """`cell` of held-out accuracies with the binomial standard error of one seed's figure at their mean."""
    return cell(values, "{:.1%}") + (standard_error(statistics.mean(values), prompts) if values else "")


def prompts_of(found) -> int | None:
    """The held-out problems the runs were evaluated on (their config's `eval_examples`; the fewest if they differ)."""
    sizes = [config.get("output", {}).get("eval_examples") for _, config, _ in found]
    return min(sizes) if sizes and all(isinstance(n, int) for n in sizes) else None


def accuracy_cells(found) -> list[str]:
    """Held-out accuracy under dense and sparse inference, at step 0 and after the last step."""
    start = [r[0] for r, _, _ in found]
    prompts = prompts_of(found)
    return [accuracy_cell([s["eval_accuracy_dense"] for s in start], prompts),
            accuracy_cell([f["dense"]["accuracy"] for _, _, f in found], prompts),
            accuracy_cell([s["eval_accuracy_sparse"] for s in start], prompts),
            accuracy_cell([f["sparse"]["accuracy"] for _, _, f in found], prompts)]


def training_cells(steps: list[list[dict]]) -> tuple[list[str], list[str]]:
    """The cells before the KV column (reward at the start and the end, the α tail) and after it (the step-1 veto,
    rejected tokens, the time per step and its parts)."""
    mean = lambda key, rows: statistics.mean(s[key] for s in rows if key in s)  # noqa: E731
    return [
        cell([statistics.mean(s["reward_mean"] for s in r[:2]) for r in steps], "{:.2f}"),
        cell([statistics.mean(s["reward_mean"] for s in r[-2:]) for r in steps], "{:.2f}"),
        cell([mean("alpha_tail", r) for r in steps if any("alpha_tail" in s for s in r)], "{:.2f}"),
    ], [
        cell([r[0].get("flagged_veto_frac", 0.0) for r in steps], "{:.0%}"),
        cell([mean("rejected_token_frac", r) for r in steps], "{:.0%}"),
        cell([mean("step_s", r) for r in steps], "{:.0f}"),
        " / ".join(cell([mean(k, r) for r in steps], "{:.1f}") for k in ("rollout_s", "recompute_s", "update_s")),
    ]


def row(budget: int, mode: str, found, stopped: list[str], dense: dict[int, float]) -> str:
    seeds = f"{len(found)}" + "".join(f"; {note}" for note in stopped)
    if not found:
        return f"| {mode} | {budget} | {seeds} |" + " — |" * 12
    steps = [[s for s in r if s.get("step", 0) >= 1 and "reward_mean" in s] for r, _, _ in found]
    before_kv, after_kv = training_cells(steps)
    cells = [*accuracy_cells(found), *before_kv, kv_saved_cell(mode, found, dense), *after_kv]
    return f"| {mode} | {budget} | {seeds} | " + " | ".join(cells) + " |"


def kv_saved_cell(mode: str, found, dense: dict[int, float]) -> str:
    if mode == "dense":
        return "—"
    pairs = [(max(s["kv_peak_bytes"] for s in records if "kv_peak_bytes" in s), dense.get(config["train"]["seed"]))
             for records, config, _ in found]
    measured = [kv_saved(peak, dense_peak) for peak, dense_peak in pairs if dense_peak]
    return cell(measured, "{:.0%}") if len(measured) == len(pairs) else "no dense run for every seed"


def finals(found) -> dict[int, tuple[float, float]]:
    """{seed: (held-out accuracy after the last step under dense inference, under sparse inference)}."""
    return {config["train"]["seed"]: (f["dense"]["accuracy"], f["sparse"]["accuracy"]) for _, config, f in found}


def baselines(per_mode: dict[str, dict], against: str, dense_anywhere: dict) -> tuple[str, dict, dict]:
    """A note on B, and B's finals for the dense-inference and the sparse-inference comparison: the budget's own runs
    of `against`; for dense without runs at this budget, the dense runs of any budget under dense inference only."""
    here = per_mode.get(against, {})
    if against == "dense" and not here:
        return "; dense trained at another B", dense_anywhere, {}
    return "", here, here


def budget_comparisons(budget: int, per_mode: dict[str, dict], dense_anywhere: dict) -> tuple[list, list]:
    """The budget's (name, A's accuracies, B's) triples under dense inference and under sparse inference: each mode
    against dense, each correction against naive-sparse, on the seeds both finished."""
    compared = [(m, "dense") for m in per_mode if m != "dense"]
    if "naive-sparse" in per_mode:
        compared += [(m, "naive-sparse") for m in per_mode if m not in ("dense", "naive-sparse")]
    found: tuple[list, list] = ([], [])
    for mode, against in compared:
        note, *baseline = baselines(per_mode, against, dense_anywhere)
        for i in (0, 1):
            seeds = sorted(per_mode[mode].keys() & baseline[i].keys())
            if seeds:
                found[i].append((f"{mode} − {against} (B {budget}; seeds {', '.join(map(str, seeds))}{note})",
                                 [per_mode[mode][s][i] for s in seeds], [baseline[i][s][i] for s in seeds]))
    return found


def paired_sections(study: Path, by_budget: dict[int, dict[str, list]]) -> list[str]:
    """The paired comparisons of every budget under dense and under sparse inference, and issue 54's rule."""
    dense_anywhere = {seed: values for modes in by_budget.values()
                      for seed, values in finals(modes.get("dense", [])).items()}
    tables: dict[str, list] = {"dense inference": [], "sparse inference": []}
    rules = []
    for budget, modes in by_budget.items():
        per_mode = {mode: finals(found) for mode, found in modes.items() if found}
        for rows, inference in zip(budget_comparisons(budget, per_mode, dense_anywhere), tables):
            tables[inference] += rows
        naive, rl = per_mode.get("naive-sparse", {}), per_mode.get("sparse-rl", {})
        both = sorted(naive.keys() & rl.keys())
        if both:
            rules.append(f"Issue 54's rule, sparse-rl − naive-sparse at B {budget} (dense inference): "
                         + rule_sentence([100 * (rl[s][0] - naive[s][0]) for s in both]))
    if not any(tables.values()):
        return []
    prompts = min((n for modes in by_budget.values() for found in modes.values() if (n := prompts_of(found))),
                  default=None)
    lines = [f"Paired comparisons over seeds ({study}). " + paired_note(prompts), ""]
    for inference, rows in tables.items():
        lines += [f"Held-out accuracy, {inference}:", "", paired_table(rows), ""] if rows else []
    return lines + rules


def main(study: Path) -> None:
    print("| mode | B | seeds | acc dense inf., step 0 | after | acc sparse inf., step 0 | after | "
          "reward, first 2 steps | last 2 | α tail | KV saved (peak vs dense run) | step-1 veto | rejected tokens | "
          "step s | rollout / recompute / update s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dense = dense_peaks(study)
    by_budget: dict[int, dict[str, list]] = {}
    for budget_dir in sorted(study.glob("b*"), key=lambda d: -int(d.name[1:])):
        modes = sorted((d.name for d in budget_dir.iterdir() if d.is_dir()),
                       key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
        for mode in modes:
            found, stopped = runs(budget_dir, mode)
            by_budget.setdefault(int(budget_dir.name[1:]), {})[mode] = found
            if found or stopped:
                print(row(int(budget_dir.name[1:]), mode, found, stopped, dense))
    sections = paired_sections(study, by_budget)
    if sections:
        print()
        print("\n".join(sections))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python docs/results/study_table.py STUDY_DIR  (e.g. docs/results/smollm2)")
    main(Path(sys.argv[1]))
