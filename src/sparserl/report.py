"""The comparison report: the regime, the paper-style table over seeds, and computed verdicts.

`write_report(dir)` reads `dir/compare.json` (modes, seeds, config) and, for each mode and seed,
`dir/<mode>/seed<S>/metrics.jsonl` and `final_eval.json`. It writes the plots (`report_plots.py`)
and `report.md` into `dir`, with the α tail per length bin (`report_alpha.py`) where runs logged
it. `paper_table(dir)` returns the regime line and the main table, for the command line to print.
A mode whose runs trained DistillSparse is labelled "<mode> + DistillSparse".

Every cell is the mean over seeds with the min–max range. A verdict (improved, held, degraded,
collapsed; a paper claim met or not met) is stated only when every seed agrees; otherwise it is
`mixed`, with the per-seed values. A mode with no run directory is reported as "not run"; one
without a readable `final_eval.json` as "incomplete" (its numbers come from the metrics alone).

KV columns describe the *training rollouts* (what Sparse-RL's "KV storage saved" measures): the
mean of `kv_kept_frac` and the largest `kv_peak_bytes` / `kv_dense_bytes` over the steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

MIB = 1024 ** 2
# Thresholds of the verdicts, stated in the report too.
COLLAPSE_FRAC = 0.5     # collapsed: final dense-inference accuracy < 50% of its step-0 value
DEGRADE_POINTS = 5.0    # degraded / improved: more than 5 accuracy points below / above step 0
TARGET_ACC_FRAC = 97.0  # paper: Sparse-RL keeps ~97% of dense accuracy ...
MIN_EVAL_EXAMPLES = 100  # below this many held-out examples (or MIN_STEPS steps) verdicts carry a caveat
MIN_STEPS = 20
TABLE_HEADER = ("Mode", "Held-out acc (dense inf.)", "Held-out acc (sparse inf.)", "Exact walks (dense inf.)",
                "Acc at step 0 (dense / sparse)", "KV saved", "Peak KV MiB (sparse / dense)", "Rollout s",
                "Final train reward", "Rejected tokens / seq. (applied)", "Skipped steps")
MISMATCH_KEYS = (("xi_q01", "mean"), ("xi_min", "min"), ("kl_sampler_old", "mean"), ("flagged_veto_frac", "mean"),
                 ("flagged_band_frac", "mean"), ("ess", "mean"), ("response_len_mean", "mean"),
                 ("walk_exact", "mean"))
DASH = "—"
# A DistillSparse run's mode label: the preset alone would not tell it from the same mode without.
DISTILL_SUFFIX = " + DistillSparse"


# ---------------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_records(path: Path) -> list[dict]:
    """The step records of a metrics file, sorted; a torn last line (a killed run) is skipped."""
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


def series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise_run(mode: str, run_dir: Path) -> dict[str, Any]:
    """Everything the tables, verdicts and plots need about one run; missing values are None."""
    if not run_dir.is_dir():
        return {"mode": mode, "status": "not run", "steps": [], "evals": []}
    records = read_records(run_dir / "metrics.jsonl")
    final = _read_json(run_dir / "final_eval.json") or {}
    steps = [r for r in records if r["step"] >= 1 and "reward_mean" in r]  # step 0 is eval-only
    evals = [r for r in records if "eval_accuracy_dense" in r]
    start = next((r for r in records if r["step"] == 0), {})
    s = {"mode": mode, "status": "done" if final else "incomplete", "steps": steps, "evals": evals}
    last_eval = evals[-1] if evals and evals[-1]["step"] > 0 else {}
    for kind in ("dense", "sparse"):
        fin = final.get(kind) or {}
        s[f"acc_{kind}"] = fin.get("accuracy", last_eval.get(f"eval_accuracy_{kind}"))
        s[f"exact_{kind}"] = fin.get("walk_exact", last_eval.get(f"eval_walk_exact_{kind}"))
        s[f"acc0_{kind}"] = start.get(f"eval_accuracy_{kind}")
    kept = _mean(series(steps, "kv_kept_frac")[1])
    kv_eval = (final.get("sparse") or {}).get("kv") or {}
    s["kv_saved"] = None if kept is None and not kv_eval else 1.0 - (kept if kept is not None else kv_eval["kept_token_frac"])
    peaks, denses = series(steps, "kv_peak_bytes")[1], series(steps, "kv_dense_bytes")[1]
    s["kv_peak"] = max(peaks) / MIB if peaks else None
    s["kv_dense"] = max(denses) / MIB if denses else None
    s["rollout_total"] = final.get("rollout_seconds", sum(series(steps, "rollout_s")[1]) if steps else None)
    rewards = series(steps, "reward_mean")[1]
    s["final_reward"] = _mean(rewards[-max(1, math.ceil(len(rewards) / 10)):])  # the last 10% of steps
    s["rejected_tokens"] = _mean(series(steps, "rejected_token_frac")[1])
    s["rejected_seqs"] = _mean(series(steps, "rejected_seq_frac")[1])
    skipped = series(steps, "skipped_steps")[1]
    s["skipped"] = skipped[-1] if skipped else None
    s["attended"] = _mean(series(steps, "kv_attended_frac")[1])
    s["veto0"] = steps[0].get("flagged_veto_frac") if steps else None
    s["alpha_tail0"] = steps[0].get("alpha_tail") if steps else None
    for key, how in MISMATCH_KEYS:
        values = series(steps, key)[1]
        s[key] = (min(values) if values else None) if how == "min" else _mean(values)
    buckets = {k for r in steps for k in r if k.startswith("flagged_veto_frac_len_")}
    s["veto_by_len"] = {k: _mean(series(steps, k)[1]) for k in buckets}
    return s


def label(mode: str, run_dirs: list[Path], config: dict) -> str:
    """The mode's name in the report: its preset, with `DISTILL_SUFFIX` when its runs trained the
    sampler adapter (from the first run's saved config.yaml, else the comparison's config)."""
    saved = next((d / "config.yaml" for d in run_dirs if (d / "config.yaml").is_file()), None)
    run_config = (yaml.safe_load(saved.read_text()) or {}) if saved else config
    return mode + (DISTILL_SUFFIX if _setting(run_config, "distill_sparse", False) else "")


def load(compare_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    """(compare.json, {label: [one summary per seed]}), labels as `label` gives them."""
    compare_dir = Path(compare_dir)
    meta = _read_json(compare_dir / "compare.json") or {}
    seeds = meta.get("seeds") or [0]
    runs = {}
    for mode in meta.get("modes", []):
        run_dirs = [compare_dir / mode / f"seed{seed}" for seed in seeds]
        runs[label(mode, run_dirs, meta.get("config") or {})] = [summarise_run(mode, d) for d in run_dirs]
    return meta, runs


# ---------------------------------------------------------------------------------- cells
def _fmt(x: float, kind: str) -> str:
    if kind == "pct":
        return f"{100 * x:.1f}"
    if kind == "pts":
        return f"{100 * x:+.1f}"
    if kind == "int":
        return f"{x:.0f}"
    return f"{x:{kind}}"


def cell(values: list[float | None], kind: str = "pct") -> str:
    """Mean over seeds with (min–max) when there are several; "%" appended for percentages."""
    known = [v for v in values if v is not None]
    if not known:
        return DASH
    unit = {"pct": "%", "pts": " pts"}.get(kind, "")
    mean = _fmt(sum(known) / len(known), kind) + unit
    if len(known) == 1:
        return mean
    return f"{mean} ({_fmt(min(known), kind)}–{_fmt(max(known), kind)})"


def _row(mode: str, seeds: list[dict]) -> list[str]:
    done = [s for s in seeds if s["status"] != "not run"]
    if not done:
        return [f"{mode} (not run)"] + [DASH] * (len(TABLE_HEADER) - 1)
    col = lambda key: [s.get(key) for s in done]  # noqa: E731
    incomplete = sum(s["status"] == "incomplete" for s in done)
    label = mode + (f" ({incomplete} incomplete)" if incomplete else "") + \
        (f" ({len(done)} of {len(seeds)} seeds)" if len(done) < len(seeds) else "")
    peak = DASH if all(v is None for v in col("kv_peak")) else f"{cell(col('kv_peak'), '.2f')} / {cell(col('kv_dense'), '.2f')}"
    rejects = any(v for v in col("rejected_tokens"))
    return [label, cell(col("acc_dense")), cell(col("acc_sparse")), cell(col("exact_dense")),
            f"{cell(col('acc0_dense'))} / {cell(col('acc0_sparse'))}", cell(col("kv_saved")), peak,
            cell(col("rollout_total"), ".1f"), cell(col("final_reward"), ".3f"),
            f"{cell(col('rejected_tokens'))} / {cell(col('rejected_seqs'))}" if rejects else DASH,
            cell(col("skipped"), "int")]


def _markdown(header, rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def regime(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """The regime descriptors of SPEC §6, from the sparse runs' step 0 (the start model)."""
    sparse = [s for mode, seeds in runs.items() if mode != "dense" for s in seeds if s["status"] != "not run"]
    gaps = [s["acc0_dense"] - s["acc0_sparse"] for s in sparse
            if s.get("acc0_dense") is not None and s.get("acc0_sparse") is not None]
    return {"gap0": gaps, "veto0": [s["veto0"] for s in sparse if s.get("veto0") is not None],
            "alpha_tail0": [s["alpha_tail0"] for s in sparse if s.get("alpha_tail0") is not None],
            # The run's largest cache against its longest dense one, as the table's MiB columns (a
            # per-step ratio is inflated by steps whose responses all ended early).
            "kv_peak_frac": [s["kv_peak"] / s["kv_dense"] for s in sparse if s.get("kv_peak") and s.get("kv_dense")],
            "kv_saved": [s["kv_saved"] for s in sparse if s.get("kv_saved") is not None],
            "attended": [s["attended"] for s in sparse if s.get("attended") is not None]}


