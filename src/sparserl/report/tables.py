"""The comparison report: the regime, the paper-style table over seeds, and report.md around them.

`write_report(dir)` reads `dir/compare.json` (modes, seeds, config) and, for each mode and seed,
`dir/<mode>/seed<S>/metrics.jsonl` and `final_eval.json`. It writes the plots (`plots.py`)
and `report.md` into `dir`, with the α tail per length bin (`alpha.py`) where runs logged
it, and the paired comparisons and verdicts over seeds (`verdicts.py`). `paper_table(dir)` returns the regime line
and the main table, for the command line to print.
A mode whose runs trained DistillSparse is labelled "<mode> + DistillSparse".

Every cell is the mean over seeds with the min–max range; a held-out accuracy carries the binomial standard error of
one seed's figure. A verdict is stated only where its interval over seeds excludes the alternative
(`statistics.verdict`). A mode with no run directory is reported as "not run"; one
without `final_eval.json` as "incomplete" (its numbers come from the metrics alone). An unreadable
or malformed `final_eval.json` makes its run incomplete too, and the problem is listed under the
table (report.md and the command line); a bad line in a `metrics.jsonl` stops the report with an error
naming the file and the line (`metrics_log.read_metrics`).

KV columns describe the *training rollouts* (what Sparse-RL's "KV storage saved" measures): a run's peak is the
largest `kv_peak_bytes` over its steps, and its KV saved is 1 − that peak / the peak of the dense run of the same
seed, which sampled the same prompts (`rollout.batch.kv_saved`); without a dense run it is not measured, and the
report says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from ..config.presets import mode_with_role
from ..errors import UserError
from ..rollout.batch import kv_saved
from ..train.layout import (
    COMPARE_FILE,
    CONFIG_FILE,
    FINAL_EVAL_FILE,
    METRICS_FILE,
    REPORT_FILE,
)
from ..train.metrics import read_metrics
from .common import DASH, DISTILL_SUFFIX, cell, markdown, series, setting, sparse_sampler
from .paired import standard_error

MIB = 1024 ** 2
TABLE_HEADER = ("Mode", "Held-out acc (dense inf.)", "Held-out acc (sparse inf.)", "Exact walks (dense inf.)",
                "Acc at step 0 (dense / sparse)", "KV saved (peak vs dense run)", "Peak KV MiB (run / dense run)",
                "Rows in flight",
                "Rollout s", "Step s (mean)", "Final train reward", "Rejected tokens / seq. (applied)", "Skipped steps")
MISMATCH_KEYS = (("xi_q01", "mean"), ("xi_min", "min"), ("kl_sampler_old", "mean"), ("flagged_veto_frac", "mean"),
                 ("flagged_band_frac", "mean"), ("ess", "mean"), ("response_len_mean", "mean"),
                 ("walk_exact", "mean"))
# The numbers the report takes from final_eval.json: summary key -> the paths where they are in the file (a field's
# later paths are the names files written by earlier versions use).
FINAL_EVAL_FIELDS = {"acc_dense": (("dense", "accuracy"),), "exact_dense": (("dense", "walk_exact"),),
                     "acc_sparse": (("sparse", "accuracy"),), "exact_sparse": (("sparse", "walk_exact"),),
                     "rollout_total": (("rollout_seconds",),)}


# ---------------------------------------------------------------------------------- loading
def _read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ValueError naming the file and what is wrong otherwise."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"{path}: cannot be read ({error.strerror or error})") from error
    except ValueError as error:
        raise UserError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise UserError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def read_final_eval(path: Path) -> dict[str, float | None]:
    """The numbers of `FINAL_EVAL_FIELDS` in a run's final_eval.json, None where absent; a ValueError
    naming the file and what is wrong when it cannot be read or a field is not a number."""
    data = _read_json_object(path)
    numbers = {}
    for key, paths in FINAL_EVAL_FIELDS.items():
        numbers[key] = next((value for value in (_field(data, where, path) for where in paths) if value is not None),
                            None)
    return numbers


def _field(data: dict, where: tuple[str, ...], path: Path) -> float | None:
    value = data
    for depth, name in enumerate(where):
        if value is None:
            return None
        if not isinstance(value, dict):
            raise UserError(f"{path}: {'.'.join(where[:depth])} is {value!r}, not a JSON object")
        value = value.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise UserError(f"{path}: {'.'.join(where)} is {value!r}, not a number")
    return value


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise_run(mode: str, run_dir: Path) -> dict[str, Any]:
    """Everything the tables, verdicts and plots need about one run; missing values are None."""
    if not run_dir.is_dir():
        return {"mode": mode, "status": "not run", "steps": [], "evals": []}
    records = read_metrics(run_dir / METRICS_FILE)
    final, problem = _final_eval(run_dir / FINAL_EVAL_FILE)
    steps = [r for r in records if r["step"] >= 1 and "reward_mean" in r]  # step 0 is eval-only
    evals = [r for r in records if "eval_accuracy_dense" in r]
    saved = run_dir / CONFIG_FILE
    s = {"mode": mode, "status": "done" if final else "incomplete", "problem": problem, "steps": steps,
         "evals": evals,
         "sparse_sampler": sparse_sampler(yaml.safe_load(saved.read_text()) or {}) if saved.is_file() else None}
    s.update(_accuracies(records, evals, final))
    s.update(_costs(steps, final))
    s.update(_training(steps))
    return s


def _accuracies(records: list[dict], evals: list[dict], final: dict) -> dict[str, float | None]:
    """Held-out accuracy and exact walks at the end (final_eval.json, else the latest in-training evaluation) and
    at step 0, under dense and sparse inference."""
    start = next((r for r in records if r["step"] == 0), {})
    last_eval = evals[-1] if evals and evals[-1]["step"] > 0 else {}
    found = {}
    for kind in ("dense", "sparse"):
        for key, logged in ((f"acc_{kind}", f"eval_accuracy_{kind}"), (f"exact_{kind}", f"eval_walk_exact_{kind}")):
            found[key] = final[key] if final.get(key) is not None else last_eval.get(logged)
        found[f"acc0_{kind}"] = start.get(f"eval_accuracy_{kind}")
    return found


def _costs(steps: list[dict], final: dict) -> dict[str, float | None]:
    """Peak KV (MiB; KV saved is filled in by `load`), rollout and step time, rows in flight."""
    peaks = series(steps, "kv_peak_bytes")[1]
    in_flight = series(steps, "rows_in_flight")[1]
    rollout_total = final.get("rollout_total")
    if rollout_total is None and steps:
        rollout_total = sum(series(steps, "rollout_s")[1])
    return {"kv_peak": max(peaks) / MIB if peaks else None,
            "kv_dense_peak": None, "kv_saved": None,  # against the dense run of the same seed, once `load` has it
            "rollout_total": rollout_total, "rows_in_flight": max(in_flight) if in_flight else None,
            "step_mean": _mean(series(steps, "step_s")[1])}


def _training(steps: list[dict]) -> dict[str, Any]:
    """Final reward, rejections, skipped steps, the first step's regime and the mismatch metrics over training."""
    rewards = series(steps, "reward_mean")[1]
    skipped = series(steps, "skipped_steps")[1]
    first = steps[0] if steps else {}
    found = {"final_reward": _mean(rewards[-max(1, math.ceil(len(rewards) / 10)):]),  # the last 10% of steps
             "rejected_tokens": _mean(series(steps, "rejected_token_frac")[1]),
             "rejected_seqs": _mean(series(steps, "rejected_seq_frac")[1]),
             "skipped": skipped[-1] if skipped else None,
             "attended": _mean(series(steps, "kv_attended_frac")[1]),
             "veto0": first.get("flagged_veto_frac"), "alpha_tail0": first.get("alpha_tail")}
    for key, how in MISMATCH_KEYS:
        values = series(steps, key)[1]
        found[key] = (min(values) if values else None) if how == "min" else _mean(values)
    buckets = {k for r in steps for k in r if k.startswith("flagged_veto_frac_len_")}
    found["veto_by_len"] = {k: _mean(series(steps, k)[1]) for k in buckets}
    return found


