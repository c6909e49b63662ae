"""The comparison report: plots, the paper-style table and computed findings for `sparserl compare`.

`write_report(dir)` reads `dir/compare.json` (which modes were asked for, the config) and, for each
mode, `dir/<mode>/metrics.jsonl` and `dir/<mode>/final_eval.json`. It writes five PNG plots and
`report.md` into `dir`. A mode with no run directory is reported as "not run"; one without a
readable `final_eval.json` as "incomplete" (its numbers then come from the metrics file alone).
`paper_table(dir)` returns just the main table, for the command line to print.

KV columns describe the *training rollouts* (what Sparse-RL's "KV storage saved" measures): the
mean of `kv_kept_frac` and the largest `kv_peak_bytes` / `kv_dense_bytes` over the steps. Only
when the metrics lack them do they fall back to the held-out sparse evaluation's KV figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports are written on headless machines
import matplotlib.pyplot as plt  # noqa: E402

MODE_COLOURS = {"dense": "#1f77b4", "naive-sparse": "#d62728", "sparse-rl": "#2ca02c",
                "sparse-tis": "#ff7f0e", "sparse-rs": "#9467bd"}
PLOTS = ("reward.png", "accuracy.png", "mismatch.png", "kv_memory.png", "rollout_time.png")
MIB = 1024 ** 2
# Thresholds of the findings, stated in the report too.
COLLAPSE_FRAC = 0.5     # collapsed: final dense-inference accuracy < 50% of its step-0 value
DEGRADE_POINTS = 5.0    # degraded / improved: more than 5 accuracy points below / above step 0
TARGET_ACC_FRAC = 97.0  # paper: Sparse-RL keeps >= 97% of dense accuracy ...
TARGET_KV_SAVED = 50.0  # ... with >= 50% fewer KV tokens
TABLE_HEADER = ("Mode", "Held-out acc (dense inference)", "Held-out acc (sparse inference)",
                "Acc at step 0 (dense / sparse)", "KV tokens kept (% of dense)", "KV saved",
                "Peak KV MiB (sparse / dense)", "Rollout s (total)", "Train time (total)",
                "Final train reward", "Vetoed seq. (mean)", "Skipped steps")
MISMATCH_KEYS = (("xi_q01", "mean"), ("xi_min", "min"), ("kl_sampler_old", "mean"), ("veto_frac", "mean"),
                 ("band_mask_frac", "mean"), ("ess", "mean"), ("response_len_mean", "mean"))
DASH = "—"


# ---------------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_records(path: Path) -> list[dict]:
    # A run killed mid-write leaves a partial last line; skip bad lines instead of failing the report.
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return sorted(records, key=lambda r: r["step"])


def _modes(compare_dir: Path, meta: dict) -> list[str]:
    if meta.get("modes"):
        return list(meta["modes"])
    # No compare.json: report whatever run directories are there, in the canonical order first.
    found = [p.name for p in compare_dir.iterdir() if (p / "metrics.jsonl").exists()]
    return sorted(found, key=lambda m: (list(MODE_COLOURS).index(m) if m in MODE_COLOURS else 99, m))


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _summarise(mode: str, run_dir: Path) -> dict[str, Any]:
    """Everything the table, findings and plots need about one mode; missing values are None."""
    if not run_dir.is_dir():
        return {"mode": mode, "status": "not run", "steps": []}
    records = _read_records(run_dir / "metrics.jsonl")
    final = _read_json(run_dir / "final_eval.json")
    steps = [r for r in records if r["step"] >= 1 and "reward_mean" in r]  # step 0 is eval-only
    evals = [r for r in records if "eval_accuracy_dense" in r]
    start = next((r for r in records if r["step"] == 0), {})
    s = {"mode": mode, "status": "done" if final else "incomplete", "steps": steps, "evals": evals}
    # Held-out accuracy: the final evaluation; an incomplete run shows its latest in-training one.
    last_eval = evals[-1] if evals and evals[-1]["step"] > 0 else {}
    for kind in ("dense", "sparse"):
        fin = (final or {}).get(kind) or {}
        s[f"acc_{kind}"] = fin.get("accuracy", last_eval.get(f"eval_accuracy_{kind}"))
        s[f"acc0_{kind}"] = start.get(f"eval_accuracy_{kind}")
    kv_eval = ((final or {}).get("sparse") or {}).get("kv") or {}
    kept = _mean(_series(steps, "kv_kept_frac")[1])
    s["kv_kept"] = kept if kept is not None else kv_eval.get("kept_token_frac")
    peaks, denses = _series(steps, "kv_peak_bytes")[1], _series(steps, "kv_dense_bytes")[1]
    s["kv_peak"] = max(peaks) if peaks else kv_eval.get("kv_peak_bytes")
    s["kv_dense"] = max(denses) if denses else kv_eval.get("kv_dense_bytes")
    s["rollout_total"] = (final or {}).get("rollout_seconds", sum(_series(steps, "rollout_s")[1]) if steps else None)
    s["train_total"] = (final or {}).get("train_seconds", sum(_series(steps, "step_s")[1]) if steps else None)
    rewards = _series(steps, "reward_mean")[1]
    tail = max(1, math.ceil(len(rewards) / 10))  # "final" reward = mean of the last 10% of steps
    s["final_reward"] = _mean(rewards[-tail:])
    s["vetoed_mean"] = _mean(_series(steps, "vetoed_sequences")[1])
    skipped = _series(steps, "skipped_steps")[1]
    s["skipped"] = int(skipped[-1]) if skipped else (int(sum(_series(steps, "skipped")[1])) if steps else None)
    for key, how in MISMATCH_KEYS:
        values = _series(steps, key)[1]
        s[key] = (min(values) if values else None) if how == "min" else _mean(values)
    buckets = {k for r in steps for k in r if k.startswith("veto_frac_len_")}  # empty buckets are omitted per step
    s["veto_by_len"] = {k: _mean(_series(steps, k)[1]) for k in buckets}
    return s


def _load(compare_dir: Path) -> tuple[dict, list[dict]]:
    compare_dir = Path(compare_dir)
    meta = _read_json(compare_dir / "compare.json") or {}
    return meta, [_summarise(m, compare_dir / m) for m in _modes(compare_dir, meta)]


# ---------------------------------------------------------------------------------- tables
def _pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return DASH if x is None else f"{x:{fmt}}{unit}"


def _kv_kept_pct(s: dict) -> float | None:
    return None if s.get("kv_kept") is None else 100.0 * s["kv_kept"]


def _row(s: dict) -> list[str]:
    if s["status"] == "not run":
        return [f"{s['mode']} (not run)"] + [DASH] * (len(TABLE_HEADER) - 1)
    kept = _kv_kept_pct(s)
    mib = (DASH if s["kv_peak"] is None or s["kv_dense"] is None
           else f"{s['kv_peak'] / MIB:.2f} / {s['kv_dense'] / MIB:.2f}")
    return [s["mode"] + (" (incomplete)" if s["status"] == "incomplete" else ""),
            _pct(s["acc_dense"]), _pct(s["acc_sparse"]), f"{_pct(s['acc0_dense'])} / {_pct(s['acc0_sparse'])}",
            _num(kept, ".1f", "%"), _num(None if kept is None else 100.0 - kept, ".1f", "%"), mib,
            _num(s["rollout_total"], ".1f"), _num(s["train_total"], ".1f", " s"), _num(s["final_reward"], ".3f"),
            _num(s["vetoed_mean"], ".2f"), _num(s["skipped"], "d")]


def _markdown(header: list[str] | tuple, rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def paper_table(compare_dir: Path) -> str:
    """The paper-style table (markdown), one row per mode in compare.json's order."""
    return _markdown(TABLE_HEADER, [_row(s) for s in _load(compare_dir)[1]])


