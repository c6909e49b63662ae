"""Where per-step metrics go: `metrics.jsonl` (always), TensorBoard, and trackio or wandb if asked; and the texts
behind them, `samples.jsonl` (each step's rollouts and each evaluation's answers, a line per answer).

On resume the JSONL files are cut back to the checkpoint's step (and a line torn by a kill is
dropped), so a resumed run's file reads as if it had never stopped and holds each step once. A
fresh run starts an empty file.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..tasks.math_jsonl import json_lines
from .layout import METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR


class MetricsLogger:
    def __init__(self, run_dir: Path, backends: str, resume_step: int | None, run_name: str, config: dict):
        """`resume_step`: the checkpoint's step when resuming, None for a fresh run."""
        self.path, self.samples_path = run_dir / METRICS_FILE, run_dir / SAMPLES_FILE
        for path in (self.path, self.samples_path):
            _truncate_after(path, -1 if resume_step is None else resume_step)
        resume_step = resume_step or 0
        self.tensorboard = None
        self.trackers: list[Any] = []
        names = {b.strip() for b in backends.split(",") if b.strip() and b.strip() != "none"}
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=resume_step + 1)
        for name in sorted(names - {"tensorboard"}):
            if name not in ("trackio", "wandb"):
                raise UserError(f"log_with: unknown backend {name!r}; use tensorboard, trackio, wandb or none")
            if importlib.util.find_spec(name) is None:
                warnings.warn(f"log_with asks for {name}, which is not installed; `pip install {name}` to use it")
                continue
            module = __import__(name)
            module.init(project="sparserl", name=run_name, config=config,
                        **({"resume": "allow"} if name == "wandb" else {}))
            self.trackers.append(module)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if self.tensorboard is not None:
                    self.tensorboard.add_scalar(key, value, step)
        for tracker in self.trackers:
            tracker.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def log_samples(self, records: list[dict[str, Any]]) -> None:
        """Append answers, each a JSON object with its `step` (and `kind`: train, eval_dense, eval_sparse)."""
        with open(self.samples_path, "a") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file, in file order; [] when there is no file. A torn last line
    (a run killed mid-write) is skipped with a warning; any other line that is not a JSON object
    with a "step" is an error that names the file and the line. The one reader of the file: the
    trainer's resume, `compare` and the report all go through it."""
    if not path.exists():
        return []
    lines = json_lines(path.read_text())
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                warnings.warn(f"{path}: line {number} was cut off by an interrupted write; ignoring it")
                continue
            raise UserError(f"{path}: line {number} is not valid JSON; remove or repair that line") from None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            raise UserError(f"{path}: line {number} is not a step record (a JSON object with an integer "
                             "\"step\"); remove or repair that line")
        records.append(record)
    return records


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
