"""Tasks by name, for configs: `build_task("pointer_walk", letters=8)`, `build_task("gym:chain_sum")`.

Names: "pointer_walk" (letters, min_letters), "math_jsonl" (path, prompt_key, label_key, template, ...),
"gym:<dataset>" or "reasoning_gym" with a `dataset` option (size, config, ...).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .base import Task

NAMES = ("pointer_walk", "math_jsonl", "gym:<dataset>", "reasoning_gym")


def _pointer_walk(**options: Any) -> Task:
    from .pointer_walk import PointerWalkTask

    return _call(PointerWalkTask, "pointer_walk", options)


def _math_jsonl(**options: Any) -> Task:
    from .math_jsonl import MathJsonlTask

    return _call(MathJsonlTask, "math_jsonl", options)


def _reasoning_gym(**options: Any) -> Task:
    from .gym import ReasoningGymTask

    if "dataset" not in options:
        raise ValueError("task reasoning_gym needs a `dataset` option (e.g. chain_sum), "
                         "or use the name gym:<dataset>")
    return _call(ReasoningGymTask, "reasoning_gym", options)


def _call(cls: Callable[..., Task], name: str, options: dict[str, Any]) -> Task:
    # A misspelt option should name the valid ones, not surface as a bare TypeError.
    accepted = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"task {name}: unknown option(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(accepted)}")
    return cls(**options)


def build_task(name: str, **options: Any) -> Task:
    """The task called `name`, built with `options`."""
    if name.startswith("gym:"):
        if "dataset" in options:
            raise ValueError(f"task {name}: give the dataset in the name or as an option, not both")
        return _reasoning_gym(dataset=name[len("gym:"):], **options)
    builders = {"pointer_walk": _pointer_walk, "math_jsonl": _math_jsonl,
                "reasoning_gym": _reasoning_gym}
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(NAMES)}")
    return builders[name](**options)


DEFAULT_MAX_NEW_TOKENS = 256


def task_from_config(config) -> Task:
    """The task a `TaskConfig` describes (see `sparserl.config.schema.TaskConfig`)."""
    if config.task == "pointer_walk":
        return build_task("pointer_walk", letters=config.difficulty, min_letters=config.min_difficulty or None)
    if config.task == "math_jsonl":
        if not config.data_path:
            raise ValueError("task math_jsonl needs --data-path FILE.jsonl (one JSON object per line)")
        return build_task("math_jsonl", path=config.data_path, prompt_key=config.prompt_key,
                          label_key=config.label_key, template=config.template)
    if config.task == "reasoning_gym":
        return build_task("reasoning_gym", dataset=config.gym_dataset)
    return build_task(config.task)


def max_new_tokens(config, task: Task) -> int:
    """The configured response bound, else the task's own, else a general default."""
    return config.max_new_tokens or getattr(task, "default_max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
