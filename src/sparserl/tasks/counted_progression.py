"""The counted progression: a long answer whose every line carries what the next one needs.

The prompt gives a start a (10..99), a step d (2..`max_increment`) and a count n (`min_progression_steps` to
`progression_steps`); the answer adds d to the running value n times, one numbered line per addition, then states
the result. Every `count_every`-th line also restates the count after its number (with count_every = 2):

    prompt   Start at 43 and add 7 to it 4 times, one numbered line per addition.
             (a line break)
    answer   1: 43 + 7 = 50
             2/4: 50 + 7 = 57
             3: 57 + 7 = 64
             4/4: 64 + 7 = 71
             The result is 71.

The reward is 1 only for that exact answer. Each line restates the value, the step and its number, as a reasoning
trace carries its own state, so a compression that keeps the recent lines can keep what the next line needs; when
to stop needs the count, restated at most `count_every` lines back (0: only in the prompt, where a compressed cache
loses it: SmolLM2 then ran past the count on most prompts, docs/results/paper_regime/notes.md). A larger
count_every asks the compression to keep more.

Held-out prompts are disjoint from training ones: each (a, d, n) belongs to one split by a hash, so that a model
cannot have trained on the prompts it is evaluated on (the space is small: 90 starts x 8 steps x 5 counts by
default). `walk_metrics` says how far answers got: `walk_exact` (exact answers), `answer_accuracy` (the right result
line) and `first_error_hop` (the line of the first mistake).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import (
    Example,
    TaskOption,
    exact_answer_rewards,
    line_walk_metrics,
    range_check,
    range_problems,
    register_task,
)

MAX_STEPS = 99
TEST_SHARE = 5  # one (a, d, n) in this many is held out


def demonstration(start: int, increment: int, count: int, count_every: int = 1) -> str:
    lines, value = [], start
    for step in range(1, count + 1):
        number = f"{step}/{count}" if count_every and step % count_every == 0 else str(step)
        lines.append(f"{number}: {value} + {increment} = {value + increment}")
        value += increment
    return "\n".join(lines + [f"The result is {value}."])


def split_of(start: int, increment: int, count: int) -> str:
    return "test" if zlib.crc32(f"{start},{increment},{count}".encode()) % TEST_SHARE == 0 else "train"


def prompt(start: int, increment: int, count: int) -> str:
    # The closing line break marks where the prompt ends for a model that reads it without a chat template.
    return f"Start at {start} and add {increment} to it {count} times, one numbered line per addition.\n"


def option_problems(options) -> dict[str, str]:
    """What is wrong with each option of `options` (the config's task section or the task), by key."""
    steps = options.progression_steps
    return range_problems("counted_progression", {
        "progression_steps": (1, MAX_STEPS, str(MAX_STEPS), steps),
        "min_progression_steps": (1, steps, f"progression_steps ({steps})", options.min_progression_steps),
        "max_increment": (2, 99, "99", options.max_increment),
        "count_every": (0, steps, f"progression_steps ({steps}); 0 = only in the prompt", options.count_every)})


@register_task(
    "counted_progression",
    TaskOption("progression_steps", int, 20, f"counted_progression: the largest count (1..{MAX_STEPS})",
               check=range_check(option_problems, "progression_steps")),
    TaskOption("min_progression_steps", int, 16, "counted_progression: the smallest count (1..progression_steps)",
               check=range_check(option_problems, "min_progression_steps")),
    TaskOption("max_increment", int, 9, "counted_progression: the largest step added (each is drawn from 2..it)",
               check=range_check(option_problems, "max_increment")),
    TaskOption("count_every", int, 1, "counted_progression: every k-th line restates the count (0 = never)",
               check=range_check(option_problems, "count_every")))
@dataclass(frozen=True)
class CountedProgressionTask:
    progression_steps: int = 20
    min_progression_steps: int = 16
    max_increment: int = 9
    count_every: int = 1
    name: str = "counted_progression"

    @classmethod
    def from_config(cls, config) -> CountedProgressionTask:
        return cls(progression_steps=config.progression_steps, min_progression_steps=config.min_progression_steps,
                   max_increment=config.max_increment, count_every=config.count_every)

    def __post_init__(self) -> None:
        problems = option_problems(self)
        if problems:
            raise ConfigError(next(iter(problems.values())))

    @property
    def default_max_new_tokens(self) -> int:
        """Room for the longest answer in characters (no tokenizer needs more tokens than that), and a margin."""
        digits = len(str(99 + self.progression_steps * self.max_increment))
        per_line = 2 * len(str(self.progression_steps)) + 2 * digits + len(str(self.max_increment)) + 10
        return self.progression_steps * per_line + len("The result is .") + digits + 8

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        """Training examples are drawn with replacement from the training prompts; held-out ones are distinct
        prompts (a seeded shuffle of the held-out ones, so a longer list starts with a shorter one)."""
        rng = random.Random(f"counted_progression/{split}/{seed}/{self.min_progression_steps}/"
                            f"{self.progression_steps}/{self.max_increment}")
        wanted = "test" if split == "test" else "train"
        pool = [(a, d, n) for a in range(10, 100) for d in range(2, self.max_increment + 1)
                for n in range(self.min_progression_steps, self.progression_steps + 1) if split_of(a, d, n) == wanted]
        if wanted == "test":
            if count > len(pool):
                raise ConfigError(f"counted_progression: {count} held-out prompts asked for, the settings have "
                                  f"{len(pool)}; widen --progression-steps or --max-increment")
            rng.shuffle(pool)
            chosen = pool[:count]
        else:
            chosen = [rng.choice(pool) for _ in range(count)]
        return [Example(prompt=prompt(a, d, n), label=str(a + n * d),
                        demonstration=demonstration(a, d, n, self.count_every),
                        extra={"start": a, "increment": d, "count": n}) for a, d, n in chosen]

    def reward(self, completions: list[str], demonstration: list[str], **kwargs: Any) -> list[float]:
        return exact_answer_rewards(completions, demonstration)

    def walk_metrics(self, completions: list[str], demonstrations: list[str]) -> dict[str, float]:
        return line_walk_metrics(completions, demonstrations)
