"""The running total: a real-model cousin of the pointer walk, where every line of the answer reads the prompt.

The prompt lists n one-digit numbers (n drawn per prompt from `min_operands` to `operands`); the answer adds them
one at a time, a line per number, then states the total:

    prompt   Add these numbers one at a time, from left to right, writing the running total after each.
             Numbers: 7, 3, 9, 2
    answer   7
             7 + 3 = 10
             10 + 9 = 19
             19 + 2 = 21
             The total is 21.

The reward is 1 only for that exact answer (every line, then the total), 0 otherwise. Each line needs the next
number of the list, which only the prompt holds, so a compressed cache that dropped it breaks the line; and since
n varies and is not stated, the answer must read where the list ends. With 16-20 numbers an answer is about 150-210
tokens of SmolLM2's tokenizer (one token per digit): several times a KV budget of 64. `walk_metrics` says how far
answers got: `walk_exact` (exact answers) and `first_error_hop` (the line of the first mistake).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import Example, TaskOption, register_task

INSTRUCTION = "Add these numbers one at a time, from left to right, writing the running total after each."


def demonstration(numbers: list[int]) -> str:
    """The exact answer for `numbers`: the first number, a line per addition, then the total."""
    lines, total = [str(numbers[0])], numbers[0]
    for number in numbers[1:]:
        lines.append(f"{total} + {number} = {total + number}")
        total += number
    return "\n".join(lines + [f"The total is {total}."])


@register_task(
    "running_total",
    TaskOption("operands", int, 20, "running_total: the most numbers a prompt lists (2..64)",
               check=lambda v, c: None if 2 <= v <= 64 else "operands must be in 2..64"),
    TaskOption("min_operands", int, 16, "running_total: the fewest numbers a prompt lists (2..operands)",
               check=lambda v, c: None if 2 <= v <= c.operands else "min_operands must be in 2..operands"),
    TaskOption("max_operand", int, 9, "running_total: the largest number (each is drawn from 1..max_operand)",
               check=lambda v, c: None if 1 <= v <= 999 else "max_operand must be in 1..999"))
@dataclass(frozen=True)
class RunningTotalTask:
    operands: int = 20
    min_operands: int = 16
    max_operand: int = 9
    name: str = "running_total"

    @classmethod
    def from_config(cls, config) -> RunningTotalTask:
        return cls(operands=config.operands, min_operands=config.min_operands, max_operand=config.max_operand)

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.operands:
            raise ConfigError(f"running_total: min_operands ({self.min_operands}) must be in 2..operands "
                              f"({self.operands})")

    @property
    def default_max_new_tokens(self) -> int:
        """Room for the longest answer in characters (no tokenizer needs more tokens than that), and a margin."""
        digits = len(str(self.operands * self.max_operand))
        per_line = 2 * digits + len(str(self.max_operand)) + 7  # "total + n = total\n"
        return self.operands * per_line + len("The total is .") + digits + 8

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        rng = random.Random(f"running_total/{split}/{seed}/{self.min_operands}/{self.operands}/{self.max_operand}")
        out = []
        for _ in range(count):
            numbers = [rng.randint(1, self.max_operand) for _ in range(rng.randint(self.min_operands, self.operands))]
            out.append(Example(prompt=f"{INSTRUCTION}\nNumbers: {', '.join(map(str, numbers))}",
                               label=str(sum(numbers)), demonstration=demonstration(numbers),
                               extra={"numbers": numbers}))
        return out

    def reward(self, completions: list[str], demonstration: list[str], **kwargs: Any) -> list[float]:
        """1.0 for a completion that is its demonstration (surrounding white space aside), else 0.0."""
        return [float(text.strip() == answer) for text, answer in zip(completions, demonstration)]

    def walk_metrics(self, completions: list[str], demonstrations: list[str]) -> dict[str, float]:
        """As the pointer walk's: `walk_exact` (the share of exact answers), `answer_accuracy` (the share whose
        last line states the right total, however it got there) and, over the inexact answers only,
        `first_error_hop` (the mean index of the first line that differs from the demonstration)."""
        exact, right_totals, first_errors = 0, 0, []
        for text, answer in zip(completions, demonstrations):
            written, expected = text.strip().split("\n"), answer.split("\n")
            right_totals += written[-1].strip() == expected[-1]
            if text.strip() == answer:
                exact += 1
                continue
            first_errors.append(next((i for i, (a, b) in enumerate(zip(written, expected)) if a.strip() != b),
                                     min(len(written), len(expected))))
        count = max(len(completions), 1)
        metrics = {"walk_exact": exact / count, "answer_accuracy": right_totals / count}
        if first_errors:
            metrics["first_error_hop"] = sum(first_errors) / len(first_errors)
        return metrics
