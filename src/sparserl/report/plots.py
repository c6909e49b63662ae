"""The comparison report's plots: one line per mode (the mean over seeds) with its min–max band.

`write_plots(dir, runs, tau)` takes the per-seed run summaries of `sparserl.report.tables.load` and writes
the PNGs named in `PLOTS` (and `SCHEDULE_PLOT`, `ALPHA_PLOT` where they apply). Legends sit outside
the axes so that they never cover data.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports are written on headless machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..config.presets import PRESETS  # noqa: E402
from .alpha import alpha_runs, bins_over_seeds, first_last, step_span  # noqa: E402
from .common import DISTILL_SUFFIX, series  # noqa: E402

PLOTS = ("reward.png", "accuracy.png", "mismatch.png", "rejection.png", "kv_memory.png", "rollout_time.png")
SCHEDULE_PLOT = "kv_budget.png"  # only when some run had a budget schedule
ALPHA_PLOT = "alpha_tail.png"  # only when some run logged the α tail per cached-length bin


def _colour(mode: str, i: int) -> str:
    preset = PRESETS.get(mode.removesuffix(DISTILL_SUFFIX))
    return preset.colour if preset and preset.colour else f"C{i % 10}"


def _across_seeds(seeds: list[dict], key: str, records: str = "steps") -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps present in every seed's run, with the mean, min and max of `key` over seeds."""
    per_seed = [dict(zip(*series(s.get(records, []), key))) for s in seeds if s.get(records)]
    if not per_seed:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(d) for d in per_seed)))
    values = [[d[x] for d in per_seed] for x in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def _plot(ax, runs, key, style="-", suffix="", records="steps", scale=1.0, log=False):
    for i, (mode, seeds) in enumerate(runs.items()):
        x, mean, low, high = _across_seeds(seeds, key, records)
        if not x:
            continue
        floor = 1e-12 if log else float("-inf")  # log axis: keep exact-zero ratios visible at the floor
        fix = lambda ys: [max(scale * y, floor) for y in ys]  # noqa: E731
        ax.plot(x, fix(mean), style, color=_colour(mode, i), label=mode + suffix, lw=1.3,
                marker="o" if records == "evals" else None, ms=3)
        if len(seeds) > 1:
            ax.fill_between(x, fix(low), fix(high), color=_colour(mode, i), alpha=0.15, lw=0)
    if log and ax.has_data():
        ax.set_yscale("log")


def _finish(fig, path: Path, axes) -> None:
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not ax.has_data():  # every run missing: say so instead of an empty frame
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _bars(ax, runs, key, ylabel, title, scale=1.0):
    have = [(i, mode, [s[key] for s in seeds if s.get(key) is not None]) for i, (mode, seeds) in enumerate(runs.items())]
    have = [(i, mode, v) for i, mode, v in have if v]
    for j, (i, mode, values) in enumerate(have):
        mean = scale * sum(values) / len(values)
        err = [[mean - scale * min(values)], [scale * max(values) - mean]]
        ax.bar(j, mean, color=_colour(mode, i), yerr=err if len(values) > 1 else None, capsize=3)
    ax.set_xticks(range(len(have)), [m for _, m, _ in have], fontsize=8)
    ax.set(title=title, ylabel=ylabel)


def _budget_schedules(path: Path, runs: dict[str, list[dict]]) -> bool:
    """Budget per cached-length bin over training (mean over seeds), one panel per scheduled mode."""
    scheduled = {mode: seeds for mode, seeds in runs.items()
                 if any(k.startswith("kv_budget_len_") for s in seeds for r in s.get("steps", []) for k in r)}
    if not scheduled:
        return False
    fig, axes = plt.subplots(1, len(scheduled), figsize=(5 * len(scheduled), 3.8), squeeze=False)
    for ax, (mode, seeds) in zip(axes[0], scheduled.items()):
        keys = sorted({k for s in seeds for r in s.get("steps", []) for k in r if k.startswith("kv_budget_len_")},
                      key=lambda k: int(k.rsplit("_", 1)[1]))
        colours = plt.cm.viridis([i / max(len(keys) - 1, 1) for i in range(len(keys))])
        for key, colour in zip(keys, colours):
            x, mean, _, _ = _across_seeds(seeds, key)
            ax.plot(x, mean, color=colour, lw=1.2, label=f"len ≥ {key.rsplit('_', 1)[1]}")
        ax.set(title=f"{mode}: KV budget per cached-length bin", xlabel="step", ylabel="budget (tokens)")
    _finish(fig, path, axes[0])
    return True


def _alpha_tails(path: Path, runs: dict[str, list[dict]], tau: float) -> bool:
    """Left: the α tail per cached-length bin at the first (solid) and last (dashed) logged step, mean
    over seeds with the min–max band; right: the worst bin's tail over training."""
    logged = alpha_runs(runs)
    if not logged:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for i, (mode, seeds) in enumerate(runs.items()):
        for which, style in ((0, "-"), (1, "--")) if mode in logged else ():
            records = [r for r in (first_last(s["steps"])[which] for s in seeds) if r]
            tails = bins_over_seeds(records)
            x = list(tails)
            left.plot(x, [sum(v) / len(v) for v in tails.values()], style, marker="o", ms=3, lw=1.3,
                      color=_colour(mode, i), label=f"{mode}, step {step_span(records)}")
            if len(records) > 1:
                left.fill_between(x, [min(v) for v in tails.values()], [max(v) for v in tails.values()],
                                  color=_colour(mode, i), alpha=0.15, lw=0)
    _plot(right, runs, "alpha_tail")
    for ax in (left, right):
        ax.axhline(tau, color="k", ls=":", lw=1, label=f"τ = {tau}")
    left.set(title="α tail (5th percentile) per cached-length bin: first step (solid), last (dashed)",
             xlabel="bin start (cached tokens)", ylabel="α tail")
    right.set(title="Worst bin's α tail (alpha_tail) over training", xlabel="step", ylabel="alpha_tail")
    _finish(fig, path, [left, right])
    return True


def write_plots(out: Path, runs: dict[str, list[dict]], tau: float) -> list[str]:
    """Write the plots; return the names written (`PLOTS`, then `SCHEDULE_PLOT` and `ALPHA_PLOT` when
    they apply). `tau` is the config's `alpha_tau`, drawn on the α plot."""
    fig, ax = plt.subplots(figsize=(8, 4))
    _plot(ax, runs, "reward_mean")
    ax.set(title="Training reward (mean over seeds, band: min–max)", xlabel="step", ylabel="reward_mean")
    _finish(fig, out / "reward.png", [ax])

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for kind, style in (("dense", "-"), ("sparse", "--")):
        _plot(left, runs, f"eval_accuracy_{kind}", style, f" ({kind} inf.)", records="evals", scale=100)
        _plot(right, runs, f"eval_walk_exact_{kind}", style, f" ({kind} inf.)", records="evals", scale=100)
    left.set(title="Held-out accuracy (solid: dense inference, dashed: sparse)", xlabel="step", ylabel="%")
    right.set(title="Held-out exact walks", xlabel="step", ylabel="%")
    _finish(fig, out / "accuracy.png", [left, right])

    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    _plot(axes[0, 0], runs, "xi_q01", log=True, suffix=" ξ q01")
    _plot(axes[0, 0], runs, "xi_min", ":", log=True, suffix=" ξ min")
    _plot(axes[0, 1], runs, "kl_sampler_old")
    _plot(axes[1, 0], runs, "flagged_veto_frac", suffix=" veto")
    _plot(axes[1, 0], runs, "flagged_band_frac", "--", suffix=" band")
    _plot(axes[1, 1], runs, "ess")
    axes[0, 0].set(title="ξ 1% quantile (solid) and min (dotted)", ylabel="ξ = π_old / π_sparse")
    axes[0, 1].set(title="KL(π_sparse ‖ π_old) on sampled tokens", ylabel="kl_sampler_old")
    axes[1, 0].set(title="Flagged by Sparse-RL's veto (solid) and band (dashed)", ylabel="fraction")
    axes[1, 1].set(title="Effective sample size of the applied weights", ylabel="ess")
    for ax in axes.flat:
        ax.set_xlabel("step")
    fig.suptitle("Sampler / learner mismatch over training")
    _finish(fig, out / "mismatch.png", axes.flat)

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _bars(left, runs, "kv_peak", "MiB", "Peak KV memory in training rollouts")
    _bars(right, runs, "kv_saved", "% of the dense run's peak", "KV saved in training rollouts (peak bytes)",
          scale=100)
    _finish(fig, out / "kv_memory.png", [left, right])

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    _plot(left, runs, "rollout_s")
    left.set(title="Rollout time per step", xlabel="step", ylabel="seconds")
    _bars(right, runs, "rollout_total", "seconds", "Total rollout time")
    _finish(fig, out / "rollout_time.png", [left, right])

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    _plot(left, runs, "rejected_token_frac", scale=100)
    _plot(right, runs, "rejected_seq_frac", scale=100)
    left.set(title="Response tokens rejected by the applied filters", xlabel="step", ylabel="%")
    right.set(title="Sequences removed whole by the applied filters", xlabel="step", ylabel="%")
    _finish(fig, out / "rejection.png", [left, right])
    return list(PLOTS) + ([SCHEDULE_PLOT] if _budget_schedules(out / SCHEDULE_PLOT, runs) else []) + \
        ([ALPHA_PLOT] if _alpha_tails(out / ALPHA_PLOT, runs, tau) else [])
