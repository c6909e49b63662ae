"""The Gemma-3-270M DistillSparse table of docs/results.md, from `train` run directories (no held-out
evaluation: the model earns no reward on this task at 64 tokens). Runs with the same seed sample the
same prompts, so a row compares with the plain row of its seed step by step. Per run: the α tail,
the α mean and the sampler's log-perplexity (a collapse shows there) at step 1 (adapter still
zero) and averaged over steps 2–5 and 6–10, and the first two minus the plain run's of the same
seed, step by step; the adapter's KL(dense ‖ sparse) at steps 1 / 5 / 10;
the veto rate, KV kept and step time.
Usage: python docs/results/gemma_distill_table.py runs/distill/gemma-frozen plain distill distill-lr1e-5 distill-lr1e-3"""

import sys
from pathlib import Path

from sparserl.train.metrics import read_metrics

WINDOWS = ((1, 1), (2, 5), (6, 10))
KL_STEPS = (1, 5, 10)


def load_steps(run: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(run / "metrics.jsonl")}


def windows(steps: dict[int, dict], key: str) -> str:
    means = []
    for first, last in WINDOWS:
        values = [steps[s][key] for s in range(first, last + 1) if s in steps]
        means.append(f"{sum(values) / len(values):.3f}" if values else "—")
    return " / ".join(means)


def kl(steps: dict[int, dict]) -> str:
    """The adapter's KL at KL_STEPS; a run without an adapter has none."""
    if not any("distill_kl" in row for row in steps.values()):
        return "—"
    return "/".join(f"{steps[s]['distill_kl']:.3f}" if "distill_kl" in steps.get(s, {}) else "—" for s in KL_STEPS)


def mean_over_steps(steps: dict[int, dict], key: str) -> float:
    return sum(row[key] for row in steps.values()) / len(steps)


def paired_gap(steps: dict[int, dict], plain: dict[int, dict], key: str) -> str:
    """Mean over steps 2–10 of this run's value minus the plain run's at the same step (same prompts)."""
    both = [s for s in range(2, 11) if s in steps and s in plain]
    return f"{sum(steps[s][key] - plain[s][key] for s in both) / len(both):+.3f}" if both else "—"


root, groups = Path(sys.argv[1]), sys.argv[2:]
print("| runs | seed | α tail, step 1 / steps 2–5 / 6–10 | α mean, step 1 / 2–5 / 6–10 "
      "| α tail / α mean minus plain's, steps 2–10 paired | sampler log-ppl, step 1 / 2–5 / 6–10 "
      "| adapter KL, steps 1 / 5 / 10 | veto (all steps) | KV kept, full-attention layers | step s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for group in groups:
    for run in sorted(root.glob(f"{group}-s[0-9]")):
        steps, seed = load_steps(run), run.name.rsplit("-s", 1)[1]
        plain_run = root / f"plain-s{seed}"
        plain = load_steps(plain_run) if group != "plain" and plain_run.exists() else None
        gaps = f"{paired_gap(steps, plain, 'alpha_tail')} / {paired_gap(steps, plain, 'alpha_mean')}" if plain else "—"
        print(f"| {group} | {seed} | {windows(steps, 'alpha_tail')} | {windows(steps, 'alpha_mean')} | {gaps} "
              f"| {windows(steps, 'logppl_sampler')} | {kl(steps)} "
              f"| {mean_over_steps(steps, 'flagged_veto_frac'):.3f} | {mean_over_steps(steps, 'kv_kept_frac'):.3f} "
              f"| {mean_over_steps(steps, 'step_s'):.0f} |")
