"""`sparserl compare`: the paper's experiment, one training run per mode, then a report.

For each seed, every mode trains from the same weights with that seed (same prompts, same held-out
set) and the same KV budget into `DIR/<mode>/seed<S>/`, then is evaluated on the held-out set under
dense and under sparse inference (`final_eval.json`). A run with a `final_eval.json` is done and
skipped; a run with a checkpoint resumes from it, so an interrupted comparison picks up where it
stopped, and a comparison rerun with more seeds or modes only runs what is new.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from ..config.presets import PRESET_ROLLOUT_FIELDS, PresetError, preset_name
from ..config.schema import MODES, ExperimentConfig
from ..errors import ConfigError
from ..train.checkpoint import latest_checkpoint
from ..train.evaluation import evaluate_policy
from ..train.layout import COMPARE_FILE, FINAL_EVAL_FILE, METRICS_FILE
from ..train.metrics import read_metrics
from ..train.run_dir import (
    RUN_FREE_FIELDS,
    config_differences,
    holds_a_run,
    make_output_dir,
)
from ..train.trainer import GRPOTrainer

log = logging.getLogger(__name__)


def run_config(config_for_mode: Callable[[str], ExperimentConfig], mode: str, seed: int,
               run_dir: Path) -> ExperimentConfig:
    config = config_for_mode(mode)
    return dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, seed=seed),
        output=dataclasses.replace(config.output, out=str(run_dir), eval_sparse_inference=True),
    )


def run_compare(config_for_mode: Callable[[str], ExperimentConfig], modes: list[str], seeds: list[int]) -> Path:
    """`config_for_mode(mode)` is the experiment's config with that mode's preset resolved (the CLI
    reloads the config file and flags with `--mode` set, so explicit correction fields still win)."""
    if not modes:
        raise ConfigError(f"--modes: none given; choose from {', '.join(MODES)} or preset YAML files")
    try:
        names = {mode: preset_name(mode) for mode in modes}
    except PresetError as error:
        raise ConfigError(f"--modes: {error}") from None
    clashes = {name for name in names.values() if list(names.values()).count(name) > 1}
    if clashes:
        raise ConfigError(f"--modes: {', '.join(m for m in modes if names[m] in clashes)} share the run name "
                          f"{' and '.join(sorted(clashes))} (a preset's `name`, else its file's stem), so their runs "
                          "would share one directory; rename one")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds: give distinct integer seeds, e.g. 0,1,2 (got {seeds})")
    base = config_for_mode(modes[0])
    out, created = make_output_dir(base.output.out)
    try:
        return _run_jobs(base, config_for_mode, out, names, seeds)
    except BaseException:
        # A comparison that failed before any run logged a step leaves nothing behind.
        if created and not any(holds_a_run(run) for run in out.glob("*/seed*")):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run_jobs(config: ExperimentConfig, config_for_mode: Callable[[str], ExperimentConfig], out: Path,
              names: dict[str, str], seeds: list[int]) -> Path:
    manifest = out / COMPARE_FILE
    record = json.loads(manifest.read_text()) if manifest.exists() else {
        "modes": [], "seeds": [], "config": config.to_dict(),
        "started": datetime.datetime.now().isoformat(timespec="seconds")}
    # Runs of one comparison must share their settings; only what RUN_FREE_FIELDS names may change,
    # and what each mode's preset sets: its corrections and its sampler's kind (each run directory checks its own).
    per_mode = {"mode", "seed", "eval_sparse_inference", *config.to_dict()["correction"], *PRESET_ROLLOUT_FIELDS}
    changed = {k: v for k, v in config_differences(record["config"], config.to_dict()).items()
               if k not in RUN_FREE_FIELDS | per_mode}
    if changed:
        listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ConfigError(f"--out {out} holds a comparison run with other settings ({listing}); use the same "
                          "settings to extend it, or another --out")
    record["config"] = config.to_dict()
    # A comparison extended later with more modes (e.g. the ablations) or seeds reports all of them.
    record["modes"] = record["modes"] + [name for name in names.values() if name not in record["modes"]]
    record["seeds"] = record.get("seeds", []) + [s for s in seeds if s not in record.get("seeds", [])]
    manifest.write_text(json.dumps(record, indent=2, default=list))
    jobs = [(seed, mode) for seed in seeds for mode in names]
    _extend_to(config.train.steps, [out / names[mode] / f"seed{seed}" for seed, mode in jobs])
    for index, (seed, mode) in enumerate(jobs, start=1):
        run_dir = out / names[mode] / f"seed{seed}"
        if (run_dir / FINAL_EVAL_FILE).exists():
            log.info("[%d/%d] %s seed %d: already done, skipping", index, len(jobs), mode, seed)
            continue
        resume = latest_checkpoint(run_dir) is not None
        log.info("[%d/%d] %s seed %d: %s", index, len(jobs), mode, seed, "resuming" if resume else "training")
        trainer = GRPOTrainer(run_config(config_for_mode, mode, seed, run_dir), resume="auto")
        trainer.train()
        _final_eval(trainer, names[mode], run_dir)

    from ..report.tables import paper_table, write_report

    report = write_report(out)
    print(paper_table(out))
    print(f"\nreport: {report}")
    return report


def _extend_to(steps: int, run_dirs: list[Path]) -> None:
    """Before any work: refuse `--steps` below what a run of the comparison has trained (its steps cannot be undone),
    and mark a finished run with fewer steps unfinished, so that it resumes to `steps` and is evaluated again."""
    trained = {run_dir: max((r["step"] for r in read_metrics(run_dir / METRICS_FILE)), default=0)
               for run_dir in run_dirs if (run_dir / METRICS_FILE).exists()}
    longer = {run_dir: n for run_dir, n in trained.items() if n > steps}
    if longer:
        listing = ", ".join(f"{run_dir.parent.name}/{run_dir.name}: {n}" for run_dir, n in longer.items())
        raise ConfigError(f"--steps {steps}: runs of this comparison have trained more steps ({listing}); give "
                          f"--steps {max(longer.values())} or more to extend them, or another --out")
    for run_dir, n in trained.items():
        if n < steps and (run_dir / FINAL_EVAL_FILE).exists():
            log.info("%s/%s: trained %d steps, extending it to %d", run_dir.parent.name, run_dir.name, n, steps)
            (run_dir / FINAL_EVAL_FILE).unlink()


def _final_eval(trainer: GRPOTrainer, mode: str, run_dir: Path) -> None:
    """Held-out accuracy under dense and under sparse inference (the run's KV policy and KV storage), with the same
    budget for every mode."""
    config = trainer.config
    records = [r for r in read_metrics(run_dir / METRICS_FILE) if r.get("step", 0) > 0]
    result = {"mode": mode, "steps": len(records),
              "train_seconds": sum(r.get("step_s", 0.0) for r in records),
              "rollout_seconds": sum(r.get("rollout_s", 0.0) for r in records)}
    parts = trainer.parts
    parts.model.eval()
    # The trainer's own compression: an adaptive schedule is evaluated with the budgets it trained to; sparse
    # inference also stores the cache as the run's sampler did (`kv_dtype`).
    for inference, compression, kv_dtype in (("dense", None, "auto"),
                                             ("sparse", parts.compression, config.rollout.kv_dtype)):
        with parts.sampler() if inference == "sparse" else contextlib.nullcontext():  # DistillSparse's adapter
            result[inference] = evaluate_policy(parts.model, parts.tokenizer, parts.task, parts.eval_examples,
                                                parts.max_new_tokens, compression, samples=0,
                                                temperature=config.rollout.temperature, seed=config.train.seed,
                                                progress=True, kv_dtype=kv_dtype)
    tmp = run_dir / (FINAL_EVAL_FILE + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(run_dir / FINAL_EVAL_FILE)
