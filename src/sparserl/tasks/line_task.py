"""The base of the line-by-line tasks (the running total, the counted progression): tasks whose answer is one exact
text written a line at a time, with integer settings bounded by each other.

What they share lives here: the settings (dataclass fields made by `line_option`, each a config option and a flag),
their range checks (one message for the config's check and the constructor's), the registration, `from_config`,
the response bound, the exact-answer reward and the walk metrics. A task says only what is its own: its settings'
bounds (`option_bounds`), its longest answer (`longest_answer_chars`) and its examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import TaskOption, exact_answer_rewards, line_walk_metrics, range_check, range_problems, register_task

# Tokens allowed beyond the longest answer's characters (no tokenizer needs more tokens than characters).
ANSWER_MARGIN = 8


def line_option(default: int, help: str) -> Any:
    """An integer setting of a line task: a dataclass field that is also the config option and flag `--key`, with
    `help` as its one-line help."""
    return dataclasses.field(default=default, metadata={"help": help})


class LineTask:
    """The shared half of a line task; the task itself is a frozen dataclass deriving from this, registered with
    `@register_line_task(NAME)`."""

    registered_name: str  # set by the registration

    @classmethod
    def option_bounds(cls, options) -> dict[str, tuple[int, int, str]]:
        """Each setting's (lowest, highest, how the highest is said), read from `options` by name: the config's task
        section or the task itself, so that the config's check and the constructor cannot disagree. In the order
        their problems are reported."""
        raise NotImplementedError

    def longest_answer_chars(self) -> int:
        """The characters of the longest answer these settings allow."""
        raise NotImplementedError

    @classmethod
    def option_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if "help" in f.metadata)

    @classmethod
    def option_problems(cls, options) -> dict[str, str]:
        """What is wrong with each setting of `options`, by key."""
        return range_problems(cls.registered_name, {key: (low, high, said, getattr(options, key))
                                                    for key, (low, high, said) in cls.option_bounds(options).items()})

    @classmethod
    def from_config(cls, config) -> LineTask:
        """From a `TaskConfig`: one field per setting."""
        return cls(**{key: getattr(config, key) for key in cls.option_keys()})

    def __post_init__(self) -> None:
        problems = self.option_problems(self)
        if problems:
            raise ConfigError(next(iter(problems.values())))

    @property
    def default_max_new_tokens(self) -> int:
        """Room for the longest answer in characters (no tokenizer needs more tokens than that), and a margin."""
        return self.longest_answer_chars() + ANSWER_MARGIN

    def reward(self, completions: list[str], demonstration: list[str], **kwargs: Any) -> list[float]:
        return exact_answer_rewards(completions, demonstration)

    def walk_metrics(self, completions: list[str], demonstrations: list[str]) -> dict[str, float]:
        return line_walk_metrics(completions, demonstrations)


def register_line_task(name: str) -> Callable[[type], type]:
    """Class decorator, above `@dataclass(frozen=True)`: the `LineTask` `name`, with one config option per
    `line_option` field (its default, its help after `name: `, checked by the task's `option_bounds`)."""
    def register(cls: type) -> type:
        options = [TaskOption(f.name, int, f.default, f"{name}: {f.metadata['help']}",
                              check=range_check(cls.option_problems, f.name))
                   for f in dataclasses.fields(cls) if "help" in f.metadata]
        return register_task(name, *options)(cls)
    return register
