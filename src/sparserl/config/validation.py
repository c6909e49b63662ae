"""Checks of a whole experiment configuration that its types alone cannot express (`validate`, which
`schema.load_config` runs): cross-field rules, and the values of task, KV-policy, schedule, speculative and worker
options, refused in one line before any model or data loads.

The checks sit below the schema: the schema hands each config to them, and they read its sections by name without
importing it (`config` is an `ExperimentConfig`, `rollout` a `RolloutConfig`, `task` a `TaskConfig`), so that the
two files do not import each other."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..rollout.sizes import parse_memory
from ..rollout.sparsity.policies import build_policy, policy_options
from ..tasks.registry import TASK_OPTIONS, task_class
from .presets import load_preset
from .values import coerce


def validate(config) -> None:
    """Cross-field checks that the types alone cannot express."""
    checks = [
        (config.rollout.group_size >= 2, "group_size must be >= 2 (GRPO needs a group to compare)"),
        (config.rollout.prompts_per_step >= 1, "prompts_per_step must be >= 1"),
        (config.rollout.kv_window >= 1, "kv_window must be >= 1"),
        (config.rollout.kv_budget > config.rollout.kv_window,
         f"kv_budget ({config.rollout.kv_budget}) must exceed kv_window ({config.rollout.kv_window})"),
        (config.rollout.kv_interval >= 1, "kv_interval must be >= 1"),
        (config.rollout.alpha_bin_size >= 1, "alpha_bin_size must be >= 1"),
        (0 < config.rollout.alpha_tau <= 1, "alpha_tau must be in (0, 1]"),
        (config.rollout.temperature > 0, "temperature must be > 0 for RL sampling"),
        (config.train.steps >= 0, "steps must be >= 0"),
        (config.train.lr > 0, "lr must be > 0"),
        (config.train.minibatches >= 1, "minibatches must be >= 1"),
        (config.train.epochs >= 1, "epochs must be >= 1"),
        (0 < config.train.clip_eps < 1, "clip_eps must be in (0, 1)"),
        (config.train.clip_eps_high > 0, "clip_eps_high must be > 0"),
        (config.train.kl_coef >= 0, "kl_coef must be >= 0"),
        (config.output.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
    ]
    checks += [
        (config.train.max_rejected_steps >= 1, "max_rejected_steps must be >= 1"),
        (config.output.keep_checkpoints >= 1, "keep_checkpoints must be >= 1 (the newest is always kept)"),
        (config.output.eval_every >= 0, "eval_every must be >= 0 (0: no evaluation during training)"),
        (config.output.eval_examples >= 1, "eval_examples must be >= 1"),
        (config.task.max_new_tokens >= 0, "max_new_tokens must be >= 0 (0: the task's own response bound)"),
        (config.train.micro_batch_size >= 1, "micro_batch_size must be >= 1"),
        (config.train.reward_timeout > 0, "reward_timeout must be > 0 seconds"),
        (0 <= config.train.max_reward_failure_frac <= 1, "max_reward_failure_frac must be in [0, 1]"),
        (config.model.threads == "auto" or config.model.threads >= 0,
         "threads must be auto or >= 0 (0: torch's default)"),
        (config.rollout.max_concurrent_rows >= 0, "max_concurrent_rows must be >= 0 (0: no limit)"),
        (config.train.weight_decay >= 0, "weight_decay must be >= 0"),
        (config.train.grad_clip > 0, "grad_clip must be > 0 (the largest gradient norm an update may have)"),
        (config.train.entropy_coef >= 0, "entropy_coef must be >= 0 (a bonus for entropy; 0: none)"),
        (0 <= config.train.warn_rejected_frac <= 1, "warn_rejected_frac must be in [0, 1] (a fraction of tokens)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _validate_task_options(config.task)
    if config.rollout.rollout_kv_memory is not None:
        parse_memory(config.rollout.rollout_kv_memory)
    _validate_kv_policy(config.rollout)
    _validate_recalibration(config.rollout)
    _validate_block(config.rollout)
    _validate_full_cache(config.rollout)
    _validate_speculative(config)
    _validate_kv_dtype(config.rollout)
    _validate_workers(config.rollout)
    if config.train.distill_sparse and not load_preset(config.train.mode).sparse_rollouts:
        raise ConfigError(f"--distill-sparse needs sparse rollouts; mode {config.train.mode} samples densely")
    if config.train.distill_sparse and (config.train.distill_rank < 1 or config.train.distill_lr <= 0
                                        or config.train.distill_kl_coef < 0 or config.train.distill_alpha <= 0):
        raise ConfigError("distill_rank must be >= 1, distill_lr > 0, distill_alpha > 0 and distill_kl_coef >= 0")
    if config.rollout.recalibrate_every and not load_preset(config.train.mode).sparse_rollouts:
        raise ConfigError(f"--recalibrate-every needs sparse rollouts; mode {config.train.mode} samples densely")
    if config.rollout.kv_schedule and config.rollout.kv_schedule != "adaptive":
        from ..rollout.sparsity.budgets import BinnedBudget

        try:
            BinnedBudget.from_yaml(config.rollout.kv_schedule)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    total = config.rollout.prompts_per_step * config.rollout.group_size
    if total % config.train.minibatches:
        raise ConfigError(f"minibatches ({config.train.minibatches}) must divide prompts_per_step x group_size ({total})")


def calibration_budgets(rollout) -> list[int]:
    budgets = [coerce(b.strip(), int, "calibration_budgets") for b in rollout.calibration_budgets.split(",") if b.strip()]
    if not budgets or min(budgets) <= rollout.kv_window:
        raise ConfigError(f"calibration_budgets must list budgets above kv_window ({rollout.kv_window}), "
                          f"got {rollout.calibration_budgets!r}")
    return budgets


def _validate_recalibration(rollout) -> None:
    if rollout.alpha_every < 0:
        raise ConfigError("alpha_every must be >= 0 (0: never)")
    if rollout.kv_schedule == "adaptive" and rollout.alpha_every != 1:
        raise ConfigError("--kv-schedule adaptive follows the α tail of every step: leave --alpha-every at 1")
    if rollout.recalibrate_every < 0:
        raise ConfigError("recalibrate_every must be >= 0 (0: never)")
    if not rollout.recalibrate_every:
        return
    if rollout.kv_schedule == "adaptive":
        raise ConfigError("--recalibrate-every and --kv-schedule adaptive both set the budgets; choose one")
    if rollout.calibration_prompts < 1 or rollout.calibration_samples < 1:
        raise ConfigError("calibration_prompts and calibration_samples must be >= 1")
    calibration_budgets(rollout)


def _validate_block(rollout) -> None:
    if rollout.block_page_size < 1 or rollout.block_dense_layers < 0:
        raise ConfigError("block_page_size must be >= 1 and block_dense_layers >= 0")
    always = 3 * rollout.block_page_size  # the first page and the 2 most recent
    if rollout.sparsity == "block" and rollout.kv_budget < always:
        raise ConfigError(f"--sparsity block: kv_budget ({rollout.kv_budget}) must cover the first and the 2 most "
                          f"recent pages, at least 3 x block_page_size = {always} tokens")


def _validate_full_cache(rollout) -> None:
    if rollout.sparsity == "none" and (rollout.kv_schedule or rollout.recalibrate_every):
        raise ConfigError("--sparsity none keeps every token, so there is no budget for --kv-schedule or "
                          "--recalibrate-every to set (mode sparrow schedules one); use --sparsity eviction or block")


def _validate_speculative(config) -> None:
    from ..rollout.speculative.drafts import DRAFTS

    rollout = config.rollout
    if rollout.speculative_draft not in DRAFTS:
        raise ConfigError(f"speculative_draft {rollout.speculative_draft!r} is unknown; choose one of "
                          f"{', '.join(sorted(DRAFTS))}")
    if rollout.draft_tokens != "adaptive" and not 1 <= rollout.draft_tokens <= 64:
        raise ConfigError(f"draft_tokens must be adaptive or 1..64, got {rollout.draft_tokens}")
    if not rollout.speculative:
        return
    conflicts = [(config.train.distill_sparse, "--distill-sparse (speculative samples are dense: nothing to distill)"),
                 (bool(rollout.kv_schedule) or rollout.recalibrate_every > 0, "a budget schedule or recalibration")]
    for conflict, what in conflicts:
        if conflict:
            raise ConfigError(f"--speculative true does not combine with {what}")
    always = 3 * rollout.block_page_size
    if rollout.speculative_draft == "block" and rollout.kv_budget < always:
        raise ConfigError(f"--speculative true drafts with block attention: kv_budget ({rollout.kv_budget}) must "
                          f"cover the first and the 2 most recent pages, at least {always} tokens")


def _validate_kv_dtype(rollout) -> None:
    """A quantized cache runs alone or under any KV policy; block attention and the speculative sampler read the
    cache unquantized, and fp8 needs a torch with float8 dtypes."""
    from ..rollout.quantization import FORMATS, KV_DTYPES

    kv_dtype = rollout.kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype {kv_dtype!r} is unknown; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return
    if kv_dtype not in FORMATS:
        raise ConfigError(f"--kv-dtype {kv_dtype}: this torch has no float8_e4m3fn; use --kv-dtype int8 or auto, or "
                          "install torch >= 2.1")
    if rollout.sparsity == "block":
        raise ConfigError(f"--kv-dtype {kv_dtype} does not combine with --sparsity block (its pages are read "
                          "unquantized); use --sparsity eviction or --kv-dtype auto")
    if rollout.speculative:
        raise ConfigError(f"--kv-dtype {kv_dtype} does not combine with --speculative true (the dense verification "
                          "reads the cache unquantized); use --speculative false or --kv-dtype auto")


def _validate_workers(rollout) -> None:
    from ..rollout.dispatch.backends import BACKENDS

    if rollout.rollout_backend != "auto" and rollout.rollout_backend not in BACKENDS:
        raise ConfigError(f"rollout_backend {rollout.rollout_backend!r} is unknown; choose one of auto, "
                          f"{', '.join(sorted(BACKENDS))}")
    if rollout.rollout_backend == "ray" and not rollout.rollout_workers:
        raise ConfigError("rollout_backend ray needs --rollout-workers N (N >= 1)")
    checks = [
        (rollout.rollout_workers >= 0, "rollout_workers must be >= 0 (0: sample in this process)"),
        (rollout.rollout_shards >= 0, "rollout_shards must be >= 0 (0: one per worker)"),
        (max(rollout.rollout_shards, rollout.rollout_workers, 1) <= rollout.prompts_per_step,
         f"rollout_shards and rollout_workers must not exceed prompts_per_step ({rollout.prompts_per_step}): "
         "a shard holds whole prompt groups"),
        (rollout.rollout_timeout > 0, "rollout_timeout must be > 0 seconds"),
        (rollout.worker_gpus >= 0, "worker_gpus must be >= 0 (0: 1 / rollout_workers)"),
        (rollout.worker_cpus >= 1, "worker_cpus must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _validate_task_options(task) -> None:
    """An unknown task, an option set away from its default that the task does not take, or an option value
    its task refuses, is an error (said before any model or data loads)."""
    name = task_class(task.task).registered_name
    for key, option in TASK_OPTIONS.items():
        value = getattr(task, key)
        if name not in option.tasks:
            if value != option.default:
                raise ConfigError(f"--{key.replace('_', '-')} does not apply to task {task.task}; it is an option of "
                                  f"{', '.join(option.tasks)}")
            continue
        problem = option.check(value, task) if option.check else None
        if problem:
            raise ConfigError(problem)


def _validate_kv_policy(rollout) -> None:
    """An unknown policy, or an option set away from its default that the policy does not take, is an error;
    the policy itself checks its options' values (built here once, so a bad one fails before any model loads)."""
    from ..rollout.sparsity.policies import POLICIES

    if rollout.kv_policy not in POLICIES:
        build_policy(rollout.kv_policy, {}, rollout.kv_window)  # says what the valid names are
    for key, known in policy_options().items():
        if getattr(rollout, key) != known.default and rollout.kv_policy not in known.policies:
            raise ConfigError(f"--{key.replace('_', '-')} does not apply to kv_policy {rollout.kv_policy}; "
                              f"it is an option of {', '.join(known.policies)}")
    build_policy(rollout.kv_policy, dataclasses.asdict(rollout), rollout.kv_window)
