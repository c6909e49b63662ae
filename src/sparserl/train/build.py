"""Building a training run from its config: the policy (and the reference model), the task and its rewards, the
optimizer and counters (from a checkpoint on resume), the rollouts' sparsity and sampler, and the hooks.

`build_run` returns them as one `RunParts`, which the step pipeline (`pipeline.py`) and the run's lifecycle
(`trainer.py`) share. It opens nothing that must be closed: the metrics logger and the rollout backend (a Ray
cluster, perhaps) are the lifecycle's to open and close.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..config.presets import check_learner_attention, load_preset
from ..config.schema import ExperimentConfig
from ..errors import ConfigError
from ..learner.distill import DistillTrainer, distill_config
from ..model.loading import load_policy, resolve_device
from ..model.threads import set_threads
from ..rewards.runner import RewardRunner
from ..rollout.adapter import SamplerAdapter, adapter_config, sampler_context
from ..rollout.dispatch.scheduler import RowLimits
from ..rollout.dispatch.spec import SamplerSpec
from ..rollout.sparsity.block_sparse import BlockSparsity
from ..rollout.sparsity.budgets import AdaptiveBudget, BinnedBudget
from ..rollout.sparsity.eviction import KVCompression
from ..rollout.sparsity.settings import adaptive_budget, sparsity_from_config
from ..rollout.speculative.drafts import draft_from_config
from ..tasks.base import Example, Task
from ..tasks.registry import max_new_tokens, task_from_config
from .checkpoint import TrainerState, load_adapter, load_trainer_state
from .evaluation import task_rewards
from .hooks import AdaptiveBudgetHook, DistillSparseHook, HookView, RecalibrationHook, StepHook
from .layout import POLICY_DIR


@dataclasses.dataclass(kw_only=True)
class RunParts:
    """What a run is made of. `compression` (the rollouts' sparsity, with the budget schedule in force) and
    `state` (the counters a checkpoint keeps) change as the run trains; the rest is fixed once built.

    run_dir: where the run writes (`run_dir.py`);
    model, tokenizer: the policy; reference: the frozen model of the KL term (None when kl_coef = 0);
    adapter, distill: DistillSparse's sampler adapter and its trainer (None without it);
    task, max_new_tokens, reward: what is asked and how a response is scored; eval_examples, eval_rewards: the
    held-out prompts and the task's own reward for them;
    sparse: whether rollouts are compressed; learner_attention: what the learner's forwards attend to (dense, or
    the sampler's replayed attention); sampler_spec: what every step samples with but its sparsity;
    shards, row_limits: how a step's rows are split and bounded; hooks: what joins each step (`hooks.py`).
    """

    config: ExperimentConfig
    run_dir: Path
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    reference: torch.nn.Module | None
    adapter: SamplerAdapter | None
    distill: DistillTrainer | None
    task: Task
    max_new_tokens: int
    reward: RewardRunner
    eval_examples: list[Example]
    eval_rewards: RewardRunner
    optimizer: torch.optim.Optimizer
    state: TrainerState
    compression: KVCompression | BlockSparsity | None  # None: --sparsity none (a full cache, maybe quantized)
    sparse: bool
    learner_attention: str
    sampler_spec: SamplerSpec
    shards: int
    row_limits: RowLimits
    hooks: list[StepHook]

    def sampler(self):
        """Context of the sparse sampler: DistillSparse's adapter on inside (nothing without one)."""
        return sampler_context(self.adapter)

    def hook_view(self) -> HookView:
        return HookView(self.config, self.model, self.tokenizer, self.task, self.max_new_tokens, self.device,
                        self.sampler)


def build_run(config: ExperimentConfig, run_dir: Path, checkpoint: Path | None) -> RunParts:
    """The run's parts, from scratch or from `checkpoint` (its weights, optimizer, counters and budgets).
    The order of the steps is the order of their draws from torch's seeded generator: keep it."""
    check_learner_attention(config)  # before any model loads
    _check_dense_storage(config)
    torch.manual_seed(config.train.seed)
    device = resolve_device(config.model.device)
    model, tokenizer, reference = _policy(config, checkpoint, device)
    task = task_from_config(config.task, tokenizer)
    reward = RewardRunner.from_spec(config.train.reward_funcs, config.train.reward_weights, task.reward,
                                    timeout_s=config.train.reward_timeout,
                                    max_failure_frac=config.train.max_reward_failure_frac)
    eval_rewards = task_rewards(config, task)
    adapter, distill = _distill_sparse(config, model, checkpoint)
    optimizer = _optimizer(config, model, adapter, device)
    state = _state(config, checkpoint, optimizer, run_dir)
    threads = set_threads(config.model.threads, model, recorded=state.threads)
    state.threads = threads.threads
    logging.getLogger(__name__).info("torch threads: %d (%s)", threads.threads, threads.reason)
    adaptive = adaptive_budget(config.rollout) if config.rollout.kv_schedule == "adaptive" else None
    compression = _compression(config, state, adaptive)
    # Speculative rollouts are exact dense samples whatever the mode: nothing sparse to measure or correct.
    preset = load_preset(config.train.mode)
    sparse = preset.sparse_rollouts and not config.rollout.speculative
    # What every step samples with but its sparsity (which a budget controller may move): DistillSparse's replay and
    # a learner through the sampler's attention need the eviction records, α the sampler's distributions.
    replayed = adapter is not None or preset.learner_attention == "sampler"
    sampler_spec = SamplerSpec(
        draft=draft_from_config(config.rollout) if config.rollout.speculative else None,
        draft_tokens=config.rollout.draft_tokens, record_evictions=replayed, record_distributions=sparse,
        kv_dtype=config.rollout.kv_dtype)
    return RunParts(
        config=config, run_dir=run_dir, device=device, model=model, tokenizer=tokenizer, reference=reference,
        adapter=adapter, distill=distill, task=task, max_new_tokens=max_new_tokens(config.task, task), reward=reward,
        eval_examples=task.examples(config.output.eval_examples, seed=config.train.seed, split="test"),
        eval_rewards=eval_rewards, optimizer=optimizer, state=state, compression=compression, sparse=sparse,
        learner_attention=preset.learner_attention, sampler_spec=sampler_spec,
        shards=config.rollout.rollout_shards or max(1, config.rollout.rollout_workers),
        row_limits=RowLimits.from_rollout_config(config.rollout, device), hooks=_hooks(config, adaptive, distill))


def _check_dense_storage(config: ExperimentConfig) -> None:
    """A quantized cache is a sparse sampler (its ξ differs from 1): a mode that samples densely, and so neither
    measures nor corrects that mismatch, is refused it rather than quietly sampling through it."""
    if config.rollout.kv_dtype != "auto" and not load_preset(config.train.mode).sparse_rollouts:
        raise ConfigError(f"mode {config.train.mode} samples densely and corrects nothing, and --kv-dtype "
                          f"{config.rollout.kv_dtype} makes the sampler differ from the dense policy: use a sparse "
                          "mode (nemo-fp8: a full FP8 cache with token TIS; or any sparse mode with --sparsity none), or "
                          "--kv-dtype auto; `sparserl eval --kv-dtype` measures a dense-trained model through it")


def _policy(config: ExperimentConfig, checkpoint: Path | None, device: torch.device):
    """The policy and its tokenizer (a checkpoint's on resume), and the KL term's frozen reference model."""
    dtype = getattr(torch, config.model.dtype)
    source = str(checkpoint / POLICY_DIR) if checkpoint else config.model.model
    model, tokenizer = load_policy(source, dtype, device)
    reference = None
    if config.train.kl_coef > 0:
        reference = load_policy(config.model.model, dtype, device)[0].eval().requires_grad_(False)
    return model, tokenizer, reference


def _distill_sparse(config: ExperimentConfig, model: torch.nn.Module, checkpoint: Path | None):
    """DistillSparse's sampler adapter and its trainer (restored from `checkpoint`), or (None, None)."""
    if not config.train.distill_sparse:
        return None, None
    adapter = SamplerAdapter(model, adapter_config(config.train))
    distill = DistillTrainer(adapter, distill_config(config.train, config.rollout.temperature))
    if checkpoint is not None:
        load_adapter(distill, checkpoint)
    return adapter, distill


def _optimizer(config: ExperimentConfig, model: torch.nn.Module, adapter: SamplerAdapter | None,
               device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the policy's parameters (DistillSparse's adapter has its own optimizer)."""
    policy_parameters = [p for name, p in model.named_parameters()
                         if adapter is None or adapter.is_policy_parameter(name)]
    # The fused kernel: one pass over each parameter instead of a dozen (0.09 s against 0.5 s a step for
    # SmolLM2's 135M parameters on one CPU thread); the same update up to float rounding.
    return torch.optim.AdamW(policy_parameters, lr=config.train.lr, weight_decay=config.train.weight_decay,
                             fused=device.type in ("cpu", "cuda"))


def _state(config: ExperimentConfig, checkpoint: Path | None, optimizer: torch.optim.Optimizer,
           run_dir: Path) -> TrainerState:
    """Fresh counters, or the checkpoint's (loading the optimizer's state with them)."""
    if checkpoint is None:
        return TrainerState()
    state = load_trainer_state(checkpoint, optimizer)
    if state.step > config.train.steps:
        raise ConfigError(f"--steps {config.train.steps}: the run in {run_dir} is already at step {state.step}; "
                          f"give --steps {state.step} or more to continue it")
    return state


def _compression(config: ExperimentConfig, state: TrainerState,
                 adaptive: AdaptiveBudget | None) -> KVCompression | BlockSparsity:
    """The rollouts' sparsity (eviction or block-sparse attention), with the budget schedule a resumed run had
    reached: the adaptive controller's, or the last recalibration's."""
    compression = sparsity_from_config(config.rollout)
    if adaptive is not None:
        if state.kv_budgets:
            adaptive.budgets = list(state.kv_budgets)
        return dataclasses.replace(compression, schedule=adaptive.snapshot())
    if config.rollout.recalibrate_every and state.kv_budgets:
        return dataclasses.replace(
            compression, schedule=BinnedBudget(config.rollout.alpha_bin_size, tuple(state.kv_budgets)))
    return compression


def _hooks(config: ExperimentConfig, adaptive: AdaptiveBudget | None, distill: DistillTrainer | None) -> list[StepHook]:
    hooks: list[StepHook] = []
    if config.rollout.recalibrate_every:
        hooks.append(RecalibrationHook(config.rollout.recalibrate_every, bool(config.rollout.kv_schedule)))
    if adaptive is not None:
        hooks.append(AdaptiveBudgetHook(adaptive))
    if distill is not None:
        hooks.append(DistillSparseHook(distill))
    return hooks
