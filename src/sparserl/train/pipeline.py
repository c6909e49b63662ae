"""One training step: rollout → rewards → π_old → corrections → update, each stage a call on the step's
`StepBatch` (`step_batch.py`), read in order in `StepPipeline.run`.

Every step is a pure function of (weights, optimizer state, seed, step): prompts and sampling noise are seeded
per step, which is what makes a resumed run repeat an uninterrupted one exactly. What a mode adds without the
step knowing (the KV budget controllers, DistillSparse) joins it as a hook (`hooks.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import torch

from ..config.corrections import CorrectionConfig
from ..errors import UserError
from ..learner.alpha import rollout_alpha_metrics
from ..learner.corrections import compute_corrections
from ..learner.grpo import group_advantages
from ..learner.sampler_forward import SamplerForward
from ..learner.update import ppo_update
from ..model.clock import now
from ..model.forward import batched_hidden, batched_logprobs, hidden_logprobs, micro_batches, response_hidden
from ..model.loading import sampling_generator
from ..rollout.batch import SamplingConfig
from ..rollout.dispatch.scheduler import step_seed
from ..rollout.dispatch.shards import concat_rollouts, plan_shards, rollout_metrics
from ..rollout.dispatch.spec import SamplerSpec
from ..tasks.base import is_correct
from .build import RunParts
from .evaluation import decode_responses, response_ids
from .hooks import HookUpdate, StepHook
from .metrics import MetricsLogger
from .step_batch import StepBatch, diagnose, learner_ratio_metrics, reward_metrics, rollout_samples

REFERENCE_CORRECTIONS = CorrectionConfig.sparse_rl()  # what every mode logs as "flagged", to compare modes
OUT_OF_RANGE_FRAC = 0.3  # a first-step filter rate above this says the regime is outside the method's range
SKIPPED_UPDATE = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 1.0,
                  "grad_norm": 0.0, "optimizer_steps": 0}  # a step whose every token was rejected


class CorrectionsStarved(UserError):
    """Every response token was rejected for `max_rejected_steps` steps in a row. A ValueError, so the
    command line reports it as a setting to change (mode, thresholds, budget), not as a crash."""


class StepPipeline:
    """Runs one step of the run built in `parts`, sampling through `rollouts` (the dispatch backend) and
    writing each rollout to `logger`'s samples. It moves `parts.compression` when a hook changes the budget
    schedule, and `parts.state`'s counters of skipped and starving steps."""

    def __init__(self, parts: RunParts, rollouts, logger: MetricsLogger):
        self.parts, self.rollouts, self.logger = parts, rollouts, logger
        self.config = parts.config
        self.hook_view = parts.hook_view()
        self._starve_warned = False

    def run(self, step: int) -> dict[str, float]:
        """sample → score → recompute → correct → update → diagnose; the hooks join at their points. Returns
        the step's record for metrics.jsonl."""
        device, state = self.parts.device, self.parts.state
        started = now(device)
        before = self._join(lambda hook: hook.before_sampling(self.hook_view, step))
        budgets_used = self._schedule_metrics()  # before an adaptive schedule moves
        data = self._sample(step)
        self._score(data)
        recompute_started = now(device)
        self._recompute(data)
        recomputed = self._join(lambda hook: hook.after_recompute(self.hook_view, data))
        self._correct(data)
        recompute_s = now(device) - recompute_started
        self.logger.log_samples(rollout_samples(data, self.config.rollout.group_size))
        update_started = now(device)
        rejected, skipped = self._guard_rejections(data)
        update = SKIPPED_UPDATE if skipped else self._update_policy(data)
        update_s = now(device) - update_started
        return {"step": step, **recomputed, **self._rollout_metrics(data), **update,
                **diagnose(data, self.parts.task, self.config.rollout.group_size, self.parts.max_new_tokens),
                **budgets_used, **before, "rejected_token_frac": rejected, "skipped": int(skipped),
                "skipped_steps": state.skipped_steps, "starving_steps": state.starving_steps,
                **self._reward_counts(), "recompute_s": recompute_s, "update_s": update_s,
                "step_s": now(device) - started, "lr": self.parts.optimizer.param_groups[0]["lr"]}

    # ------------------------------------------------------------------ the stages
    def _sample(self, step: int) -> StepBatch:
        """The step's prompts (seeded by step) and their rollouts, dense or through the compressed cache."""
        cfg, parts = self.config, self.parts
        seed = step_seed(cfg.train.seed, step)
        examples = parts.task.examples(cfg.rollout.prompts_per_step, seed=seed, split="train")
        group = cfg.rollout.group_size
        prompts = [parts.tokenizer(e.prompt).input_ids for e in examples for _ in range(group)]
        parts.model.eval()
        sampling = SamplingConfig(max_new_tokens=parts.max_new_tokens, temperature=cfg.rollout.temperature,
                                  eos_token_id=None if cfg.rollout.ignore_eos else parts.tokenizer.eos_token_id,
                                  pad_token_id=parts.tokenizer.pad_token_id,
                                  prompt_width=max(len(p) for p in prompts),
                                  **parts.row_limits.sampling_fields())
        self.rollouts.sync_weights(parts.model, parts.state.step)
        rollouts = self.rollouts.generate(plan_shards(prompts, group, parts.shards, seed), sampling,
                                          self.step_sampler())
        batch = concat_rollouts(rollouts.shards, parts.tokenizer.pad_token_id)
        return StepBatch(step, examples, rollouts, batch, sampling_generator(parts.model, seed))

    def _score(self, data: StepBatch) -> None:
        reward, device = self.parts.reward, self.parts.device
        data.texts = decode_responses(self.parts.tokenizer, data.batch)
        scores = reward.score_examples(data.examples, data.texts, response_ids(data.batch),
                                       self.config.rollout.group_size)
        data.rewards = torch.tensor(scores, dtype=torch.float32, device=device)
        # Correct is the task's own verdict, never the weighted sum (a format bonus is not a solution).
        data.correct = torch.tensor([is_correct(s) for s in reward.last_scores["task"]], device=device)

    def _recompute(self, data: StepBatch) -> None:
        """π_old (the policy before the update), the reference model's log-probs, and α, whose dense side is the
        dense forward's own. Under a mode whose learner attends as the sampler did (`learner_attention: sampler`)
        π_old and π_ref go through the sampler's replayed attention, and the dense policy's log-probs are kept
        apart (`logp_dense`) for the mismatch metrics."""
        cfg, batch = self.config, data.batch
        mb, share = cfg.train.micro_batch_size, cfg.train.share_prompts
        learner = self._sampler_forward(data)  # None: the learner's forwards are dense
        # Every forward of the learner runs as the sampler's do, with dropout off (TRL's `disable_dropout`): π_old, the
        # update's π_θ and α's dense side are then one function of the weights, whichever path computes them.
        self.parts.model.eval()
        dense_hidden = self._pi_old(data, learner)
        if self.parts.reference is not None:
            # Under the sampler's attention too: the KL term is then the policy's drift from its start as it samples
            # (0 at step 1), not the sparse-vs-dense gap (`learner.sampler_forward`).
            data.logp_ref = learner.batched_logprobs(self.parts.reference, mb) if learner is not None else \
                batched_logprobs(self.parts.reference, batch.input_ids, batch.attention_mask,
                                 batch.prompt_ids.shape[1], mb, cfg.rollout.temperature, share)
        # α needs the sampler's whole distributions and the pre-update weights.
        every = cfg.rollout.alpha_every
        if self.parts.sparse and every and (data.step - 1) % every == 0:
            data.acceptance = rollout_alpha_metrics(self.parts.model, data.rollouts.shards, cfg.rollout.temperature,
                                                    cfg.rollout.alpha_bin_size, micro_batch_size=mb,
                                                    sampler_context=self.parts.sampler, share_prompts=share,
                                                    dense_hidden=dense_hidden)

    def _pi_old(self, data: StepBatch, learner: SamplerForward | None) -> torch.Tensor:
        """π_old's log-probs (through `learner` when there is one, with `logp_dense` beside them), as the update's own
        forward when one optimizer step on the whole batch makes them the same (`fused_forward`); returns the dense
        forward's final hidden states `[B, T, H]`, which α reuses."""
        cfg, model, batch = self.config, self.parts.model, data.batch
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        width, targets = batch.prompt_ids.shape[1], batch.response_ids
        mb, share = cfg.train.micro_batch_size, cfg.train.share_prompts
        temperature, with_entropy = cfg.rollout.temperature, cfg.train.entropy_coef > 0
        fused = cfg.train.minibatches == 1 and cfg.train.epochs == 1 and len(batch) <= mb
        if fused and learner is None:
            # One optimizer step from one forward: that forward, at the current weights, is the dense
            # recompute of π_old, so it is done once with gradients and reused (as TRL does).
            hidden = response_hidden(model, input_ids, attention_mask, width, share)
            data.fused_forward = hidden_logprobs(model, hidden, targets, with_entropy=with_entropy,
                                                 temperature=temperature)
            data.logp_old = data.fused_forward[0].detach()
            return hidden.detach()
        dense_hidden = batched_hidden(model, input_ids, attention_mask, width, mb, share)
        with torch.no_grad():
            logp_dense = torch.cat([hidden_logprobs(model, dense_hidden[rows], targets[rows],
                                                    temperature=temperature)[0]
                                    for rows in micro_batches(len(batch), mb)])
        if learner is None:
            data.logp_old = logp_dense
        elif fused:  # as above, the update's one forward with gradients, here through the sampler's attention
            data.logp_dense, data.fused_forward = logp_dense, learner.logprobs(model, with_entropy=with_entropy)
            data.logp_old = data.fused_forward[0].detach()
        else:
            data.logp_dense, data.logp_old = logp_dense, learner.batched_logprobs(model, mb)
        return dense_hidden

    def _sampler_forward(self, data: StepBatch) -> SamplerForward | None:
        """The learner's forwards through the step's sampler's attention, under a mode that trains so; else None."""
        if self.parts.learner_attention != "sampler":
            return None
        return SamplerForward(data.rollouts.shards, self.config.train.share_prompts, self.config.rollout.temperature)

    def _correct(self, data: StepBatch) -> None:
        """The mode's corrections, what Sparse-RL's would flag, and the group advantages. Both set the sampler against
        the dense policy in every mode, so that ξ and the flagged shares compare across modes; a mode whose learner
        attends as the sampler did corrects nothing (its presets refuse any correction) and logs its loss's own
        ratio apart (`learner_metrics`)."""
        batch, corrections = data.batch, self.config.correction
        dense = data.logp_old if data.logp_dense is None else data.logp_dense
        data.corrections = compute_corrections(dense, batch.sampler_logprobs, batch.response_mask, corrections)
        # What Sparse-RL's filters would flag, logged in every mode so the mismatch is comparable across modes.
        data.flagged = data.corrections if corrections == REFERENCE_CORRECTIONS else \
            compute_corrections(dense, batch.sampler_logprobs, batch.response_mask, REFERENCE_CORRECTIONS)
        if data.logp_dense is not None:
            data.learner_metrics = learner_ratio_metrics(data.logp_old, batch.sampler_logprobs, batch.response_mask)
        included = None if self.config.train.rejected_in_baseline else data.corrections.seq_keep
        data.advantages = group_advantages(data.rewards, self.config.rollout.group_size, included)

    def _guard_rejections(self, data: StepBatch) -> tuple[float, bool]:
        """The rejected token fraction, and whether the update is skipped (nothing kept). Warns on a first
        step outside the filters' range and once on starving; stops after max_rejected_steps in a row."""
        cfg, step, state = self.config, data.step, self.parts.state
        keep = data.corrections.keep_mask
        rejected = 1.0 - float(keep.sum()) / max(float(data.batch.response_mask.sum()), 1.0)
        filter_rates = {k: v for k, v in data.corrections.metrics.items() if k.startswith("applied_")}
        if step == 1 and any(v > OUT_OF_RANGE_FRAC for v in filter_rates.values()):
            worst = max(filter_rates, key=filter_rates.get)
            warnings.warn(f"step 1: {worst} = {filter_rates[worst]:.0%} (> {OUT_OF_RANGE_FRAC:.0%}): the "
                          f"sparse-vs-dense mismatch is likely outside the range of mode {cfg.train.mode}'s filters; "
                          "consider a larger --kv-budget, a calibrated --kv-schedule, or a mode without rejection "
                          "(docs/results.md)")
        if filter_rates and rejected > cfg.train.warn_rejected_frac:
            self._count_starving(step, rejected)
        skipped = float(keep.sum()) == 0
        state.rejected_in_a_row = state.rejected_in_a_row + 1 if skipped else 0
        if state.rejected_in_a_row >= cfg.train.max_rejected_steps:
            raise CorrectionsStarved(
                f"step {step}: the corrections rejected every response token for {state.rejected_in_a_row} steps "
                f"in a row (max_rejected_steps={cfg.train.max_rejected_steps}); mode {cfg.train.mode} cannot train in "
                "this regime. Loosen its filters (--veto-threshold, --band, --seq-geo-bounds, --seq-k3-max), raise "
                f"--kv-budget, or use a mode without rejection. The last checkpoint is in {self.parts.run_dir}")
        if skipped:
            state.skipped_steps += 1
            warnings.warn(f"step {step}: every response token was rejected; skipping the update "
                          f"({state.skipped_steps} skipped so far)")
        return rejected, skipped

    def _count_starving(self, step: int, rejected: float) -> None:
        """A step whose corrections rejected more than warn_rejected_frac: counted, and warned about once per run
        (the count is in the metrics and the summary)."""
        self.parts.state.starving_steps += 1
        if not self._starve_warned:
            self._starve_warned = True
            warnings.warn(f"step {step}: corrections rejected {rejected:.0%} of response tokens "
                          f"(warn_rejected_frac={self.config.train.warn_rejected_frac}); training may starve. "
                          "Further such steps are counted in `starving_steps`, not warned about")

    def _update_policy(self, data: StepBatch) -> dict[str, float]:
        corrections, parts = data.corrections, self.parts
        learner = self._sampler_forward(data)
        update = ppo_update(parts.model, parts.optimizer, data.batch, data.logp_old, data.logp_ref, data.advantages,
                            corrections.weights, corrections.keep_mask, data.generator, self.config.train,
                            self.config.rollout.temperature, data.fused_forward,
                            None if learner is None else functools.partial(learner.logprobs, parts.model))
        update.update(self._join(lambda hook: hook.after_update(self.hook_view, data)))
        return update

    # ------------------------------------------------------------------ the record
    def _rollout_metrics(self, data: StepBatch) -> dict[str, float]:
        """The step's rewards, its rollouts' shape and cache figures, and what the sampler counted (speculative
        rollouts: acceptance)."""
        metrics = {**reward_metrics(data.rewards, data.correct), **rollout_metrics(data.batch, data.rollouts)}
        if data.rollouts.stats is not None:
            metrics.update(data.rollouts.stats.metrics(self.config.rollout.alpha_bin_size))
        return metrics

    def _reward_counts(self) -> dict[str, float]:
        """The step's reward failures, timeouts and each reward function's mean; the run's totals are checkpointed."""
        counts = self.parts.reward.pop_counts()
        self.parts.state.reward_failures += counts["reward_failures"]
        self.parts.state.reward_timeouts += counts["reward_timeouts"]
        return counts

    # ------------------------------------------------------------------ hooks and schedules
    def step_sampler(self) -> SamplerSpec:
        """What this step samples with: the run's sampler, with the sparsity (and budgets) in force now."""
        return dataclasses.replace(self.parts.sampler_spec,
                                   sparsity=self.parts.compression if self.parts.sparse else None)

    def _join(self, call: Callable[[StepHook], HookUpdate]) -> dict[str, float]:
        """Every hook at one point of the step (`call` names the point): a new budget schedule takes effect now
        (and is checkpointed); the hooks' metrics go to the record."""
        metrics: dict[str, float] = {}
        for hook in self.parts.hooks:
            update = call(hook)
            if update.schedule is not None:
                self.parts.compression = dataclasses.replace(self.parts.compression, schedule=update.schedule)
                self.parts.state.kv_budgets = list(update.schedule.budgets)
            metrics.update(update.metrics)
        return metrics

    def _schedule_metrics(self) -> dict[str, float]:
        """The budget per cached-length bin when a schedule is in force (for the report's plot)."""
        compression = self.parts.compression if self.parts.sparse else None
        schedule = compression.schedule if compression is not None else None  # sparsity none: no budget
        if schedule is None:
            return {}
        return {f"kv_budget_len_{i * schedule.bin_size}": float(b) for i, b in enumerate(schedule.budgets)}
