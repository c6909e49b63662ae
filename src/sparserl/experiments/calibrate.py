"""`sparserl calibrate`: the smallest KV budget per cached-length bin that keeps the α tail ≥ τ.

Sparrow's calibration (docs/results.md, "Sparrow, part 1"). Rollouts of the current model on calibration prompts (the
task's train split, so the held-out set stays untouched) are scored token by token with the
acceptance rate α against the dense model, and the `quantile` (5th percentile) of α is taken in
each bin of cached length.

Eviction makes the order matter: a token evicted under an early, small budget is gone for every
later bin, so a bin's tail depends on the budgets of all the bins before it. (Sparrow's own block
sparsity keeps the full cache and has no such history.) The schedule is therefore chosen bin by
bin along the sequence: for bin k, the smallest budget, no smaller than bin k−1's, such that with
the budgets already chosen for bins < k in force and this one held for the rest of the sequence,
the tail reaches τ in bin k *and every later bin*. Looking ahead is what stops a small early budget
from evicting a token that a later bin needs (a first version chose bin by bin and passed bin k
only to fail every later one). Bins that even the largest budget cannot rescue are reported. The
tails of each fixed budget are measured too, for the plot. It writes, into `--out`:

- `schedule.yaml`: the schedule, for `--kv-schedule`;
- `tails.png`: the tail against cached length, one line per budget, with τ drawn;
- `calibration.md` and `calibration.json`: the table behind it, and what the schedule saves: the peak KV bytes of
  rollouts on the calibration prompts, dense and under the schedule, sampled as training samples and greedy as
  `eval` decodes (one pass each), as KV saved (`rollout.batch.kv_saved`, the figure `eval --inference both`
  reports). When the sampled rollouts' saving is nothing, a warning names the τ at which some bin's budget would
  start to evict (`saving_starts_at`).

`train --recalibrate-every N` runs the same search on the current weights every N steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..rollout.batch import KVStats, kv_saved
from ..rollout.sparsity.budgets import BinnedBudget
from ..rollout.sparsity.settings import budgeted_sparsity
from ..train.calibration import calibrate_schedule
from ..train.evaluation import complete
from ..train.layout import CALIBRATION_FILE, CALIBRATION_PLOT_FILE, CALIBRATION_TABLE_FILE, SCHEDULE_FILE
from .eval import HeldOut, held_out


def run_calibration(config, out: Path, budgets: list[int], tau: float, bin_size: int, prompts: int,
                    samples: int, quantile: float = 0.05) -> dict:
    setup = held_out(config, 0)
    examples = setup.task.examples(prompts, seed=config.train.seed, split="train")
    found = calibrate_schedule(setup.model, setup.tokenizer, setup.max_new_tokens, config.rollout, examples, budgets,
                               tau, bin_size, samples, config.train.seed, quantile)
    out.mkdir(parents=True, exist_ok=True)
    found.schedule.to_yaml(out / SCHEDULE_FILE, tau=tau, quantile=quantile, policy=config.rollout.kv_policy,
                           window=config.rollout.kv_window, interval=config.rollout.kv_interval)
    result = {"tau": tau, "bin_size": bin_size, "quantile": quantile, "prompts": prompts, "samples": samples,
              "sparsity": config.rollout.sparsity, "tails": {str(b): t for b, t in found.fixed_tails.items()},
              "schedule": list(found.schedule.budgets),
              "schedule_tails": found.schedule_tails, "unmet_bins": found.unmet_bins,
              **_kv_figures(setup, config, examples, samples, out / SCHEDULE_FILE)}
    result["saving_starts_at_tau"] = saving_starts_at(found.fixed_tails, bin_size, result["longest_sequence"])
    result["kv_warning"] = kv_warning(result)
    (out / CALIBRATION_FILE).write_text(json.dumps(result, indent=2) + "\n")
    warning = f"\n\n**Warning**: {result['kv_warning']}" if result["kv_warning"] else ""
    (out / CALIBRATION_TABLE_FILE).write_text(calibration_table(result) + warning + "\n")
    _plot(out / CALIBRATION_PLOT_FILE, found.fixed_tails, found.schedule_tails, tau, found.schedule)
    return result


def _kv_figures(setup: HeldOut, config, examples, samples: int, schedule_file: Path) -> dict:
    """Peak KV bytes on the calibration prompts, dense (the whole cache in the model's dtype) and under the schedule
    file as `--kv-schedule` reads it (stored as `kv_dtype` says, so a quantized cache's saving counts too), and
    KV saved: of rollouts sampled as the calibration samples them (as training does: its temperature, `samples`
    per prompt, its seed), and of greedy ones (as `eval` decodes: one per prompt), which stop sooner and may need
    no eviction at all. With the longest sequence (prompt and response tokens) the dense sampled rollouts wrote."""
    scheduled = budgeted_sparsity(dataclasses.replace(config.rollout, kv_schedule=str(schedule_file)),
                                  "sparserl calibrate")
    figures: dict = {}
    for suffix, temperature, count in (("", config.rollout.temperature, samples), ("_greedy", 0.0, 1)):
        peaks = {}
        for name, compression, kv_dtype in (("dense", None, "auto"), ("schedule", scheduled, config.rollout.kv_dtype)):
            done = complete(setup.model, setup.tokenizer, examples, setup.max_new_tokens, temperature, compression,
                            limits=setup.limits, samples=count, seed=config.train.seed, kv_dtype=kv_dtype)
            peaks[name] = KVStats.merged([b.kv for b in done.batches], [len(b) for b in done.batches]).kv_peak_bytes
            if compression is None and not suffix:
                figures["longest_sequence"] = max(int((b.prompt_lengths + b.response_lengths).max())
                                                  for b in done.batches)
        figures.update({f"kv_peak_bytes{suffix}": peaks, f"kv_saved{suffix}": kv_saved(peaks["schedule"],
                                                                                         peaks["dense"])})
    return figures


def saving_starts_at(tails: dict[int, dict[int, float]], bin_size: int, longest: int) -> float | None:
    """The largest τ at which, by the fixed budgets' tails (`tails`: budget -> {bin start: α tail}), some bin's
    smallest passing budget is below what dense holds there: in the bin starting at s a dense cache holds up to
    min(s + bin_size, `longest`) tokens, and a budget below that evicts. None when no budget tried is below it in
    any bin. The look-ahead may still ask more of a budget than its own bin's tail."""
    evicting = [tail for budget, per_bin in tails.items() for start, tail in per_bin.items()
                if int(budget) < min(int(start) + bin_size, longest)]
    return max(evicting, default=None)


def kv_warning(result: dict) -> str | None:
    """One line when the schedule saves no KV memory by peak on the calibration prompts, naming what would."""
    if result["kv_saved"] is None or result["kv_saved"] > 0:
        return None
    starts = result["saving_starts_at_tau"]
    if result["sparsity"] == "block":
        remedy = "block-sparse attention keeps the whole cache (it saves reads): --sparsity eviction saves memory"
    elif starts is None:
        remedy = (f"every budget tried holds the longest sequence ({result['longest_sequence']} tokens) whole: add "
                  "smaller ones to --calibration-budgets")
    elif starts < result["tau"]:
        # rounded down: the τ said must let the budget pass
        said = math.floor(starts * 1000) / 1000
        remedy = f"a bin's budget would start to evict at --alpha-tau {said:.3f} or lower"
    else:
        remedy = ("budgets that evict pass their own bin at this τ but not the bins after it: try a lower "
                  "--alpha-tau or smaller --calibration-budgets")
    return (f"the schedule saves no KV memory by peak against dense on the calibration prompts "
            f"({result['kv_saved']:.0%}); {remedy}")


def calibration_table(result: dict) -> str:
    def cell(per_bin: dict, start: int) -> str:
        value = per_bin.get(start, per_bin.get(str(start)))  # int keys, or str once through JSON
        return "—" if value is None else f"{value:.3f}"

    starts = sorted({int(s) for t in [*result["tails"].values(), result["schedule_tails"]] for s in t})
    lines = ["| budget | " + " | ".join(f"tail @{s}" for s in starts) + " |", "|" + "---|" * (len(starts) + 1)]
    for budget, per_bin in result["tails"].items():
        lines.append(f"| {budget} | " + " | ".join(cell(per_bin, s) for s in starts) + " |")
    lines.append("| **schedule** | " + " | ".join(cell(result["schedule_tails"], s) for s in starts) + " |")
    schedule = ", ".join(f"{i * result['bin_size']}+: {b}" for i, b in enumerate(result["schedule"]))
    unmet = f" No budget reached τ in the bins starting at {result['unmet_bins']}." if result["unmet_bins"] else ""
    peaks = result["kv_peak_bytes"]
    saved = (f"KV saved by the schedule, by peak against dense on these prompts: {result['kv_saved']:.1%} "
             f"({peaks['schedule']:,} of {peaks['dense']:,} bytes) sampled as above, as training samples; "
             f"{result['kv_saved_greedy']:.1%} greedy, one answer a prompt, as `eval` decodes.")
    return (f"α tail ({result['quantile']:.0%} quantile per cached-length bin of {result['bin_size']} tokens) on "
            f"{result['prompts']} calibration prompts × {result['samples']} samples; τ = {result['tau']}. Rows: fixed "
            "budgets, then the chosen schedule.\n\n" + "\n".join(lines)
            + f"\n\nSchedule (cached length: budget): {schedule}.{unmet}\n\n{saved}")


def _plot(path: Path, tails: dict[int, dict[int, float]], achieved: dict[int, float], tau: float,
          schedule: BinnedBudget) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for budget, per_bin in sorted(tails.items()):
        starts = sorted(per_bin)
        ax.plot(starts, [per_bin[s] for s in starts], marker="o", ms=3, lw=1, label=f"B = {budget}")
    starts = sorted(achieved)
    ax.plot(starts, [achieved[s] for s in starts], color="black", marker="s", lw=2.5, label="schedule")
    ax.axhline(tau, color="black", ls="--", lw=1, label=f"τ = {tau}")
    ax.set(xlabel="cached length (tokens, bin start)", ylabel="α tail (5th percentile)",
           title=f"Acceptance-rate tail by length; schedule: {list(schedule.budgets)}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