def _final_eval(path: Path) -> tuple[dict[str, float | None], str | None]:
    """(the run's final_eval numbers, None) when it has a readable one; ({}, None) when it has none
    yet; ({}, what is wrong) when it cannot be read: the run then counts as incomplete and the
    report states the problem, rather than the whole report failing over one run."""
    if not path.exists():
        return {}, None
    try:
        return read_final_eval(path), None
    except ValueError as error:
        # `sparserl compare` skips a run that has the file, so only deleting it redoes the evaluation.
        return {}, (f"{error}; the run is reported as incomplete (held-out accuracy from its last in-training "
                    "evaluation): delete the file and rerun `sparserl compare` to redo its final evaluation")


def label(mode: str, run_dirs: list[Path], config: dict) -> str:
    """The mode's name in the report: its preset, with `DISTILL_SUFFIX` when its runs trained the
    sampler adapter (from the first run's saved config.yaml, else the comparison's config)."""
    saved = next((d / CONFIG_FILE for d in run_dirs if (d / CONFIG_FILE).is_file()), None)
    run_config = (yaml.safe_load(saved.read_text()) or {}) if saved else config
    return mode + (DISTILL_SUFFIX if setting(run_config, "distill_sparse", False) else "")


def load(compare_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    """(compare.json, {label: [one summary per seed]}), labels as `label` gives them."""
    compare_dir = Path(compare_dir)
    manifest = compare_dir / COMPARE_FILE
    if not manifest.is_file():
        raise UserError(f"{compare_dir} holds no compare.json; pass the --out directory of a `sparserl compare` run")
    meta = _read_json_object(manifest)
    seeds = meta.get("seeds") or [0]
    runs = {}
    for mode in meta.get("modes", []):
        run_dirs = [compare_dir / mode / f"seed{seed}" for seed in seeds]
        runs[label(mode, run_dirs, meta.get("config") or {})] = [summarise_run(mode, d) for d in run_dirs]
    baseline = runs.get(mode_with_role("baseline"))
    for mode, per_seed in runs.items():
        if baseline is None or mode == mode_with_role("baseline"):
            continue
        for run, dense in zip(per_seed, baseline):  # the same seed: the same prompts at every step
            run["kv_dense_peak"] = dense.get("kv_peak")
            run["kv_saved"] = None if run.get("kv_peak") is None else kv_saved(run["kv_peak"], run["kv_dense_peak"])
    return meta, runs


# ---------------------------------------------------------------------------------- cells
def _row(mode: str, seeds: list[dict], prompts: int | None) -> list[str]:
    done = [s for s in seeds if s["status"] != "not run"]
    if not done:
        return [f"{mode} (not run)"] + [DASH] * (len(TABLE_HEADER) - 1)
    col = lambda key: [s.get(key) for s in done]  # noqa: E731
    incomplete = sum(s["status"] == "incomplete" for s in done)
    label = mode + (f" ({incomplete} incomplete)" if incomplete else "") + \
        (f" ({len(done)} of {len(seeds)} seeds)" if len(done) < len(seeds) else "")
    peak = DASH if all(v is None for v in col("kv_peak")) else \
        f"{cell(col('kv_peak'), '.2f')} / {cell(col('kv_dense_peak'), '.2f')}"
    rejects = any(v for v in col("rejected_tokens"))
    return [label, _accuracy_cell(col("acc_dense"), prompts), _accuracy_cell(col("acc_sparse"), prompts),
            cell(col("exact_dense")), f"{cell(col('acc0_dense'))} / {cell(col('acc0_sparse'))}",
            cell(col("kv_saved")), peak,
            cell(col("rows_in_flight"), "int"), cell(col("rollout_total"), ".1f"), cell(col("step_mean"), ".2f"),
            cell(col("final_reward"), ".3f"),
            f"{cell(col('rejected_tokens'))} / {cell(col('rejected_seqs'))}" if rejects else DASH,
            cell(col("skipped"), "int")]


def _accuracy_cell(values: list[float | None], prompts: int | None) -> str:
    """`cell` with the binomial standard error (points) of one seed's figure at the mean accuracy."""
    known = [v for v in values if v is not None]
    return cell(values) + (standard_error(sum(known) / len(known), prompts) if known else "")


def regime(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """What sets the sparse regime of the comparison apart, over the sparse runs: at step 0 (the start
    model) the dense − sparse greedy-accuracy gap, the veto rate and the α tail; over training the
    KV saved against the dense run (peak bytes, same seeds) and the attended share (README, "Regimes")."""
    sparse = [s for mode, seeds in runs.items() if mode != mode_with_role("baseline")
              for s in seeds if s["status"] != "not run"]
    gaps = [s["acc0_dense"] - s["acc0_sparse"] for s in sparse
            if s.get("acc0_dense") is not None and s.get("acc0_sparse") is not None]
    return {"gap0": gaps, "veto0": [s["veto0"] for s in sparse if s.get("veto0") is not None],
            "alpha_tail0": [s["alpha_tail0"] for s in sparse if s.get("alpha_tail0") is not None],
            # Each run's largest cache against its dense run's, as the table's MiB columns (a per-step ratio is
            # inflated by steps whose responses all ended early).
            "kv_saved": [s["kv_saved"] for s in sparse if s.get("kv_saved") is not None],
            "attended": [s["attended"] for s in sparse if s.get("attended") is not None]}


def regime_line(runs: dict[str, list[dict]], config: dict) -> str:
    r = regime(runs)
    schedule = setting(config, "kv_schedule", None)
    budget = f"schedule {schedule}" if schedule else setting(config, "kv_budget")
    if setting(config, "sparsity", "eviction") == "block":
        # Block-sparse attention keeps the whole cache: what it saves is attention reads.
        sparsity = (f"block-sparse attention, {budget} attended tokens per sparse layer (pages of "
                    f"{setting(config, 'block_page_size')}, the first {setting(config, 'block_dense_layers')} "
                    f"layer(s) dense); attended share of the cached keys (sparse layers, mean over decode steps) "
                    f"{cell(r['attended'])}")
    elif setting(config, "sparsity", "eviction") == "none":
        sparsity = f"full cache (nothing evicted), stored as {setting(config, 'kv_dtype', 'auto')}"
    else:
        sparsity = (f"KV budget {budget} ({setting(config, 'kv_policy')}, window {setting(config, 'kv_window')}, "
                    f"interval {setting(config, 'kv_interval')})")
        if setting(config, "kv_dtype", "auto") != "auto":
            sparsity += f", stored as {setting(config, 'kv_dtype')}"
    others = _other_samplers(runs, sparse_sampler(config))
    if others:
        sparsity += f" ({others})"
    return (f"Regime: {sparsity}; step-0 greedy accuracy "
            f"gap dense − sparse {cell(r['gap0'], 'pts')}; step-0 veto rate (Sparse-RL filter) {cell(r['veto0'])}; "
            f"KV saved (peak bytes against the dense run of each seed, same prompts) "
            f"{cell(r['kv_saved']) if r['kv_saved'] else 'not measured (no dense run in this comparison)'}; "
            f"step-0 α tail (5th percentile, worst length bin) "
            + (cell(r["alpha_tail0"], ".3f") if r["alpha_tail0"] else "not logged by these runs") + ".")


def _other_samplers(runs: dict[str, list[dict]], shared: str) -> str:
    """The sparse modes whose sampler is not the comparison's (a preset's own, as nemo-fp8's full fp8 cache)."""
    baseline = mode_with_role("baseline")
    own = {mode: s["sparse_sampler"] for mode, seeds in runs.items() if mode != baseline for s in seeds
           if s.get("sparse_sampler") not in (None, shared)}
    return "; ".join(f"{mode}: {sampler}" for mode, sampler in own.items())


def paper_table(compare_dir: Path) -> str:
    """The regime line and the paper-style table (markdown), one row per mode, then the problems met
    reading the runs, if any (so the command line shows them as well as report.md)."""
    meta, runs = load(compare_dir)
    seeds = meta.get("seeds") or [0]
    prompts = setting(meta.get("config") or {}, "eval_examples", None)
    table = markdown(TABLE_HEADER, [_row(mode, s, prompts) for mode, s in runs.items()])
    problems = [f"- {mode}, seed {seed}: {s['problem']}" for mode, per_seed in runs.items()
                for seed, s in zip(seeds, per_seed) if s.get("problem")]
    return f"{regime_line(runs, meta.get('config') or {})}\nSeeds: {', '.join(map(str, seeds))} " \
           f"(cells: mean (min–max); ± the binomial SE of one seed's held-out accuracy, points).\n\n{table}" + \
           ("\n\nProblems reading the runs:\n\n" + "\n".join(problems) if problems else "")


# ---------------------------------------------------------------------------------- report
def _mismatch_table(runs: dict[str, list[dict]]) -> str:
    header = ["Mode"] + [f"{k} ({how})" for k, how in MISMATCH_KEYS]
    rows = [[mode] + [cell([s.get(k) for s in seeds], ".4g") for k, _ in MISMATCH_KEYS]
            for mode, seeds in runs.items() if any(s["steps"] for s in seeds)]
    return markdown(header, rows) if rows else "_No training steps were logged._"


def _length_bucket(key: str) -> str:
    """`flagged_veto_frac_len_<lo>_<hi>` (lo <= length < hi) as the inclusive range the α table uses too."""
    lo, hi = key.split("_")[-2:]
    return f"len ≥ {lo}" if hi == "inf" else f"len {lo}–{int(hi) - 1}"


def _length_table(runs: dict[str, list[dict]]) -> str:
    keys = {k for seeds in runs.values() for s in seeds for k in s.get("veto_by_len", {})}
    ordered = sorted(keys, key=lambda k: int(k.split("_")[-2]))
    if not ordered:
        return "_No rejection-by-length metrics were logged._"
    header = ["Mode"] + [_length_bucket(k) for k in ordered]
    rows = [[mode] + [cell([s.get("veto_by_len", {}).get(k) for s in seeds], ".3f") for k in ordered]
            for mode, seeds in runs.items() if any(s["steps"] for s in seeds)]
    return markdown(header, rows)


def write_report(compare_dir: Path) -> Path:
    """Write the plots and report.md into `compare_dir`; return report.md's path."""
    from .alpha import alpha_section, alpha_tau
    from .plots import write_plots
    from .verdicts import paired_section, verdict_section

    compare_dir = Path(compare_dir)
    meta, runs = load(compare_dir)
    c = meta.get("config") or {}
    plots = write_plots(compare_dir, runs, alpha_tau(c))
    g = lambda k: setting(c, k)  # noqa: E731
    seeds = meta.get("seeds") or [0]
    lines = [
        "# Sparse-RL comparison report", "",
        f"Modes: {', '.join(runs)}; seeds {', '.join(map(str, seeds))}. Each run trained {g('steps')} steps on "
        f"task `{g('task')}` (difficulty {g('difficulty')}; {g('prompts_per_step')} prompts × {g('group_size')} "
        f"samples per step), held-out set of {g('eval_examples')} prompts."
        + (f" Started {meta['started']}." if meta.get("started") else ""), "",
        paper_table(compare_dir), "",
        "Cells are the mean over seeds with the (min–max) range. Held-out accuracies come from `final_eval.json` "
        "(incomplete runs: their latest in-training evaluation); exact walks are responses equal to the "
        "demonstration. Peak KV MiB is a run's largest `kv_peak_bytes` over its training steps; KV saved is 1 − that "
        "peak / the dense run's of the same seed (the same prompts at every step). Final train reward is the mean "
        "`reward_mean` over the last 10% of steps. ± after a held-out accuracy: the binomial standard error, in "
        "points, of one seed's figure at that accuracy on the held-out prompts.", "",
        *paired_section(runs, c),
        "## Mismatch metrics (over training)", "",
        "`flagged_*` fractions are what Sparse-RL's default filters flag, in every mode, whatever it applies.", "",
        _mismatch_table(runs), "",
        "## Sequences flagged by the veto, by response length", "",
        "Each cell: the fraction of the sequences whose response length (in tokens) is in that bucket that the "
        "veto flags, mean over steps; the buckets are the quarters of the response bound. A bucket no sequence "
        "reached in a step is left out of that step's mean.", "",
        _length_table(runs), "",
        *alpha_section(runs, c),
        "## Plots", "", *[f"![{name}]({name})\n" for name in plots],
        *verdict_section(runs, seeds, c),
    ]
    path = compare_dir / REPORT_FILE
    path.write_text("\n".join(lines) + "\n")
    return path
