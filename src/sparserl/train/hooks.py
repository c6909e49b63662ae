"""What joins a training step at fixed points without the step knowing it: the KV budget controllers
(Sparrow's recalibration, the adaptive schedule) and DistillSparse's adapter update.

A hook's methods get the trainer and return metrics for the step's record. `before_sampling` runs
before the rollouts (a controller may change the budgets they use), `after_recompute` once π_old and
α are known, `after_update` after the policy's optimizer step (not on a skipped step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..config.schema import calibration_budgets
from ..model.clock import now
from ..learner.distill import DistillTrainer
from ..rollout.acceptance import bin_tails
from ..rollout.schedule import AdaptiveBudget
from .calibration import calibrate_schedule
from .step_batch import StepBatch, step_seed

if TYPE_CHECKING:
    from .trainer import GRPOTrainer


class StepHook:
    """The three points a hook may join; each does nothing unless overridden."""

    def before_sampling(self, trainer: GRPOTrainer, step: int) -> dict[str, float]:
        return {}

    def after_recompute(self, trainer: GRPOTrainer, data: StepBatch) -> dict[str, float]:
        return {}

    def after_update(self, trainer: GRPOTrainer, data: StepBatch) -> dict[str, float]:
        return {}


class AdaptiveBudgetHook(StepHook):
    """The adaptive schedule: the next step's budgets per bin follow this step's α tail."""

    def after_recompute(self, trainer: GRPOTrainer, data: StepBatch) -> dict[str, float]:
        schedule = trainer.compression.schedule
        assert isinstance(schedule, AdaptiveBudget)
        schedule.update(bin_tails(data.acceptance))
        trainer.state.kv_budgets = list(schedule.budgets)
        return {}


class RecalibrationHook(StepHook):
    """Sparrow's calibration every `recalibrate_every` steps, on the current weights and that step's
    prompts; the schedule it finds is in force from that step on."""

    def __init__(self, every: int, starts_with_schedule: bool):
        self.every = every
        self.starts_with_schedule = starts_with_schedule

    def due(self, step: int) -> bool:
        # Steps 1, N+1, 2N+1, ...; step 1 only when no schedule file was given to start from.
        return (step - 1) % self.every == 0 and (step > 1 or not self.starts_with_schedule)

    def before_sampling(self, trainer: GRPOTrainer, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        rollout = trainer.config.rollout
        started = now(trainer.device)
        trainer.model.eval()
        seed = step_seed(trainer.config.train.seed, step)
        examples = trainer.task.examples(rollout.calibration_prompts, seed=seed, split="train")
        found = calibrate_schedule(trainer.model, trainer.tokenizer, trainer.max_new_tokens, rollout, examples,
                                   calibration_budgets(rollout), rollout.alpha_tau, rollout.alpha_bin_size,
                                   rollout.calibration_samples, seed, progress=False,
                                   sampler_context=trainer.sampler)
        trainer.compression = dataclasses.replace(trainer.compression, schedule=found.schedule)
        trainer.state.kv_budgets = list(found.schedule.budgets)
        return {"recalibrated": 1, "recalibrate_s": now(trainer.device) - started,
                "recalibration_unmet_bins": len(found.unmet_bins)}


class DistillSparseHook(StepHook):
    """DistillSparse: after the policy's update, the sampler's adapter learns to match the dense policy
    on this step's rollouts (weighted by their advantages)."""

    def __init__(self, distill: DistillTrainer):
        self.distill = distill

    def after_update(self, trainer: GRPOTrainer, data: StepBatch) -> dict[str, float]:
        return self.distill.train_step(data.rollouts.shards, data.advantages, trainer.config.train.micro_batch_size)
