"""`sparserl compare`: the paper's experiment, one training run per mode, then a report.

Every mode trains from the same weights with the same seed, prompts and KV budget into
`DIR/<mode>/`, then is evaluated on the same held-out set under dense and under sparse
inference (`final_eval.json`). A mode with a `final_eval.json` is done and skipped; a mode with a
checkpoint resumes from it, so an interrupted comparison picks up where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path

from .checkpoint import latest_checkpoint
from .config import MODES, ConfigError, ExperimentConfig
from .evaluate import evaluate_policy
from .metrics_log import METRICS_FILE, read_metrics
from .rollout.engine import KVCompression
from .trainer import GRPOTrainer

log = logging.getLogger(__name__)
FINAL_EVAL = "final_eval.json"


def mode_config(config: ExperimentConfig, mode: str, run_dir: Path) -> ExperimentConfig:
    return dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, mode=mode),
        output=dataclasses.replace(config.output, out=str(run_dir), eval_sparse_inference=True),
    )


def run_compare(config: ExperimentConfig, modes: list[str]) -> Path:
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ConfigError(f"--modes: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}")
    out = Path(config.output.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "compare.json"
    record = json.loads(manifest.read_text()) if manifest.exists() else {
        "modes": [], "config": config.to_dict(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    # A comparison extended later with more modes (e.g. the ablations) reports all of them.
    record["modes"] = record["modes"] + [m for m in modes if m not in record["modes"]]
    manifest.write_text(json.dumps(record, indent=2, default=list))
    for index, mode in enumerate(modes, start=1):
        run_dir = out / mode
        if (run_dir / FINAL_EVAL).exists():
            log.info("[%d/%d] %s: already done, skipping", index, len(modes), mode)
            continue
        resume = latest_checkpoint(run_dir) is not None
        log.info("[%d/%d] %s: %s", index, len(modes), mode, "resuming" if resume else "training")
        trainer = GRPOTrainer(mode_config(config, mode, run_dir), resume=resume)
        trainer.train()
        _final_eval(trainer, mode, run_dir)

    from .report import paper_table, write_report

    report = write_report(out)
    print(paper_table(out))
    print(f"\nreport: {report}")
    return report


def _final_eval(trainer: GRPOTrainer, mode: str, run_dir: Path) -> None:
    """Held-out accuracy under dense and under sparse inference, with the same budget for every mode."""
    config = trainer.config
    records = [r for r in read_metrics(run_dir / METRICS_FILE) if r.get("step", 0) > 0]
    result = {"mode": mode, "steps": len(records),
              "train_seconds": sum(r.get("step_s", 0.0) for r in records),
              "rollout_seconds": sum(r.get("rollout_s", 0.0) for r in records)}
    trainer.model.eval()
    for inference, compression in (("dense", None), ("sparse", KVCompression.from_rollout_config(config.rollout))):
        result[inference] = evaluate_policy(trainer.model, trainer.tokenizer, trainer.task, trainer.eval_examples,
                                            trainer.max_new_tokens, compression, samples=0,
                                            temperature=config.rollout.temperature, seed=config.train.seed)
    tmp = run_dir / (FINAL_EVAL + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(run_dir / FINAL_EVAL)
