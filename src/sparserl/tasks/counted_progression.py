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

from ..errors import ConfigError
from .base import Example
from .line_task import LineTask, line_option, register_line_task

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


@register_line_task("counted_progression")
@dataclass(frozen=True)
class CountedProgressionTask(LineTask):
    progression_steps: int = line_option(20, f"the largest count (1..{MAX_STEPS})")
    min_progression_steps: int = line_option(16, "the smallest count (1..progression_steps)")
    max_increment: int = line_option(9, "the largest step added (each is drawn from 2..it)")
    count_every: int = line_option(1, "every k-th line restates the count (0..min_progression_steps; 0 = never)")
    name: str = "counted_progression"

    @classmethod
    def option_bounds(cls, options) -> dict[str, tuple[int, int, str]]:
        steps, fewest = options.progression_steps, options.min_progression_steps
        # Against the smallest count, not the largest: a prompt of fewer additions than k would restate no count.
        return {"progression_steps": (1, MAX_STEPS, str(MAX_STEPS)),
                "min_progression_steps": (1, steps, f"progression_steps ({steps})"),
                "max_increment": (2, 99, "99"),
                "count_every": (0, fewest, f"min_progression_steps ({fewest}), so that every answer restates its "
                                           "count; 0 = only in the prompt")}

    def longest_answer_chars(self) -> int:
        digits = len(str(99 + self.progression_steps * self.max_increment))
        per_line = 2 * len(str(self.progression_steps)) + 2 * digits + len(str(self.max_increment)) + 10
        return self.progression_steps * per_line + len("The result is .") + digits

    def split_prompts(self, split: str = "train") -> list[tuple[int, int, int]]:
        """Every (start, step, count) of `split` ("test": the held-out ones; anything else: the training ones)."""
        wanted = "test" if split == "test" else "train"
        return [(a, d, n) for a in range(10, 100) for d in range(2, self.max_increment + 1)
                for n in range(self.min_progression_steps, self.progression_steps + 1) if split_of(a, d, n) == wanted]

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        """Training examples are drawn with replacement from the training prompts; held-out ones are distinct
        prompts (a seeded shuffle of the held-out ones, so a longer list starts with a shorter one)."""
        rng = random.Random(f"counted_progression/{split}/{seed}/{self.min_progression_steps}/"
                            f"{self.progression_steps}/{self.max_increment}")
        pool = self.split_prompts(split)
        if split == "test":
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
