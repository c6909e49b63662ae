"""Sparrow's look-ahead calibration of a budget schedule on the current weights: what `sparserl
calibrate` runs once and `train --recalibrate-every N` reruns during training (the search itself is
described in `experiments/calibrate.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from tqdm import tqdm

from ..learner.alpha import rollout_alpha_metrics
from ..rollout.acceptance import bin_tails
from ..rollout.dispatch.scheduler import RowLimits
from ..rollout.sparsity.budgets import BinnedBudget, BudgetSchedule, FixedBudget
from ..rollout.sparsity.settings import budgeted_sparsity
from .evaluation import complete


@dataclass
class Calibration:
    schedule: BinnedBudget
    fixed_tails: dict[int, dict[int, float]]  # budget -> {bin start: α tail}
    schedule_tails: dict[int, float]  # {bin start: α tail} under the chosen schedule
    unmet_bins: list[int]  # bins that even the largest budget could not bring to τ


def _tails(model, tokenizer, max_new_tokens, rollout, examples, schedule: BudgetSchedule, samples: int,
           bin_size: int, quantile: float, seed: int, sampler_context) -> dict[int, float]:
    """{bin start: α tail} of sampled rollouts under `schedule` (same prompts and seed every call)."""
    compression = budgeted_sparsity(dataclasses.replace(rollout, kv_schedule=None), "the calibration")
    compression = dataclasses.replace(compression, schedule=schedule)
    limits = RowLimits.from_rollout_config(rollout, next(model.parameters()).device)
    with sampler_context():
        done = complete(model, tokenizer, examples, max_new_tokens, rollout.temperature, compression, limits=limits,
                        samples=samples, seed=seed, record_distributions=True, kv_dtype=rollout.kv_dtype)
    return bin_tails(rollout_alpha_metrics(model, done.batches, rollout.temperature, bin_size, quantile,
                                           sampler_context=sampler_context))


def calibrate_schedule(model, tokenizer, max_new_tokens: int, rollout, examples, budgets: list[int], tau: float,
                       bin_size: int, samples: int, seed: int, quantile: float = 0.05, progress: bool = True,
                       sampler_context=contextlib.nullcontext) -> Calibration:
    """The look-ahead schedule of the module docstring, for `model` as it is now (the CLI's and
    `--recalibrate-every`'s common core). `rollout`: a `RolloutConfig` (policy, window, interval, the KV storage
    `kv_dtype`, and the limits on rows in flight). `sampler_context()`: what the sparse sampler samples under (DistillSparse's
    adapter on), so that the tails measured are those of the sampler training will use."""
    budgets = sorted(budgets)
    measure = lambda schedule: _tails(model, tokenizer, max_new_tokens, rollout, examples, schedule,  # noqa: E731
                                      samples, bin_size, quantile, seed, sampler_context)
    fixed = {b: measure(FixedBudget(b)) for b in tqdm(budgets, desc="calibrate: fixed budgets", unit="budget",
                                                      disable=not progress)}
    starts = sorted({start for per_bin in fixed.values() for start in per_bin})
    chosen: list[int] = []
    unmet: list[int] = []
    bins = range(0, starts[-1] + 1, bin_size) if starts else range(0)
    for start in tqdm(bins, desc="calibrate: schedule", unit="bin", disable=not progress):
        floor = chosen[-1] if chosen else budgets[0]
        pick = None
        for budget in (b for b in budgets if b >= floor):
            tails = measure(BinnedBudget(bin_size, tuple(chosen) + (budget,)))
            if all(tail >= tau for bin_start, tail in tails.items() if bin_start >= start):
                pick = budget
                break
        if pick is None:
            pick = budgets[-1]
            if measure(BinnedBudget(bin_size, tuple(chosen) + (pick,))).get(start, tau) < tau:
                unmet.append(start)
        chosen.append(pick)
    schedule = BinnedBudget(bin_size, tuple(chosen or budgets[:1]))
    return Calibration(schedule, fixed, measure(schedule), unmet)
