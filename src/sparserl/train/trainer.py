"""The GRPO trainer: the run's lifecycle around its steps (evaluation, checkpoints, resume, close).

One `GRPOTrainer` runs every mode. It opens the run directory (resuming from its latest intact checkpoint when
asked), builds the run's parts (`build.py`), opens the metrics log and the rollout backend, and runs one step's
pipeline (`pipeline.py`: rollout → rewards → π_old → corrections → update) per step until `steps`, evaluating
and checkpointing on the config's cadence. The mode's preset (`sparserl.config.presets`) decides whether
rollouts are compressed, and the config's resolved `correction` which corrections apply.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from tqdm import tqdm

from ..config.schema import ExperimentConfig, check_training_settings
from ..rollout.dispatch.backends import make_rollouts
from ..rollout.engine.step import StepRunner
from .build import RunParts, build_run
from .checkpoint import TrainerState, save_checkpoint
from .evaluation import greedy_scores
from .metrics import MetricsLogger
from .pipeline import StepPipeline
from .run_dir import Resume, StopRequest, open_run_dir

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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: the run stopped at a step boundary after saving a checkpoint."""

    def __init__(self, step: int, run_dir: Path):
        super().__init__(f"interrupted at step {step}; the last checkpoint is step {step} in {run_dir}")
        self.step = step


class GRPOTrainer:
    """`parts`: what the run is built from (`build.RunParts`); `pipeline`: one step of it; `run`: its directory
    (held until `close`); `rollouts`: where the steps sample (a Ray cluster with workers, perhaps)."""

    def __init__(self, config: ExperimentConfig, resume: Resume = "never", overwrite: bool = False,
                 allow_config_change: bool = False):
        check_training_settings(config)
        self.config = config
        self.run = open_run_dir(config, resume, overwrite, allow_config_change)
        self.run_dir = self.run.path
        self.logger: MetricsLogger | None = None
        self.rollouts = None
        # The evaluations' step runners, shared by all of them: their captured steps last the run (`engine/step.py`).
        self.eval_runners: dict[str, StepRunner] = {}
        self._saved_step = -1  # the step of the last checkpoint this process saved
        try:
            checkpoint = self.run.resume_checkpoint
            self.parts: RunParts = build_run(config, self.run_dir, checkpoint)
            self.logger = MetricsLogger(self.run_dir, config.output.log_with,
                                        self.parts.state.step if checkpoint else None, run_name=self.run_dir.name,
                                        config=config.to_dict())
            # Last: nothing after it can fail, so a Ray cluster is never started for a run that does not build.
            self.rollouts = make_rollouts(config, self.parts.model, self.parts.adapter, self.parts.device)
        except BaseException:
            self.close(failed=True)
            raise
        self.pipeline = StepPipeline(self.parts, self.rollouts, self.logger)

    # The run's public face: what it trains, and where it stands.
    @property
    def model(self):
        return self.parts.model

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def state(self) -> TrainerState:
        return self.parts.state

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
                        record = self._step(self.state.step + 1, step_seconds)
                        bar.update(1)
                        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.2f}",
                                        len=f"{record['response_len_mean']:.0f}")
                        if stop.requested:  # checked once, here: a signal at any point of the step is seen
                            if self._saved_step != self.state.step:
                                self._save_checkpoint()
                            raise TrainingInterrupted(self.state.step, self.run_dir)
                finally:
                    bar.close()
            failed = False
        finally:
            self.close(failed)
        return self.state

    def _step(self, step: int, step_seconds: list[float]) -> dict[str, float]:
        """One step, then its evaluation, record and checkpoint when due; says when the machine slows it."""
        cfg = self.config
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
        if step % cfg.output.checkpoint_every == 0 or step == cfg.train.steps:
            self._save_checkpoint()
        return record

    def _save_checkpoint(self) -> None:
        cfg = self.config
        save_checkpoint(self.run_dir, self.state, self.model, self.tokenizer, self.parts.optimizer, cfg,
                        cfg.output.keep_checkpoints, self.parts.distill)
        self._saved_step = self.state.step

    def train_step(self, step: int) -> dict[str, float]:
        """One step's pipeline (`pipeline.StepPipeline.run`): its record, without advancing `state.step`."""
        return self.pipeline.run(step)

    def close(self, failed: bool = False) -> None:
        """Stop the rollout workers (a Ray cluster this run started), close the logs and release the run
        directory; `train()` ends with it, and a trainer built but never trained should be closed by its owner."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        self.run.release(failed)

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy under dense inference, and under sparse inference if asked: the run's sampler, its
        KV policy and its KV storage (`kv_dtype`)."""
        parts = self.parts
        parts.model.eval()
        inferences = {"dense": (None, "auto")}
        if self.config.output.eval_sparse_inference:
            inferences["sparse"] = (parts.compression, self.config.rollout.kv_dtype)
        result = {}
        for inference, (compression, kv_dtype) in inferences.items():
            answers: list[dict] = []
            with parts.sampler() if inference == "sparse" else contextlib.nullcontext():
                scores = greedy_scores(parts.model, parts.tokenizer, parts.task, parts.eval_examples,
                                       parts.max_new_tokens, compression=compression, rewards=parts.eval_rewards,
                                       limits=parts.row_limits, answers=answers, kv_dtype=kv_dtype,
                                       runners=self.eval_runners)
            result.update({f"eval_{name}_{inference}": value for name, value in scores.items()})
            self.logger.log_samples([{"step": self.state.step, "kind": f"eval_{inference}", **a} for a in answers])
        counts = parts.eval_rewards.pop_counts()
        result.update({f"eval_{name}": counts[name] for name in ("reward_failures", "reward_timeouts")})
        return result
