"""Atomic, resumable training checkpoints.

A checkpoint is a directory `checkpoints/step_000010/` holding the policy (`save_pretrained`,
safetensors, with its tokenizer), the optimizer state, the RNG states, the trainer counters and
the config. It is written into a temporary sibling and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ExperimentConfig, save_config

CHECKPOINT_DIR = "checkpoints"
_PREFIX = "step_"


@dataclass
class TrainerState:
    step: int = 0  # steps completed
    skipped_steps: int = 0
    reward_failures: int = 0
    reward_timeouts: int = 0


def save_checkpoint(run_dir: Path, state: TrainerState, model, tokenizer, optimizer: torch.optim.Optimizer,
                    config: ExperimentConfig, keep: int) -> Path:
    root = run_dir / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{state.step:06d}"
    tmp = root / f".tmp_{_PREFIX}{state.step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "policy", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "policy")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_states(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__, indent=2))
    save_config(config, tmp / "config.yaml")
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
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
             and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_trainer_state(checkpoint: Path, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore optimizer and RNG states (the weights are loaded by the caller from `policy/`)."""
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=False))
    _set_rng_states(torch.load(checkpoint / "rng.pt", weights_only=False))
    return TrainerState(**json.loads((checkpoint / "trainer_state.json").read_text()))


def _rng_states() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