def regime_line(runs: dict[str, list[dict]], config: dict) -> str:
    r = regime(runs)
    schedule = _setting(config, "kv_schedule", None)
    budget = f"schedule {schedule}" if schedule else _setting(config, "kv_budget")
    if _setting(config, "sparsity", "eviction") == "block":
        # Block-sparse attention keeps the whole cache: what it saves is attention reads.
        sparsity = (f"block-sparse attention, {budget} attended tokens per sparse layer (pages of "
                    f"{_setting(config, 'block_page_size')}, the first {_setting(config, 'block_dense_layers')} "
                    f"layer(s) dense); attended share of the cached keys (sparse layers, mean over decode steps) "
                    f"{cell(r['attended'])}")
    else:
        sparsity = (f"KV budget {budget} ({_setting(config, 'kv_policy')}, window {_setting(config, 'kv_window')}, "
                    f"interval {_setting(config, 'kv_interval')})")
    return (f"Regime: {sparsity}; step-0 greedy accuracy "
            f"gap dense − sparse {cell(r['gap0'], 'pts')}; step-0 veto rate (Sparse-RL filter) {cell(r['veto0'])}; "
            f"peak KV bytes {cell(r['kv_peak_frac'])} of dense; KV tokens saved (mean over rollouts) "
            f"{cell(r['kv_saved'])}; step-0 α tail (5th percentile, worst length bin) "
            + (cell(r["alpha_tail0"], ".3f") if r["alpha_tail0"] else "not logged by these runs") + ".")


