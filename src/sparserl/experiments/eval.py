"""`sparserl eval`: held-out accuracy of a model, a run or a checkpoint, under dense or sparse inference.

Sparse inference is the config's sampler: its KV policy (or block attention) and its KV storage (`kv_dtype`, fp8 or
int8 quantized; a `--kv-budget` above every sequence leaves the quantization alone). Writes the JSON that
`sparserl eval` prints: accuracy, pass@k (unbiased estimator), token counts,
the reward failures met while scoring, the KV figures of the rollouts, and with `--inference both` the KV saved:
1 − the sparse greedy rollouts' peak bytes / the dense ones' on the same prompts (the evaluation itself is
`train.evaluation.evaluate_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..rollout.batch import kv_saved
from ..rollout.dispatch.scheduler import RowLimits
from ..rollout.sparsity.settings import sparsity_from_config
from ..tasks.base import Example, Task
from ..train.evaluation import evaluate_policy, task_rewards
from ..train.layout import CHECKPOINT_DIR, CONFIG_FILE, POLICY_DIR


def resolve_model(path: str | None) -> tuple[str | None, Path | None]:
    """(model directory, the saved run config that goes with it) for `--model`, which may name a
    plain model directory, a run directory (its latest intact checkpoint), a checkpoint or its policy."""
    from ..train.checkpoint import latest_good_checkpoint

    if path is None:
        return None, None
    given = Path(path).expanduser()
    if (given / CHECKPOINT_DIR).is_dir():
        checkpoint = latest_good_checkpoint(given)
        if checkpoint is None:
            raise UserError(f"--model {given} is a run directory without an intact checkpoint; "
                                    "train it further or pass a checkpoint's policy directory")
        return str(checkpoint / POLICY_DIR), checkpoint / CONFIG_FILE
    if (given / POLICY_DIR).is_dir() and (given / CONFIG_FILE).exists():
        return str(given / POLICY_DIR), given / CONFIG_FILE
    if given.name == POLICY_DIR and (given.parent / CONFIG_FILE).exists():
        return str(given), given.parent / CONFIG_FILE
    return str(given), None


def config_for_eval(config_file: str | None, overrides: dict):
    """The config `sparserl eval` runs with: the run's saved one when --model names a run or a
    checkpoint (its task, data, sampling and KV settings), then --config, then the flags."""
    from ..config.schema import load_config, read_yaml

    model, saved = resolve_model(overrides.get("model"))
    overrides = dict(overrides)
    if model is not None:
        overrides["model"] = model
    if saved is None:
        return load_config(config_file, overrides)
    base = {k: v for k, v in read_yaml(saved).items() if k not in ("model", "out")}
    if config_file is not None:
        base.update(read_yaml(Path(config_file)))
    return load_config(None, {**base, **overrides})


@dataclass
class HeldOut:
    """What an inference-only command works on: the model in eval mode, its task, held-out examples, and
    the limits on rows decoding at once (`--rollout-kv-memory`, `--max-concurrent-rows`)."""

    model: object
    tokenizer: object
    task: Task
    examples: list[Example]
    max_new_tokens: int
    limits: RowLimits


def held_out(config, n: int) -> HeldOut:
    """The model, task and `n` held-out (test split) examples that `config` names, threads set."""
    from ..model.loading import load_policy, resolve_device
    from ..model.threads import set_threads
    from ..tasks.registry import max_new_tokens as response_bound
    from ..tasks.registry import task_from_config

    device = resolve_device(config.model.device)
    model, tokenizer = load_policy(config.model.model, getattr(torch, config.model.dtype), device)
    set_threads(config.model.threads, model)
    task = task_from_config(config.task, tokenizer)
    return HeldOut(model.eval(), tokenizer, task, task.examples(n, seed=config.train.seed, split="test"),
                   response_bound(config.task, task), RowLimits.from_rollout_config(config.rollout, device))


def run_eval(config, n: int, samples: int, inference: str, measure_alpha: bool = True,
             answers: list[dict] | None = None) -> dict:
    """The `sparserl eval` report for `config`'s model and task; see the module docstring. `answers`, if given,
    gets every greedy answer, each with the inference that wrote it."""
    setup = held_out(config, n)
    model, tokenizer, task, examples, max_new_tokens = (setup.model, setup.tokenizer, setup.task, setup.examples,
                                                        setup.max_new_tokens)
    modes = ["dense", "sparse"] if inference == "both" else [inference]
    report: dict = {"model": config.model.model or "built-in", "task": task.name, "examples": len(examples),
                    "max_new_tokens": max_new_tokens}
    for mode in modes:
        compression = sparsity_from_config(config.rollout) if mode == "sparse" else None
        rewards = task_rewards(config, task)
        written: list[dict] = []
        part = evaluate_policy(model, tokenizer, task, examples, max_new_tokens, compression, samples,
                               config.rollout.temperature, config.train.seed, progress=True,
                               alpha_bin_size=config.rollout.alpha_bin_size, rewards=rewards, limits=setup.limits,
                               measure_alpha=measure_alpha, answers=written,
                               kv_dtype=config.rollout.kv_dtype if mode == "sparse" else "auto")
        if answers is not None:
            answers.extend({"inference": mode, **record} for record in written)
        part.update({key: rewards.counts[key] for key in ("reward_failures", "reward_timeouts")})
        report[mode] = part
    headline = report[modes[0]]
    report.update(headline)
    report["inference"] = modes[0] if len(modes) == 1 else "both (headline: dense)"
    if "sparse" in report:
        report["kv_saved"] = kv_saved(report["sparse"]["kv"]["kv_peak_bytes"],
                                      report["dense"]["kv"]["kv_peak_bytes"] if "dense" in report else None)
        if report["kv_saved"] is None:
            report["kv_saved_note"] = "no dense run on these prompts: --inference both measures the dense peak"
    return report
