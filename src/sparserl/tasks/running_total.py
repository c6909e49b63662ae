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

`restate_every` = k > 0 lets the answer carry its own state, as a reasoning trace restates what it still needs:
every k-th addition line ends with the numbers still to add, and the prompt says so. With k = 2:

    prompt   Keep a running total of these numbers; after every 2 sums, list the numbers left.
             7, 3, 9, 2, 5
             (a line break)
    answer   7
             7 + 3 = 10
             10 + 9 = 19; left: 2, 5
             19 + 2 = 21
             21 + 5 = 26
             The total is 26.

(A k-th line with nothing left to add, 21 + 5 = 26 here, restates nothing.) Past the first restatement a line
needs nothing older than k lines of the answer, so a compression that keeps recent lines can keep what each line
needs; a larger k asks it to keep more. k = 0, the default, is the format above byte for byte, so that the
earlier study's prompts and answers reproduce. The k > 0 prompt is shorter than k = 0's (19 tokens of instruction and
line breaks against 24 + 13 for k = 0's with the rule added): a KV budget must hold the longest prompt, and the answer
must be several budgets long, so every prompt token costs three answer tokens. Its closing line break marks where
the list ends for a model that reads it without a chat template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Example
from .line_task import LineTask, line_option, register_line_task

INSTRUCTION = "Add these numbers one at a time, from left to right, writing the running total after each."
RESTATE_MARK = "; left: "
MAX_OPERANDS = 64
MAX_OPERAND = 999


def demonstration(numbers: list[int], restate_every: int = 0) -> str:
    """The exact answer for `numbers`: the first number, a line per addition (every `restate_every`-th one ending
    with the numbers still to add, when any are), then the total."""
    lines, total = [str(numbers[0])], numbers[0]
    for index, number in enumerate(numbers[1:], start=1):
        line = f"{total} + {number} = {total + number}"
        left = numbers[index + 1:]
        if restate_every and index % restate_every == 0 and left:
            line += RESTATE_MARK + ", ".join(map(str, left))
        lines.append(line)
        total += number
    return "\n".join(lines + [f"The total is {total}."])


def prompt(numbers: list[int], restate_every: int = 0) -> str:
    listed = ", ".join(map(str, numbers))
    if not restate_every:
        return f"{INSTRUCTION}\nNumbers: {listed}"
    every = "each sum" if restate_every == 1 else f"every {restate_every} sums"
    return f"Keep a running total of these numbers; after {every}, list the numbers left.\n{listed}\n"


@register_line_task("running_total")
@dataclass(frozen=True)
class RunningTotalTask(LineTask):
    operands: int = line_option(20, f"the most numbers a prompt lists (2..{MAX_OPERANDS})")
    min_operands: int = line_option(16, "the fewest numbers a prompt lists (2..operands)")
    max_operand: int = line_option(9, f"the largest number (each is drawn from 1..{MAX_OPERAND})")
    restate_every: int = line_option(0, "every k-th line of the answer also lists the numbers still to add "
                                        "(0..operands - 2; 0 = never)")
    name: str = "running_total"

    @classmethod
    def option_bounds(cls, options) -> dict[str, tuple[int, int, str]]:
        operands = options.operands
        return {"operands": (2, MAX_OPERANDS, str(MAX_OPERANDS)),
                "min_operands": (2, operands, f"operands ({operands})"),
                "max_operand": (1, MAX_OPERAND, str(MAX_OPERAND)),
                # the last line with a number still to add is line operands - 2: a larger k would never restate
                "restate_every": (0, max(operands - 2, 0), f"operands - 2 ({max(operands - 2, 0)}); 0 = never")}

    def longest_answer_chars(self) -> int:
        digits = len(str(self.operands * self.max_operand))
        per_line = 2 * digits + len(str(self.max_operand)) + 7  # "total + n = total\n"
        chars = self.operands * per_line + len("The total is .") + digits
        if self.restate_every:
            # restated lines k, 2k, ... list operands - 1 - line numbers each, at most
            listed = sum(self.operands - 1 - line for line in range(self.restate_every, self.operands - 1,
                                                                      self.restate_every))
            restated = len(range(self.restate_every, self.operands - 1, self.restate_every))
            chars += restated * len(RESTATE_MARK) + listed * (len(str(self.max_operand)) + 2)
        return chars

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        # The seed string leaves restate_every out: the same seed lists the same numbers at every k, so that
        # settings of k can be compared prompt for prompt.
        rng = random.Random(f"running_total/{split}/{seed}/{self.min_operands}/{self.operands}/{self.max_operand}")
        out = []
        for _ in range(count):
            numbers = [rng.randint(1, self.max_operand) for _ in range(rng.randint(self.min_operands, self.operands))]
            out.append(Example(prompt=prompt(numbers, self.restate_every),
                               label=str(sum(numbers)), demonstration=demonstration(numbers, self.restate_every),
                               extra={"numbers": numbers}))
        return out
