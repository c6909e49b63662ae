"""The task interface: where prompts, demonstrations and rewards come from.

A task yields `Example`s and scores completions with a TRL-style reward function,
`reward(completions, **columns) -> list[float]`, where the columns are the examples' fields
(`label`, ...) repeated to line up with the completions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass(frozen=True)
class Example:
    """One prompt with what is needed to score its completions."""

    prompt: str
    label: str
    # A correct response, for supervised warm-up; None for tasks that only have answers.
    demonstration: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class RewardFunction(Protocol):
    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]: ...


class Task(Protocol):
    """What the trainer and the evaluator need from a source of prompts."""

    name: str

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        """`count` examples, a pure function of (`count`, `seed`, `split`)."""
        ...

    def reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        """Scores in [0, 1]; kwargs carry the example columns (`label`, `extra`)."""
        ...


SOLVED = 1.0  # the task reward of a correct completion (task rewards are in [0, 1])


def is_correct(task_score: float) -> bool:
    """Whether a completion solved its example: the task's own reward gives it full marks. Only the task's
    reward decides it, never a weighted sum with other rewards (a format bonus is not a solution)."""
    return task_score >= SOLVED


@dataclass(frozen=True)
class TaskOption:
    """A setting a task takes from the config: key `key` in the task section and flag `--key`, of type
    `annotation`, with its default and one-line help. `check(value, task_config)` returns what is wrong with a
    value, or None."""

    key: str
    annotation: Any
    default: Any
    help: str
    check: Callable[[Any, Any], str | None] | None = None
    tasks: tuple[str, ...] = ()  # filled in by the registry: the tasks that take it


# name -> the task class; each class has `from_config(task_config)` for the settings of `TaskConfig`.
TASKS: dict[str, type] = {}
# key -> the option, over every registered task; tasks that share a key share its default and type.
TASK_OPTIONS: dict[str, TaskOption] = {}


def register_task(name: str, *options: TaskOption) -> Callable[[type], type]:
    """Class decorator: the task `name` in configs and on the command line (`--task NAME`), with the config
    options it takes (the config derives its task fields and flags from them)."""
    def register(cls: type) -> type:
        if not callable(getattr(cls, "from_config", None)):
            raise TypeError(f"task {name}: {cls.__name__} needs a from_config(task_config) classmethod")
        TASKS[name] = cls
        cls.registered_name = name
        for option in options:
            known = TASK_OPTIONS.get(option.key)
            if known and (known.annotation, known.default) != (option.annotation, option.default):
                raise AssertionError(f"tasks {known.tasks} and {name} give option {option.key} different types or "
                                     "defaults; one key is one setting")
            TASK_OPTIONS[option.key] = dataclasses.replace(option, tasks=(known.tasks if known else ()) + (name,))
        return cls
    return register


def walk_metrics(task: Task, completions: list[str], examples: list[Example], repeat: int = 1) -> dict[str, float]:
    """How the reward was earned, for tasks that can tell (`walk_exact`, `first_error_hop` for the
    pointer walk); an empty dict for tasks without demonstrations to compare against."""
    measure = getattr(task, "walk_metrics", None)
    if measure is None or any(e.demonstration is None for e in examples):
        return {}
    return measure(completions, [e.demonstration for e in examples for _ in range(repeat)])


def range_problems(task: str, bounds: dict[str, tuple[int, int, str, int]]) -> dict[str, str]:
    """What is wrong with each of `task`'s integer options, by key, from (lowest, highest, how the highest is said,
    value): the one message the config's check and the task's constructor both give."""
    return {key: f"{task}: --{key.replace('_', '-')} must be in {low}..{said}, got {value}"
            for key, (low, high, said, value) in bounds.items() if not low <= value <= high}


def range_check(problems_of: Callable[[Any], dict[str, str]], key: str) -> Callable[[Any, Any], str | None]:
    """The `TaskOption` check of option `key`: `problems_of(options)` reads the options by name, from the config
    as from the task itself, so that the two cannot disagree."""
    return lambda value, config: problems_of(config).get(key)


def exact_answer_rewards(completions: list[str], demonstrations: list[str]) -> list[float]:
    """1.0 for a completion that is its demonstration (surrounding white space aside), else 0.0: the reward of the
    tasks whose answer is one exact text (the running total, the counted progression)."""
    return [float(text.strip() == answer) for text, answer in zip(completions, demonstrations)]


def first_wrong_line(text: str, answer: str) -> int:
    """The index of the first line of `text` that differs from `answer`'s (a line counts whole, white space at its
    ends aside); where one is a prefix of the other, the shorter one's length."""
    written, expected = text.strip().split("\n"), answer.split("\n")
    return next((i for i, (a, b) in enumerate(zip(written, expected)) if a.strip() != b),
                min(len(written), len(expected)))


def line_prefix_credit(completions: list[str], demonstration: list[str], **kwargs: Any) -> list[float]:
    """A reward function (TRL's keywords) for line-by-line tasks: the share of the answer's lines written right
    before the first wrong one, the answer's end counting as one more line, so that only the exact answer scores
    1. It gives a group whose answers are all wrong an advantage still (the one that went further wrong later),
    where the exact-answer reward gives none: `--reward-funcs task,sparserl.tasks.base:line_prefix_credit`."""
    scores = []
    for text, answer in zip(completions, demonstration):
        lines = answer.count("\n") + 1
        scores.append(1.0 if text.strip() == answer else first_wrong_line(text, answer) / (lines + 1))
    return scores


def line_walk_metrics(completions: list[str], demonstrations: list[str]) -> dict[str, float]:
    """How far line-by-line answers got against their demonstrations: `walk_exact` (exact answers),
    `answer_accuracy` (the right last line, however reached) and, over the inexact answers only, `first_error_hop`
    (the mean index of the first line that differs; a line counts whole)."""
    exact, right_last_lines, first_errors = 0, 0, []
    for text, answer in zip(completions, demonstrations):
        right_last_lines += text.strip().split("\n")[-1].strip() == answer.split("\n")[-1]
        if text.strip() == answer:
            exact += 1
            continue
        first_errors.append(first_wrong_line(text, answer))
    count = max(len(completions), 1)
    metrics = {"walk_exact": exact / count, "answer_accuracy": right_last_lines / count}
    if first_errors:
        metrics["first_error_hop"] = sum(first_errors) / len(first_errors)
    return metrics


def reward_columns(examples: list[Example], repeat: int = 1) -> dict[str, list[Any]]:
    """The keyword columns a reward function receives for these examples, each repeated `repeat`
    times in a row to line up with grouped completions: `label`, `extra`, `demonstration` when
    every example has one, and each key of `extra` that every example has (a math JSONL file's
    other fields, say `ground_truth`), as TRL passes a dataset's columns."""
    def column(values: list[Any]) -> list[Any]:
        return [value for value in values for _ in range(repeat)]

    columns = {"label": column([e.label for e in examples]), "extra": column([e.extra for e in examples])}
    if all(e.demonstration is not None for e in examples):
        columns["demonstration"] = column([e.demonstration for e in examples])
    shared = set.intersection(*(set(e.extra) for e in examples)) if examples else set()
    for key in sorted(shared - RESERVED_COLUMNS - set(columns)):
        columns[key] = column([e.extra[key] for e in examples])
    return columns


# Keyword names a reward function receives from the trainer itself.
RESERVED_COLUMNS = frozenset({"prompts", "completions", "completion_ids"})
