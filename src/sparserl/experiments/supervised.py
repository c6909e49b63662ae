"""The supervised warm start both `sparserl warmup` (the built-in model) and `sparserl sft` (any model) run: train on
a task's demonstrations, probe held-out greedy accuracy, and keep a model inside a band that leaves RL room.

The band rule, one for both: a probe is *in band* when its held-out greedy accuracy (the task's own reward: an exact
walk, an exact running total) is in [low, high]. Training stops at the first probe in band at or above `stop_at`.
A skill arrives suddenly (the built-in model went from 6% to 95% exact walks between two probes 50 steps apart), so
when a probe jumps past `high`, training rewinds to the previous probe (weights, optimizer, schedule, data stream)
and replays those steps probing after each one; if a single step jumps past the band, or the steps run out, the
in-band probe closest to `stop_at` is kept, and with none the run fails saying what to change. A model past the
band is never handed on as a start.
"""

from __future__ import annotations

import copy
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..config.schema import Band
from ..errors import ConfigError, UserError


@dataclass
class Kept:
    """The probe a warm start keeps: its step, its scores and whatever the probe returned beside them."""

    step: int
    scores: dict[str, float]
    extra: Any
    state: dict = field(repr=False, default_factory=dict)


@dataclass
class _Snapshot:
    step: int
    model: dict
    optimizer: dict
    schedule: dict
    rng: object


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing `--out` unless asked, before any training (a warm start takes minutes)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"--out {out} exists: choose another directory, or pass --overwrite true to replace it")


def warm_start(model, optimizer, schedule, train_loss: Callable[[random.Random], torch.Tensor],
               probe: Callable[[int], tuple[dict[str, float], Any]], band: Band, probe_every: int, max_steps: int,
               rng: random.Random, history: list[dict], start_step: int = 0, label: str = "warm start") -> Kept:
    """Train from step `start_step` + 1 until the band rule stops (see the module), at most to `max_steps`.

    `train_loss(rng)`: a fresh batch's loss (the data stream draws from `rng`, which a rewind restores);
    `probe(step)`: held-out scores (with `accuracy`) and anything to keep with them (the answers). Each step's loss
    goes to `history`, with the probe's scores where it probed (a replayed step appears again). Returns the kept
    probe, its weights loaded into `model`."""
    previous = _snapshot(start_step, model, optimizer, schedule, rng)
    best: Kept | None = None
    dense_probing_until = 0  # after a rewind: probe every step up to here
    started = time.perf_counter()
    bar = tqdm(total=max_steps, initial=start_step, desc=label, unit="step")
    step = start_step
    while step < max_steps:
        step += 1
        bar.update(1)
        model.train()
        loss = train_loss(rng)
        optimizer_step(model, optimizer, schedule, loss)
        record = {"step": step, "loss": float(loss.detach())}
        history.append(record)
        every = 1 if step <= dense_probing_until else probe_every
        if step % every:
            continue
        model.eval()
        scores, extra = probe(step)
        score = scores["accuracy"]
        record.update(scores, seconds=round(time.perf_counter() - started, 1))
        bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{score:.2f}")
        tqdm.write(f"{label} step {step}: held-out greedy accuracy {score:.1%}")
        in_band = band.low <= score <= band.high
        if in_band and (best is None or abs(score - band.stop_at) < abs(best.scores["accuracy"] - band.stop_at)):
            best = Kept(step, dict(scores), extra, copy.deepcopy(model.state_dict()))
        if in_band and score >= band.stop_at:
            break
        if score > band.high:
            if best is not None:
                break
            if dense_probing_until < step:  # jumped over the band between two probes: replay them one by one
                dense_probing_until = step
                step = _restore(previous, model, optimizer, schedule, rng)
                bar.n = step
                continue
            break
        previous = _snapshot(step, model, optimizer, schedule, rng)
    bar.close()
    if best is None:
        last = history[-1]["accuracy"] if history and "accuracy" in history[-1] else None
        raise UserError(f"{label}: no held-out probe reached the band [{band.low}, {band.high}] within {step} steps "
                        f"(last probe {last if last is None else format(last, '.1%')}): raise the steps or the learning "
                        "rate if it stayed below, probe more often (--probe-every) if it jumped past")
    model.load_state_dict(best.state)
    return best


def optimizer_step(model, optimizer, schedule, loss: torch.Tensor) -> None:
    """One clipped (norm 1.0) optimizer step on `loss`, then the schedule's."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()


def save_model(model, tokenizer, out: Path, files: dict[str, str]) -> None:
    """save_pretrained (safetensors) plus tokenizer and the other `files` (name: text), written to a temp dir then
    renamed over `out`."""
    out = out.expanduser()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name, text in files.items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _snapshot(step, model, optimizer, schedule, rng: random.Random) -> _Snapshot:
    return _Snapshot(step, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                     copy.deepcopy(schedule.state_dict()), rng.getstate())


def _restore(snapshot: _Snapshot, model, optimizer, schedule, rng: random.Random) -> int:
    model.load_state_dict(snapshot.model)
    optimizer.load_state_dict(snapshot.optimizer)
    schedule.load_state_dict(snapshot.schedule)
    rng.setstate(snapshot.rng)
    return snapshot.step