def paper_table(compare_dir: Path) -> str:
    """The regime line and the paper-style table (markdown), one row per mode."""
    meta, runs = load(compare_dir)
    seeds = meta.get("seeds") or [0]
    table = _markdown(TABLE_HEADER, [_row(mode, s) for mode, s in runs.items()])
    return f"{regime_line(runs, meta.get('config') or {})}\nSeeds: {', '.join(map(str, seeds))} " \
           f"(cells: mean (min–max)).\n\n{table}"


# ---------------------------------------------------------------------------------- verdicts
def classify_trajectory(start: float, final: float) -> str:
    """collapsed / degraded / held / improved: final dense-inference accuracy against step 0."""
    if final < COLLAPSE_FRAC * start:
        return "collapsed"
    if 100 * (final - start) < -DEGRADE_POINTS:
        return "degraded"
    return "improved" if 100 * (final - start) > DEGRADE_POINTS else "held"


def agree(labels: list[str], details: list[str]) -> str:
    """The verdict when every seed gives the same one, else `mixed` with the per-seed values."""
    if labels and all(label == labels[0] for label in labels):
        return f"**{labels[0]}** ({'; '.join(details)})"
    return "**mixed** (" + "; ".join(f"seed {i}: {label}, {d}" for i, (label, d) in enumerate(zip(labels, details))) + ")"


