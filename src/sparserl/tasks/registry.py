"""Tasks by name, for configs and code: `task_from_config(task_config)`, `build_task("pointer_walk", letters=8)`.

Each task class registers itself with `@register_task(NAME)` (`tasks/base.py`) and builds itself from a
`TaskConfig` with its `from_config`; importing this module imports every task module, so `TASKS` is
complete. `gym:<dataset>` names a reasoning-gym dataset directly.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import ConfigError
from . import counted_progression, gym, math_jsonl, pointer_walk, running_total  # noqa: F401 - each registers its task
from .base import TASK_OPTIONS, TASKS, Task  # noqa: F401 - TASK_OPTIONS: complete once every task is imported
from .chat import ChatPrompts
from .gym import GYM_PREFIX


def task_names() -> list[str]:
    """What `--task` accepts."""
    return [*TASKS, f"{GYM_PREFIX}<dataset>"]


def task_class(name: str) -> type:
    """The registered class of task `name` (`gym:<dataset>` is reasoning_gym), or a ConfigError naming the valid ones."""
    key = "reasoning_gym" if name.startswith(GYM_PREFIX) else name
    if key not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid: {', '.join(task_names())}")
    return TASKS[key]


def task_from_config(config, tokenizer=None) -> Task:
    """The task a `TaskConfig` describes (see `sparserl.config.schema.TaskConfig`); its prompts in
    `tokenizer`'s chat template when the config asks for it."""
    task = task_class(config.task).from_config(config)
    if config.chat_template:
        if tokenizer is None:
            raise ValueError("chat_template: pass the model's tokenizer, whose template the prompts take")
        return ChatPrompts(task, tokenizer)
    return task


def build_task(name: str, **options: Any) -> Task:
    """The task called `name`, built with `options` (its class's constructor arguments)."""
    cls = task_class(name)
    if name.startswith(GYM_PREFIX):
        if "dataset" in options:
            raise ConfigError(f"task {name}: give the dataset in the name or as an option, not both")
        options["dataset"] = name[len(GYM_PREFIX):]
    # A misspelt option should name the valid ones, not surface as a bare TypeError.
    accepted = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"task {name}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(accepted)}")
    missing = [p.name for p in inspect.signature(cls).parameters.values()
               if p.default is inspect.Parameter.empty and p.name not in options]
    if missing:
        raise ConfigError(f"task {name} needs the option(s) {', '.join(missing)}")
    return cls(**options)


DEFAULT_MAX_NEW_TOKENS = 256


def max_new_tokens(config, task: Task) -> int:
    """The configured response bound, else the task's own, else a general default."""
    return config.max_new_tokens or getattr(task, "default_max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
