"""What joins a training step at fixed points without the step knowing it: the KV budget controllers
(Sparrow's recalibration, the adaptive schedule) and DistillSparse's adapter update.

A hook sees the run through a narrow, read-only `HookView` (the config, the policy, its tokenizer and task, the
device and the sparse sampler's context), never the trainer itself, and answers with a `HookUpdate`: metrics
for the step's record, and optionally the KV budget schedule in force from then on, which the step pipeline
applies (and the trainer checkpoints). `before_sampling` runs before the rollouts (a controller may change the
budgets they use), `after_recompute` once π_old and α are known, `after_update` after the policy's optimizer
step (not on a skipped step).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ..config.schema import ExperimentConfig
from ..config.validation import calibration_budgets
from ..learner.distill import DistillTrainer
from ..model.clock import now
from ..rollout.acceptance import bin_tails
from ..rollout.dispatch.scheduler import step_seed
from ..rollout.sparsity.budgets import AdaptiveBudget, BinnedBudget
from ..tasks.base import Task
from .calibration import calibrate_schedule
from .step_batch import StepBatch


@dataclass(frozen=True)
class HookView:
    """What a hook may read of the run. `sampler_context()`: the context the sparse sampler samples under
    (DistillSparse's adapter on)."""

    config: ExperimentConfig
    model: torch.nn.Module
    tokenizer: object
    task: Task
    max_new_tokens: int
    device: torch.device
    sampler_context: Callable[[], AbstractContextManager]


@dataclass
class HookUpdate:
    """A hook's answer: metrics for the step's record, and the budget schedule in force from now on (None: no
    change)."""

    metrics: dict[str, float] = field(default_factory=dict)
    schedule: BinnedBudget | None = None


class StepHook:
    """The three points a hook may join; each changes nothing unless overridden."""

    def before_sampling(self, view: HookView, step: int) -> HookUpdate:
        return HookUpdate()

    def after_recompute(self, view: HookView, data: StepBatch) -> HookUpdate:
        return HookUpdate()

    def after_update(self, view: HookView, data: StepBatch) -> HookUpdate:
        return HookUpdate()


class AdaptiveBudgetHook(StepHook):
    """The adaptive schedule: the next step's budgets per bin follow this step's α tail. The hook owns the
    controller; samplers get its snapshot."""

    def __init__(self, controller: AdaptiveBudget):
        self.controller = controller

    def after_recompute(self, view: HookView, data: StepBatch) -> HookUpdate:
        self.controller.update(bin_tails(data.acceptance))
        return HookUpdate(schedule=self.controller.snapshot())


class RecalibrationHook(StepHook):
    """Sparrow's calibration every `recalibrate_every` steps, on the current weights and that step's
    prompts, sampling as training samples (DistillSparse's adapter on); the schedule it finds is in force
    from that step on."""

    def __init__(self, every: int, starts_with_schedule: bool):
        self.every = every
        self.starts_with_schedule = starts_with_schedule

    def due(self, step: int) -> bool:
        # Steps 1, N+1, 2N+1, ...; step 1 only when no schedule file was given to start from.
        return (step - 1) % self.every == 0 and (step > 1 or not self.starts_with_schedule)

    def before_sampling(self, view: HookView, step: int) -> HookUpdate:
        if not self.due(step):
            return HookUpdate()
        rollout = view.config.rollout
        started = now(view.device)
        view.model.eval()
        seed = step_seed(view.config.train.seed, step)
        examples = view.task.examples(rollout.calibration_prompts, seed=seed, split="train")
        found = calibrate_schedule(view.model, view.tokenizer, view.max_new_tokens, rollout, examples,
                                   calibration_budgets(rollout), rollout.alpha_tau, rollout.alpha_bin_size,
                                   rollout.calibration_samples, seed, progress=False,
                                   sampler_context=view.sampler_context)
        return HookUpdate({"recalibrated": 1, "recalibrate_s": now(view.device) - started,
                           "recalibration_unmet_bins": len(found.unmet_bins)}, found.schedule)


class DistillSparseHook(StepHook):
    """DistillSparse: after the policy's update, the sampler's adapter learns to match the dense policy
    on this step's rollouts (weighted by their advantages)."""

    def __init__(self, distill: DistillTrainer):
        self.distill = distill

    def after_update(self, view: HookView, data: StepBatch) -> HookUpdate:
        return HookUpdate(self.distill.train_step(data.rollouts.shards, data.advantages,
                                                  view.config.train.micro_batch_size))