def findings(runs: dict[str, list[dict]], seeds: list[int]) -> list[str]:
    """Plain sentences computed from the numbers; each states the values it rests on."""
    out = []
    for mode, per_seed in runs.items():
        pairs = [(s["acc0_dense"], s["acc_dense"]) for s in per_seed
                 if s.get("acc0_dense") is not None and s.get("acc_dense") is not None]
        if pairs and len(pairs) == len(per_seed):
            out.append(f"{mode}, final vs step-0 accuracy (dense inference): " + agree(
                [classify_trajectory(a, b) for a, b in pairs], [f"{100 * a:.1f}% → {100 * b:.1f}%" for a, b in pairs]))
    dense, rl = runs.get("dense", []), runs.get("sparse-rl", [])
    both = [(d, r) for d, r in zip(dense, rl) if d.get("acc_dense") and r.get("acc_dense") is not None]
    if both and len(both) == len(seeds):
        ratios = [100 * r["acc_dense"] / d["acc_dense"] for d, r in both]
        out.append(f"Paper claim: Sparse-RL keeps ≥ {TARGET_ACC_FRAC:.0f}% of dense accuracy — " + agree(
            ["met" if x >= TARGET_ACC_FRAC else "not met" for x in ratios], [f"{x:.1f}%" for x in ratios]))
        sparse_pairs = [(r["acc_sparse"], d["acc_sparse"]) for d, r in both
                        if r.get("acc_sparse") is not None and d.get("acc_sparse") is not None]
        if len(sparse_pairs) == len(both):
            out.append("Paper claim: the Sparse-RL model loses less under sparse inference than the dense-trained "
                       "one (sparse-inference accuracy ≥ dense-trained's) — " + agree(
                           ["met" if a >= b else "not met" for a, b in sparse_pairs],
                           [f"{100 * a:.1f}% vs {100 * b:.1f}%" for a, b in sparse_pairs]))
    else:
        out.append("Paper claims: cannot be evaluated (a dense or sparse-rl run is missing for some seed).")
    naive = runs.get("naive-sparse", [])
    pairs = [(s["acc0_dense"], s["acc_dense"]) for s in naive if s.get("acc_dense") is not None]
    if pairs and len(pairs) == len(seeds):
        out.append("Paper claim: naive sparse training collapses — " + agree(
            ["met" if classify_trajectory(a, b) == "collapsed" else "not met" for a, b in pairs],
            [f"{100 * a:.1f}% → {100 * b:.1f}%" for a, b in pairs]))
    return out


def caveat(runs: dict[str, list[dict]], config: dict) -> str | None:
    examples = _setting(config, "eval_examples", None)
    steps = _setting(config, "steps", None)
    small = []
    if isinstance(examples, int) and examples < MIN_EVAL_EXAMPLES:
        small.append(f"{examples} held-out examples (< {MIN_EVAL_EXAMPLES})")
    if isinstance(steps, int) and steps < MIN_STEPS:
        small.append(f"{steps} steps (< {MIN_STEPS})")
    seeds = len(next(iter(runs.values()), []))
    if seeds < 3:
        small.append(f"{seeds} seed(s) (< 3)")
    return ("Caveat: verdicts rest on " + ", ".join(small) + "; treat them as indications.") if small else None


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