def _mismatch_table(runs: list[dict]) -> str:
    header = ["Mode"] + [f"{k} ({how})" for k, how in MISMATCH_KEYS]
    rows = [[s["mode"]] + [_num(s[k], ".4g") for k, _ in MISMATCH_KEYS] for s in runs if s.get("steps")]
    return _markdown(header, rows) if rows else "_No training steps were logged._"


def _length_table(runs: list[dict]) -> str:
    keys = {k for s in runs for k in s.get("veto_by_len", {})}
    ordered = sorted(keys, key=lambda k: int(k.split("_")[3]))  # veto_frac_len_<lo>_<hi>: sort by lo
    if not ordered:
        return "_No rejection-by-length metrics were logged._"
    header = ["Mode"] + ["len " + "–".join(k.split("_")[3:5]).replace("inf", "∞") for k in ordered]
    rows = [[s["mode"]] + [_num(s["veto_by_len"].get(k), ".3f") for k in ordered] for s in runs if s.get("steps")]
    return _markdown(header, rows)


# ---------------------------------------------------------------------------------- findings
def classify_trajectory(start: float, final: float) -> str:
    """collapsed / degraded / held / improved: final dense-inference accuracy against step 0."""
    if final < COLLAPSE_FRAC * start:
        return "collapsed"
    if 100 * (final - start) < -DEGRADE_POINTS:
        return "degraded"
    return "improved" if 100 * (final - start) > DEGRADE_POINTS else "held"


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def findings(runs: list[dict]) -> list[str]:
    """Plain sentences computed from the numbers; each states the values it rests on."""
    by = {s["mode"]: s for s in runs if s["status"] != "not run"}
    out = []
    dense = by.get("dense", {})
    for s in by.values():
        if s["mode"] != "dense" and s.get("acc_dense") is not None and dense.get("acc_dense"):
            kept = _kv_kept_pct(s)
            saved = "" if kept is None else f" with {100 - kept:.1f}% fewer KV tokens in its training rollouts"
            out.append(f"{s['mode']} reaches {100 * s['acc_dense'] / dense['acc_dense']:.1f}% of dense held-out "
                       f"accuracy (dense inference){saved} ({_pct(s['acc_dense'])} vs {_pct(dense['acc_dense'])}).")
    for s in by.values():
        if s.get("acc0_dense") is not None and s.get("acc_dense") is not None:
            out.append(f"{s['mode']} final accuracy vs its start (dense inference): "
                       f"**{classify_trajectory(s['acc0_dense'], s['acc_dense'])}** "
                       f"({_pct(s['acc0_dense'])} at step 0 → {_pct(s['acc_dense'])}).")
    rl = by.get("sparse-rl", {})
    if rl.get("acc_dense") is not None and dense.get("acc_dense"):
        ratio = 100 * rl["acc_dense"] / dense["acc_dense"]
        out.append(f"Target: Sparse-RL ≥ {TARGET_ACC_FRAC:.0f}% of dense accuracy — {_met(ratio >= TARGET_ACC_FRAC)} "
                   f"({ratio:.1f}%).")
    else:
        out.append("Target: Sparse-RL ≥ 97% of dense accuracy — cannot be evaluated (a run is missing).")
    if _kv_kept_pct(rl) is not None:
        saved = 100 - _kv_kept_pct(rl)
        out.append(f"Target: Sparse-RL with ≥ {TARGET_KV_SAVED:.0f}% fewer KV tokens — "
                   f"{_met(saved >= TARGET_KV_SAVED)} ({saved:.1f}% fewer).")
    else:
        out.append("Target: Sparse-RL with ≥ 50% fewer KV tokens — cannot be evaluated (no KV figures).")
    if rl.get("acc_sparse") is not None and dense.get("acc_sparse") is not None:
        a, b = rl["acc_sparse"], dense["acc_sparse"]
        out.append(f"The sparse-rl model under sparse inference scores {_pct(a)} vs the dense-trained model's "
                   f"{_pct(b)}. Target: Sparse-RL under sparse inference ≥ dense-trained under sparse "
                   f"inference — {_met(a >= b)}.")
    else:
        out.append("Target: Sparse-RL under sparse inference ≥ dense-trained — cannot be evaluated (a run is missing).")
    return out


