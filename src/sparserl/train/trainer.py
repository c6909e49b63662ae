"""The GRPO trainer: prompts → rollouts (dense or sparse) → rewards → dense recompute → corrections → update.

One `GRPOTrainer` runs every mode; the mode's preset (`sparserl.config.presets`) decides whether rollouts
are compressed, and the config's resolved `correction` which corrections apply. Every step is a pure function of
(weights, optimizer state, seed, step): prompts and sampling noise are seeded per step, which is
what makes a resumed run repeat an uninterrupted one exactly.

`train_step` runs its stages over one `StepBatch` (`step_batch.py`): sample → score → recompute →
correct → update → diagnose. What a mode adds without the step knowing (the KV budget controllers,
DistillSparse) joins it as a hook (`hooks.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from ..config.corrections import CorrectionConfig
from ..config.presets import load_preset
from ..config.schema import ExperimentConfig, check_training_settings
from ..errors import ConfigError, UserError
from ..learner.alpha import rollout_alpha_metrics
from ..learner.corrections import compute_corrections, rejection_by_length
from ..learner.distill import DistillTrainer, distill_config
from ..learner.grpo import group_advantages
from ..learner.update import ppo_update
from ..model.clock import now
from ..model.forward import batched_hidden, batched_logprobs, hidden_logprobs, micro_batches, response_hidden
from ..model.loading import load_policy, resolve_device, sampling_generator
from ..model.threads import set_threads
from ..rewards.runner import RewardRunner
from ..rollout.adapter import SamplerAdapter, adapter_config, sampler_context
from ..rollout.batch import SamplingConfig
from ..rollout.dispatch.backends import make_rollouts
from ..rollout.dispatch.scheduler import RowLimits, step_seed
from ..rollout.dispatch.shards import concat_rollouts, plan_shards, rollout_metrics
from ..rollout.dispatch.spec import SamplerSpec
from ..rollout.sparsity.budgets import BinnedBudget
from ..rollout.sparsity.settings import adaptive_budget, sparsity_from_config
from ..rollout.speculative.drafts import draft_from_config
from ..tasks.base import is_correct, walk_metrics
from ..tasks.registry import max_new_tokens, task_from_config
from .checkpoint import TrainerState, load_adapter, load_trainer_state, save_checkpoint
from .evaluation import decode_responses, greedy_scores, response_ids, task_rewards
from .hooks import (
    AdaptiveBudgetHook,
    DistillSparseHook,
    HookUpdate,
    HookView,
    RecalibrationHook,
    StepHook,
)
from .layout import POLICY_DIR
from .metrics import MetricsLogger
from .run_dir import Resume, StopRequest, open_run_dir
from .step_batch import (
    StepBatch,
    kept_advantages,
    kept_vs_rejected,
    reward_metrics,
)

LENGTH_BUCKETS = 4
SLOW_STEP_FACTOR = 4.0  # a step this many times the run's median step time so far is said
SLOW_STEP_AFTER = 3  # steps the median needs first


def slow_step_message(earlier: list[float], seconds: float, step: int) -> str | None:
    """One line when `seconds` exceeds SLOW_STEP_FACTOR × the median of `earlier` step times (after
    SLOW_STEP_AFTER of them): on a shared machine, competing jobs' threads slow every step."""
    if len(earlier) < SLOW_STEP_AFTER:
        return None
    ordered = sorted(earlier)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    if seconds <= SLOW_STEP_FACTOR * median:
        return None
    return (f"step {step} took {seconds:.1f} s, {seconds / median:.1f}x this run's median step ({median:.1f} s): "
            "the machine is loaded; other jobs compete for the cores. Run one job per core (--threads 1 each) "
            "or stop the other jobs")
# What Sparse-RL's filters would flag, logged under these names in every mode (whatever the mode
# applies) so that the mismatch is comparable across modes; the unprefixed metrics are what was applied.
FLAGGED_METRICS = {"rejected_seq_frac": "flagged_veto_frac", "band_mask_frac": "flagged_band_frac",
                   "rejected_sequences": "flagged_vetoed_sequences"}
