"""Atomic, resumable training checkpoints.

A checkpoint is a directory `checkpoints/step_000010/` holding the policy (`save_pretrained`,
safetensors, with its tokenizer), the optimizer state, the RNG states, the trainer counters and
the config. It is written into a temporary sibling and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never half of one. A manifest of every file's size
and SHA-256, written last, lets a resume check a checkpoint before trusting it and fall back to
the newest intact one when a disk or a copy damaged the latest. Nothing is unpickled: tensors
load with `weights_only=True` and the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config.schema import ExperimentConfig, save_config
from ..errors import UserError
from .layout import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS_FILE,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    HOST_RNG_FILE,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    POLICY_DIR,
    RNG_FILE,
    TRAINER_STATE_FILE,
)

_PREFIX = "step_"


@dataclass
class TrainerState:
    step: int = 0  # steps completed
    skipped_steps: int = 0
    reward_failures: int = 0
    reward_timeouts: int = 0
    starving_steps: int = 0  # steps whose rejected fraction passed warn_rejected_frac
    rejected_in_a_row: int = 0  # consecutive steps whose every response token was rejected
    kv_budgets: list[int] | None = None  # an adaptive schedule's budgets per bin, for the next step
    threads: int = 0  # the torch threads the run chose (its float sums depend on them); 0: not yet chosen


def save_checkpoint(run_dir: Path, state: TrainerState, model, tokenizer, optimizer: torch.optim.Optimizer,
                    config: ExperimentConfig, keep: int, distill=None) -> Path:
    """`distill`: DistillSparse's `DistillTrainer`; its adapter and optimizer are saved beside the
    policy, whose weights go without the adapter."""
    if keep < 1:
        raise UserError(f"keep_checkpoints must be >= 1, got {keep}")
    root = run_dir / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{state.step:06d}"
    tmp = root / f".tmp_{_PREFIX}{state.step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / POLICY_DIR, safe_serialization=True,
                          state_dict=distill.adapter.policy_state_dict() if distill is not None else None)
    if distill is not None:
        save_adapter(distill, tmp / ADAPTER_DIR)
    tokenizer.save_pretrained(tmp / POLICY_DIR)
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # every CUDA device's generator, for a resumed run to continue it
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / RNG_FILE)
    (tmp / HOST_RNG_FILE).write_text(json.dumps(_host_rng_states()))
    (tmp / TRAINER_STATE_FILE).write_text(json.dumps(state.__dict__, indent=2))
    save_config(config, tmp / CONFIG_FILE)
    (tmp / MANIFEST_FILE).write_text(json.dumps(_file_digests(tmp), indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / MANIFEST_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None if every file of the manifest is there with its size and hash, else what is wrong."""
    try:
        expected = json.loads((checkpoint / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return "its manifest is missing or unreadable"
    for name, (size, digest) in expected.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name} does not match its SHA-256"
    return None


def latest_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that passes `checkpoint_problem`; each damaged newer one is warned about."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        warnings.warn(f"checkpoint {checkpoint} is damaged ({problem}); trying an older one")
    return None


def load_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore optimizer and RNG states (the weights are loaded by the caller from `policy/`)."""
    optimizer.load_state_dict(torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True))
    rng = torch.load(checkpoint / RNG_FILE, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    host = json.loads((checkpoint / HOST_RNG_FILE).read_text())
    version, internal, gauss = host["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = host["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return TrainerState(**json.loads((checkpoint / TRAINER_STATE_FILE).read_text()))


def save_adapter(distill, directory: Path) -> None:
    """DistillSparse's adapter weights and its optimizer (`distill`: a `DistillTrainer`)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: p.detach().contiguous() for name, p in distill.parameters.items()},
              directory / ADAPTER_WEIGHTS_FILE)
    torch.save(distill.optimizer.state_dict(), directory / OPTIMIZER_FILE)


def load_adapter(distill, checkpoint: Path) -> None:
    """What `save_adapter` wrote into `checkpoint`, into `distill`'s adapter and optimizer."""
    directory = checkpoint / ADAPTER_DIR
    saved = load_file(directory / ADAPTER_WEIGHTS_FILE)
    if set(saved) != set(distill.parameters):
        raise UserError(f"{directory}: the saved adapter does not match this model's (different rank or "
                         "target modules?); resume with the run's own distill settings")
    with torch.no_grad():
        for name, parameter in distill.parameters.items():
            parameter.copy_(saved[name])
    distill.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))


def _host_rng_states() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_digests(directory: Path) -> dict[str, list]:
    return {str(p.relative_to(directory)): [p.stat().st_size, _sha256(p)]
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