# ---------------------------------------------------------------------------------- plots
def _colour(mode: str, i: int) -> str:
    return MODE_COLOURS.get(mode, f"C{i % 10}")


def _moving_average(y: list[float]) -> list[float]:
    w = max(2, len(y) // 10)  # light smoothing: a trailing window of ~10% of the run
    return [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]


def _save(fig, path: Path, axes) -> None:
    for ax in axes:
        if not ax.has_data():  # every run missing: say so instead of an empty frame
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_lines(runs, ax, key, style="-", suffix="", ma=False, log=False):
    for i, s in enumerate(runs):
        x, y = _series(s.get("steps", []), key)
        if log:
            y = [max(v, 1e-12) for v in y]  # log axis: keep exact-zero ratios visible at the floor
        if x:
            ax.plot(x, y, style, color=_colour(s["mode"], i), label=s["mode"] + suffix, lw=1.2)
            if ma:
                ax.plot(x, _moving_average(y), ":", color=_colour(s["mode"], i), alpha=0.5, lw=2)
    if log and ax.has_data():
        ax.set_yscale("log")


def _plots(out: Path, runs: list[dict]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot_lines(runs, ax, "reward_mean", ma=True)
    ax.set(title="Training reward (dotted: moving average)", xlabel="step", ylabel="reward_mean")
    _save(fig, out / "reward.png", [ax])
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(runs):
        for kind, style in (("dense", "-"), ("sparse", "--")):
            x, y = _series(s.get("evals", []), f"eval_accuracy_{kind}")
            if x:
                ax.plot(x, [100 * v for v in y], style, marker="o", ms=3, color=_colour(s["mode"], i),
                        label=f"{s['mode']} ({kind} inference)")
    ax.set(title="Held-out accuracy (solid: dense inference, dashed: sparse)", xlabel="step", ylabel="accuracy (%)")
    _save(fig, out / "accuracy.png", [ax])


    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _plot_lines(runs, axes[0, 0], "xi_q01", log=True, suffix=" xi_q01")
    _plot_lines(runs, axes[0, 0], "xi_min", ":", log=True, suffix=" xi_min")
    _plot_lines(runs, axes[0, 1], "kl_sampler_old")
    _plot_lines(runs, axes[1, 0], "veto_frac", suffix=" veto")
    _plot_lines(runs, axes[1, 0], "band_mask_frac", "--", suffix=" band")
    _plot_lines(runs, axes[1, 1], "ess")
    axes[0, 0].set(title="ξ 1% quantile (solid) and min (dotted)", ylabel="ξ = π_old / π_sparse")
    axes[0, 1].set(title="KL(π_sparse ‖ π_old) on sampled tokens", ylabel="kl_sampler_old")
    axes[1, 0].set(title="Veto (solid) and band-mask (dashed) fractions", ylabel="fraction")
    axes[1, 1].set(title="Effective sample size of the weights", ylabel="ess")
    for ax in axes.flat:
        ax.set_xlabel("step")
    fig.suptitle("Sampler / learner mismatch over training")
    _save(fig, out / "mismatch.png", axes.flat)

    have = [(i, s) for i, s in enumerate(runs) if s.get("kv_peak") is not None and s.get("kv_dense") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for j, (i, s) in enumerate(have):
        left.bar(j - 0.2, s["kv_peak"] / MIB, 0.4, color=_colour(s["mode"], i), label=f"{s['mode']} peak")
        left.bar(j + 0.2, s["kv_dense"] / MIB, 0.4, color="lightgrey", hatch="//", edgecolor="grey",
                 label="dense-equivalent" if j == 0 else None)
    kept = [(i, s) for i, s in enumerate(runs) if s.get("kv_kept") is not None]
    for j, (i, s) in enumerate(kept):
        right.bar(j, 100 * s["kv_kept"], color=_colour(s["mode"], i), label=s["mode"])
    left.set_xticks(range(len(have)), [s["mode"] for _, s in have], fontsize=8)
    right.set_xticks(range(len(kept)), [s["mode"] for _, s in kept], fontsize=8)
    left.set(title="Peak KV memory in training rollouts", xlabel="mode", ylabel="MiB")
    right.set(title="KV tokens kept (% of dense)", xlabel="mode", ylabel="% kept")
    _save(fig, out / "kv_memory.png", [left, right])

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _plot_lines(runs, left, "rollout_s")
    timed = [(i, s) for i, s in enumerate(runs) if s.get("train_total") is not None]
    for j, (i, s) in enumerate(timed):
        right.bar(j, s["train_total"], color=_colour(s["mode"], i), label=s["mode"])
    right.set_xticks(range(len(timed)), [s["mode"] for _, s in timed], fontsize=8)
    left.set(title="Rollout time per step", xlabel="step", ylabel="rollout_s (s)")
    right.set(title="Total training time", xlabel="mode", ylabel="seconds")
    _save(fig, out / "rollout_time.png", [left, right])


# ---------------------------------------------------------------------------------- report
def _setting(config: dict, key: str, default: Any = "?") -> Any:
    # compare.json holds the nested config; field names are unique across sections, so search leaves.
    if key in config and not isinstance(config[key], dict):
        return config[key]
    for value in config.values():
        if isinstance(value, dict):
            found = _setting(value, key, None)
            if found is not None:
                return found
    return default


def write_report(compare_dir: Path) -> Path:
    """Write the five plots and report.md into `compare_dir`; return report.md's path."""
    compare_dir = Path(compare_dir)
    meta, runs = _load(compare_dir)
    _plots(compare_dir, runs)
    c = meta.get("config") or {}
    g = lambda k: _setting(c, k)  # noqa: E731
    status = ", ".join(f"{s['mode']}" + ("" if s["status"] == "done" else f" ({s['status']})") for s in runs)
    lines = [
        "# Sparse-RL comparison report", "",
        f"Modes: {status}. Each trained for {g('steps')} steps with seed {g('seed')} on the same data "
        f"(task `{g('task')}`, difficulty {g('difficulty')}; {g('prompts_per_step')} prompts × {g('group_size')} "
        f"samples per step). Sparse rollouts use KV policy `{g('kv_policy')}` with budget {g('kv_budget')} tokens, "
        f"window {g('kv_window')}, compression every {g('kv_interval')} tokens."
        + (f" Started {meta['started']}." if meta.get("started") else ""), "",
        "## Results", "", _markdown(TABLE_HEADER, [_row(s) for s in runs]), "",
        "Held-out accuracies come from `final_eval.json` (incomplete runs: their latest in-training evaluation). "
        "KV columns describe the training rollouts: KV tokens kept is the mean over steps of `kv_kept_frac`, "
        "KV saved = 100 − kept, peak MiB are the largest over steps. Final train reward is the mean `reward_mean` "
        "over the last 10% of steps.", "",
        "## Mismatch metrics (over training)", "", _mismatch_table(runs), "",
        "## Sequence rejection by response length (mean veto_frac per bucket)", "", _length_table(runs), "",
        "## Plots", "",
        "![Training reward](reward.png)", "", "![Held-out accuracy](accuracy.png)", "",
        "![Mismatch metrics](mismatch.png)", "", "![KV memory](kv_memory.png)", "",
        "![Rollout time](rollout_time.png)", "",
        "## Findings", "",
        f"Thresholds: *collapsed* if final dense-inference accuracy < {COLLAPSE_FRAC:.0%} of its step-0 value; "
        f"*degraded* if more than {DEGRADE_POINTS:.0f} points below step 0; *improved* if more than "
        f"{DEGRADE_POINTS:.0f} points above; otherwise *held*. Paper targets: Sparse-RL ≥ {TARGET_ACC_FRAC:.0f}% of "
        f"dense accuracy with ≥ {TARGET_KV_SAVED:.0f}% fewer KV tokens, and Sparse-RL under sparse inference ≥ the "
        "dense-trained model under sparse inference.", "",
    ] + [f"- {sentence}" for sentence in findings(runs)]
    path = compare_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