REFERENCE_CORRECTIONS = CorrectionConfig.sparse_rl()
OUT_OF_RANGE_FRAC = 0.3  # a first-step filter rate above this says the regime is outside the method's range
_SKIPPED_UPDATE = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 1.0,
                   "grad_norm": 0.0, "optimizer_steps": 0}  # a step whose every token was rejected


class CorrectionsStarved(UserError):
    """Every response token was rejected for `max_rejected_steps` steps in a row. A ValueError, so the
    command line reports it as a setting to change (mode, thresholds, budget), not as a crash."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: the run stopped at a step boundary after saving a checkpoint."""

    def __init__(self, step: int, run_dir: Path):
        super().__init__(f"interrupted at step {step}; the last checkpoint is step {step} in {run_dir}")
        self.step = step


class GRPOTrainer:
    def __init__(self, config: ExperimentConfig, resume: Resume = "never", overwrite: bool = False,
                 allow_config_change: bool = False):
        check_training_settings(config)
        self.config = config
        self.run = open_run_dir(config, resume, overwrite, allow_config_change)
        self.rollouts = None  # where the step's shards sample; a Ray cluster with workers, started last in `_build`
        try:
            self._build(config, self.run.resume_checkpoint)
        except BaseException:
            self.close(failed=True)
            raise

    def _build(self, config: ExperimentConfig, checkpoint: Path | None) -> None:
        self.run_dir = self.run.path
        torch.manual_seed(config.train.seed)
        dtype = getattr(torch, config.model.dtype)
        source = str(checkpoint / POLICY_DIR) if checkpoint else config.model.model
        self.device = resolve_device(config.model.device)
        self.model, self.tokenizer = load_policy(source, dtype, self.device)
        self.reference = None
        if config.train.kl_coef > 0:
            self.reference = load_policy(config.model.model, dtype, self.device)[0].eval().requires_grad_(False)
        self.task = task_from_config(config.task, self.tokenizer)
        self.max_new_tokens = max_new_tokens(config.task, self.task)
        self.reward = RewardRunner.from_spec(config.train.reward_funcs, config.train.reward_weights, self.task.reward,
                                             timeout_s=config.train.reward_timeout,
                                             max_failure_frac=config.train.max_reward_failure_frac)
        self.eval_rewards = task_rewards(config, self.task)
        self.adapter, self.distill = None, None
        if config.train.distill_sparse:
            self.adapter = SamplerAdapter(self.model, adapter_config(config.train))
            self.distill = DistillTrainer(self.adapter, distill_config(config.train, config.rollout.temperature))
            if checkpoint is not None:
                load_adapter(self.distill, checkpoint)
        policy_parameters = [p for name, p in self.model.named_parameters()
                             if self.adapter is None or self.adapter.is_policy_parameter(name)]
        # The fused kernel: one pass over each parameter instead of a dozen (0.09 s against 0.5 s a step for
        # SmolLM2's 135M parameters on one CPU thread); the same update up to float rounding.
        self.optimizer = torch.optim.AdamW(policy_parameters, lr=config.train.lr,
                                           weight_decay=config.train.weight_decay,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.state = TrainerState()
        if checkpoint is not None:
            self.state = load_trainer_state(checkpoint, self.optimizer)
            if self.state.step > config.train.steps:
                raise ConfigError(f"--steps {config.train.steps}: the run in {self.run.path} is already at step "
                                  f"{self.state.step}; give --steps {self.state.step} or more to continue it")
        threads = set_threads(config.model.threads, self.model, recorded=self.state.threads)
        self.state.threads = threads.threads
        logging.getLogger(__name__).info("torch threads: %d (%s)", threads.threads, threads.reason)
        self.compression = sparsity_from_config(config.rollout)  # eviction or block-sparse attention
        self.adaptive = adaptive_budget(config.rollout) if config.rollout.kv_schedule == "adaptive" else None
        if self.adaptive is not None and self.state.kv_budgets:
            self.adaptive.budgets = list(self.state.kv_budgets)
        if self.adaptive is not None:
            self.compression = dataclasses.replace(self.compression, schedule=self.adaptive.snapshot())
        elif config.rollout.recalibrate_every and self.state.kv_budgets:  # the last recalibration's schedule
            self.compression = dataclasses.replace(
                self.compression, schedule=BinnedBudget(config.rollout.alpha_bin_size, tuple(self.state.kv_budgets)))
        # Speculative rollouts are exact dense samples whatever the mode: nothing sparse to measure or correct.
        self.sparse = load_preset(config.train.mode).sparse_rollouts and not config.rollout.speculative
        # What every step samples with but its sparsity (which a budget controller may move): DistillSparse's
        # replay needs the eviction records, α the sampler's distributions.
        self.sampler_spec = SamplerSpec(
            draft=draft_from_config(config.rollout) if config.rollout.speculative else None,
            draft_tokens=config.rollout.draft_tokens, record_evictions=self.adapter is not None,
            record_distributions=self.sparse)
        self.shards = config.rollout.rollout_shards or max(1, config.rollout.rollout_workers)
        self.row_limits = RowLimits.from_rollout_config(config.rollout, self.device)
        self.corrections = config.correction
        self.eval_examples = self.task.examples(config.output.eval_examples, seed=config.train.seed, split="test")
        self.hooks = self._hooks(config)
        self.hook_view = HookView(config, self.model, self.tokenizer, self.task, self.max_new_tokens, self.device,
                                  self.sampler)
        self.logger = MetricsLogger(self.run_dir, config.output.log_with, self.state.step if checkpoint else None,
                                    run_name=self.run_dir.name, config=config.to_dict())
        self._starve_warned = False
        # Last: nothing after it can fail, so a Ray cluster is never started for a run that does not build.
        self.rollouts = make_rollouts(config, self.model, self.adapter, self.device)

    def _hooks(self, config: ExperimentConfig) -> list[StepHook]:
        hooks: list[StepHook] = []
        if config.rollout.recalibrate_every:
            hooks.append(RecalibrationHook(config.rollout.recalibrate_every, bool(config.rollout.kv_schedule)))
        if self.adaptive is not None:
            hooks.append(AdaptiveBudgetHook(self.adaptive))
        if self.distill is not None:
            hooks.append(DistillSparseHook(self.distill))
        return hooks

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainerState:
        """Run to `steps`; a SIGINT or SIGTERM stops at the next step boundary with a checkpoint."""
        cfg = self.config
        stop = StopRequest()
        failed = True
        try:
            with stop:
                if self.state.step == 0 and cfg.output.eval_every:
                    self.logger.log({"step": 0, **self.evaluate()})
                bar = tqdm(total=cfg.train.steps, initial=self.state.step, desc=f"train {cfg.train.mode}",
                           unit="step")
                step_seconds: list[float] = []
                try:
                    while self.state.step < cfg.train.steps:
                        step = self.state.step + 1
                        record = self.train_step(step)
                        self.state.step = step
                        # A recalibration step does more work by design: its time says nothing of the machine.
                        working = record["step_s"] - record.get("recalibrate_s", 0.0)
                        message = slow_step_message(step_seconds, working, step)
                        if message:
                            warnings.warn(message)
                        step_seconds.append(working)
                        if cfg.output.eval_every and (step % cfg.output.eval_every == 0 or step == cfg.train.steps):
                            record.update(self.evaluate())
                        self.logger.log(record)
                        if step % cfg.output.checkpoint_every == 0 or step == cfg.train.steps or stop.requested:
                            save_checkpoint(self.run_dir, self.state, self.model, self.tokenizer, self.optimizer,
                                            cfg, cfg.output.keep_checkpoints, self.distill)
                        bar.update(1)
                        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.2f}",
                                        len=f"{record['response_len_mean']:.0f}")
                        if stop.requested:
                            raise TrainingInterrupted(step, self.run_dir)
                finally:
                    bar.close()
            failed = False
        finally:
            self.close(failed)
        return self.state

    def close(self, failed: bool = False) -> None:
        """Stop the rollout workers (a Ray cluster this run started), close the logs and release the run
        directory; `train()` ends with it, and a trainer built but never trained should be closed by its owner."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        if getattr(self, "logger", None) is not None:
            self.logger.close()
            self.logger = None
        self.run.release(failed)

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy under dense inference, and under sparse inference if asked."""
        self.model.eval()
        inferences = {"dense": None}
        if self.config.output.eval_sparse_inference:
            inferences["sparse"] = self.compression
        result = {}
        for inference, compression in inferences.items():
            answers: list[dict] = []
            with self.sampler() if compression else contextlib.nullcontext():
                scores = greedy_scores(self.model, self.tokenizer, self.task, self.eval_examples,
                                       self.max_new_tokens, compression=compression, rewards=self.eval_rewards,
                                       limits=self.row_limits, answers=answers)
            result.update({f"eval_{name}_{inference}": value for name, value in scores.items()})
            self.logger.log_samples([{"step": self.state.step, "kind": f"eval_{inference}", **a} for a in answers])
        counts = self.eval_rewards.pop_counts()
        result.update({f"eval_{name}": counts[name] for name in ("reward_failures", "reward_timeouts")})
        return result

    def sampler(self):
        """Context of the sparse sampler: DistillSparse's adapter on inside (nothing without one)."""
        return sampler_context(self.adapter)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict[str, float]:
        """sample → score → recompute → correct → update → diagnose; the hooks join at their points."""
        started = now(self.device)
        record: dict[str, float] = {"step": step}
        before = {}
        for hook in self.hooks:
            before.update(self._apply(hook.before_sampling(self.hook_view, step)))
        budgets_used = self._schedule_metrics()  # before an adaptive schedule moves
        data = self._sample(step)
        self._score(data)
        recompute_started = now(self.device)
        self._recompute(data)
        for hook in self.hooks:
            record.update(self._apply(hook.after_recompute(self.hook_view, data)))
        self._correct(data)
        recompute_s = now(self.device) - recompute_started
        self.logger.log_samples(self._rollout_samples(data))
        update_started = now(self.device)
        rejected, skipped = self._guard_rejections(data)
        update = _SKIPPED_UPDATE if skipped else self._update_policy(data)
        update_s = now(self.device) - update_started
        record.update(reward_metrics(data.rewards, data.correct))
        record.update(rollout_metrics(data.batch, data.rollouts))
        if data.rollouts.stats is not None:  # what the sampler counted (speculative rollouts: acceptance)
            record.update(data.rollouts.stats.metrics(self.config.rollout.alpha_bin_size))
        record.update(update)
        record.update(self._diagnose(data))
        record.update({**budgets_used, **before, "rejected_token_frac": rejected, "skipped": int(skipped),
                       "skipped_steps": self.state.skipped_steps, "starving_steps": self.state.starving_steps})
        counts = self.reward.pop_counts()  # failures, timeouts and each reward function's mean
        self.state.reward_failures += counts["reward_failures"]
        self.state.reward_timeouts += counts["reward_timeouts"]
        record.update({**counts, "recompute_s": recompute_s, "update_s": update_s,
                       "step_s": now(self.device) - started, "lr": self.optimizer.param_groups[0]["lr"]})
        return record

    def _sample(self, step: int) -> StepBatch:
        """The step's prompts (seeded by step) and their rollouts, dense or through the compressed cache."""
        cfg = self.config
        seed = step_seed(cfg.train.seed, step)
        examples = self.task.examples(cfg.rollout.prompts_per_step, seed=seed, split="train")
        group = cfg.rollout.group_size
        prompts = [self.tokenizer(e.prompt).input_ids for e in examples for _ in range(group)]
        self.model.eval()
        sampling = SamplingConfig(max_new_tokens=self.max_new_tokens, temperature=cfg.rollout.temperature,
                                  eos_token_id=None if cfg.rollout.ignore_eos else self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id,
                                  prompt_width=max(len(p) for p in prompts),
                                  **self.row_limits.sampling_fields())
        self.rollouts.sync_weights(self.model, self.state.step)
        rollouts = self.rollouts.generate(plan_shards(prompts, group, self.shards, seed), sampling,
                                          self.step_sampler())
        batch = concat_rollouts(rollouts.shards, self.tokenizer.pad_token_id)
        return StepBatch(step, examples, rollouts, batch, sampling_generator(self.model, seed))

    def _score(self, data: StepBatch) -> None:
        data.texts = decode_responses(self.tokenizer, data.batch)
        scores = self.reward.score_examples(data.examples, data.texts, response_ids(data.batch),
                                            self.config.rollout.group_size)
        data.rewards = torch.tensor(scores, dtype=torch.float32, device=self.device)
        # Correct is the task's own verdict, never the weighted sum (a format bonus is not a solution).
        data.correct = torch.tensor([is_correct(s) for s in self.reward.last_scores["task"]], device=self.device)

    def _rollout_samples(self, data: StepBatch) -> list[dict]:
        """Each rollout's text, reward, verdict and whether the correction kept it (`samples.jsonl`)."""
        group, kept = self.config.rollout.group_size, data.corrections.seq_keep.tolist()
        return [{"step": data.step, "kind": "train", "prompt_index": row // group,
                 "prompt": data.examples[row // group].prompt, "completion": text,
                 "reward": reward, "correct": correct, "kept": keep}
                for row, (text, reward, correct, keep) in enumerate(zip(data.texts, data.rewards.tolist(),
                                                                         data.correct.tolist(), kept))]

    def _recompute(self, data: StepBatch) -> None:
        """π_old (the dense policy before the update), the reference model's log-probs, and α, whose dense side is
        π_old's own forward."""
        cfg, batch = self.config, data.batch
        input_ids, attention_mask = batch.input_ids, batch.attention_mask
        width, targets = batch.prompt_ids.shape[1], batch.response_ids
        mb, share = cfg.train.micro_batch_size, cfg.train.share_prompts
        temperature = cfg.rollout.temperature
        # Every forward of the learner runs as the sampler's do, with dropout off (TRL's `disable_dropout`): π_old, the
        # update's π_θ and α's dense side are then one function of the weights, whichever path computes them.
        self.model.eval()
        if cfg.train.minibatches == 1 and cfg.train.epochs == 1 and len(batch) <= mb:
            # One optimizer step from one forward: that forward, at the current weights, is the dense
            # recompute of π_old, so it is done once with gradients and reused (as TRL does).
            hidden = response_hidden(self.model, input_ids, attention_mask, width, share)
            data.fused_forward = hidden_logprobs(self.model, hidden, targets, with_entropy=cfg.train.entropy_coef > 0,
                                                 temperature=temperature)
            data.logp_old, dense_hidden = data.fused_forward[0].detach(), hidden.detach()
        else:
            dense_hidden = batched_hidden(self.model, input_ids, attention_mask, width, mb, share)
            with torch.no_grad():
                data.logp_old = torch.cat([hidden_logprobs(self.model, dense_hidden[rows], targets[rows],
                                                           temperature=temperature)[0]
                                           for rows in micro_batches(len(batch), mb)])
        if self.reference is not None:
            data.logp_ref = batched_logprobs(self.reference, input_ids, attention_mask, width, mb, temperature, share)
        # α needs the sampler's whole distributions and the pre-update weights.
        every = cfg.rollout.alpha_every
        if self.sparse and every and (data.step - 1) % every == 0:
            data.acceptance = rollout_alpha_metrics(self.model, data.rollouts.shards, temperature,
                                                    cfg.rollout.alpha_bin_size, micro_batch_size=mb,
                                                    sampler_context=self.sampler, share_prompts=share,
                                                    dense_hidden=dense_hidden)

    def _correct(self, data: StepBatch) -> None:
        """The mode's corrections, what Sparse-RL's would flag, and the group advantages."""
        batch = data.batch
        data.corrections = compute_corrections(data.logp_old, batch.sampler_logprobs, batch.response_mask,
                                               self.corrections)
        # What Sparse-RL's filters would flag, logged in every mode so the mismatch is comparable across modes.
        data.flagged = data.corrections if self.corrections == REFERENCE_CORRECTIONS else \
            compute_corrections(data.logp_old, batch.sampler_logprobs, batch.response_mask, REFERENCE_CORRECTIONS)
        included = None if self.config.train.rejected_in_baseline else data.corrections.seq_keep
        data.advantages = group_advantages(data.rewards, self.config.rollout.group_size, included)

    def _guard_rejections(self, data: StepBatch) -> tuple[float, bool]:
        """The rejected token fraction, and whether the update is skipped (nothing kept). Warns on a first
        step outside the filters' range and once on starving; stops after max_rejected_steps in a row."""
        cfg, step = self.config, data.step
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
            self.state.starving_steps += 1
            if not self._starve_warned:  # once per run; the count is in the metrics and the summary
                self._starve_warned = True
                warnings.warn(f"step {step}: corrections rejected {rejected:.0%} of response tokens "
                              f"(warn_rejected_frac={cfg.train.warn_rejected_frac}); training may starve. "
                              "Further such steps are counted in `starving_steps`, not warned about")
        skipped = float(keep.sum()) == 0
        self.state.rejected_in_a_row = self.state.rejected_in_a_row + 1 if skipped else 0
        if self.state.rejected_in_a_row >= cfg.train.max_rejected_steps:
            raise CorrectionsStarved(
                f"step {step}: the corrections rejected every response token for {self.state.rejected_in_a_row} steps "
                f"in a row (max_rejected_steps={cfg.train.max_rejected_steps}); mode {cfg.train.mode} cannot train in "
                "this regime. Loosen its filters (--veto-threshold, --band, --seq-geo-bounds, --seq-k3-max), raise "
                f"--kv-budget, or use a mode without rejection. The last checkpoint is in {self.run_dir}")
        if skipped:
            self.state.skipped_steps += 1
            warnings.warn(f"step {step}: every response token was rejected; skipping the update "
                          f"({self.state.skipped_steps} skipped so far)")
        return rejected, skipped

    def _update_policy(self, data: StepBatch) -> dict[str, float]:
        corrections = data.corrections
        update = ppo_update(self.model, self.optimizer, data.batch, data.logp_old, data.logp_ref, data.advantages,
                            corrections.weights, corrections.keep_mask, data.generator, self.config.train,
                            self.config.rollout.temperature, data.fused_forward)
        for hook in self.hooks:
            update.update(self._apply(hook.after_update(self.hook_view, data)))
        return update

    def _diagnose(self, data: StepBatch) -> dict[str, float]:
        """Mismatch, rejection and acceptance metrics of the step, and the task's own."""
        batch, rewards, corrections, flagged = data.batch, data.rewards, data.corrections, data.flagged
        by_length = rejection_by_length(batch.response_lengths, flagged.seq_keep, self._length_edges())
        return {
            **corrections.metrics,
            **{flagged_name: flagged.metrics[name] for name, flagged_name in FLAGGED_METRICS.items()},
            **{"flagged_" + key: value for key, value in by_length.items()},
            **kept_vs_rejected(rewards, batch.response_lengths, flagged.seq_keep, "flagged_", "vetoed"),
            **kept_vs_rejected(rewards, batch.response_lengths, corrections.seq_keep, "", "rejected"),
            **kept_advantages(data.advantages, corrections.keep_mask),
            **walk_metrics(self.task, data.texts, data.examples, self.config.rollout.group_size),
            **data.acceptance,
        }

    # ------------------------------------------------------------------ schedules
    def step_sampler(self) -> SamplerSpec:
        """What this step samples with: the run's sampler, with the sparsity (and budgets) in force now."""
        return dataclasses.replace(self.sampler_spec, sparsity=self.compression if self.sparse else None)

    def _apply(self, update: HookUpdate) -> dict[str, float]:
        """A hook's new budget schedule takes effect now (and is checkpointed); its metrics go to the record."""
        if update.schedule is not None:
            self.compression = dataclasses.replace(self.compression, schedule=update.schedule)
            self.state.kv_budgets = list(update.schedule.budgets)
        return update.metrics

    def _schedule_metrics(self) -> dict[str, float]:
        """The budget per cached-length bin when a schedule is in force (for the report's plot)."""
        schedule = self.compression.schedule if self.sparse else None
        if schedule is None:
            return {}
        return {f"kv_budget_len_{i * schedule.bin_size}": float(b) for i, b in enumerate(schedule.budgets)}

    def _length_edges(self) -> list[int]:
        top = self.max_new_tokens
        return [math.ceil(top * i / LENGTH_BUCKETS) for i in range(1, LENGTH_BUCKETS)]