def _mismatch_table(runs: dict[str, list[dict]]) -> str:
    header = ["Mode"] + [f"{k} ({how})" for k, how in MISMATCH_KEYS]
    rows = [[mode] + [cell([s.get(k) for s in seeds], ".4g") for k, _ in MISMATCH_KEYS]
            for mode, seeds in runs.items() if any(s["steps"] for s in seeds)]
    return _markdown(header, rows) if rows else "_No training steps were logged._"


def _length_table(runs: dict[str, list[dict]]) -> str:
    keys = {k for seeds in runs.values() for s in seeds for k in s.get("veto_by_len", {})}
    ordered = sorted(keys, key=lambda k: int(k.split("_")[4]))  # flagged_veto_frac_len_<lo>_<hi>
    if not ordered:
        return "_No rejection-by-length metrics were logged._"
    header = ["Mode"] + ["len " + "–".join(k.split("_")[4:6]).replace("inf", "∞") for k in ordered]
    rows = [[mode] + [cell([s.get("veto_by_len", {}).get(k) for s in seeds], ".3f") for k in ordered]
            for mode, seeds in runs.items() if any(s["steps"] for s in seeds)]
    return _markdown(header, rows)


def write_report(compare_dir: Path) -> Path:
    """Write the plots and report.md into `compare_dir`; return report.md's path."""
    from .report_alpha import alpha_section, alpha_tau
    from .report_plots import write_plots

    compare_dir = Path(compare_dir)
    meta, runs = load(compare_dir)
    c = meta.get("config") or {}
    plots = write_plots(compare_dir, runs, alpha_tau(c))
    g = lambda k: _setting(c, k)  # noqa: E731
    seeds = meta.get("seeds") or [0]
    note = caveat(runs, c)
    lines = [
        "# Sparse-RL comparison report", "",
        f"Modes: {', '.join(runs)}; seeds {', '.join(map(str, seeds))}. Each run trained {g('steps')} steps on "
        f"task `{g('task')}` (difficulty {g('difficulty')}; {g('prompts_per_step')} prompts × {g('group_size')} "
        f"samples per step), held-out set of {g('eval_examples')} prompts."
        + (f" Started {meta['started']}." if meta.get("started") else ""), "",
        paper_table(compare_dir), "",
        "Cells are the mean over seeds with the (min–max) range. Held-out accuracies come from `final_eval.json` "
        "(incomplete runs: their latest in-training evaluation); exact walks are responses equal to the "
        "demonstration. KV saved is 1 − mean `kv_kept_frac` of the training rollouts; peak MiB is the largest "
        "over steps. Final train reward is the mean `reward_mean` over the last 10% of steps.", "",
        "## Mismatch metrics (over training)", "",
        "`flagged_*` fractions are what Sparse-RL's default filters flag, in every mode, whatever it applies.", "",
        _mismatch_table(runs), "",
        "## Sequences flagged by the veto, by response length", "", _length_table(runs), "",
        *alpha_section(runs, c),
        "## Plots", "", *[f"![{name}]({name})\n" for name in plots],
        "## Verdicts", "",
        f"Thresholds: *collapsed* if final dense-inference accuracy < {COLLAPSE_FRAC:.0%} of its step-0 value; "
        f"*degraded* if more than {DEGRADE_POINTS:.0f} points below step 0; *improved* if more than "
        f"{DEGRADE_POINTS:.0f} points above; otherwise *held*. A verdict is given only when every seed agrees.", "",
    ] + ([note, ""] if note else []) + [f"- {sentence}" for sentence in findings(runs, seeds)]
    path = compare_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
