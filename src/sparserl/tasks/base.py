"""The task interface: where prompts, demonstrations and rewards come from.

A task yields `Example`s and scores completions with a TRL-style reward function,
`reward(completions, **columns) -> list[float]`, where the columns are the examples' fields
(`label`, ...) repeated to line up with the completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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


def reward_columns(examples: list[Example], repeat: int = 1) -> dict[str, list[Any]]:
    """The keyword columns a reward function receives for these examples, each repeated `repeat`
    times in a row to line up with grouped completions."""
    return {"label": [e.label for e in examples for _ in range(repeat)],
            "extra": [e.extra for e in examples for _ in range(repeat)]}
