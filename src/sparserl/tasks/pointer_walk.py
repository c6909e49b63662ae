"""The built-in task: walk a pointer cycle whose links are listed in the prompt.

The prompt lists the links of a random cycle over `letters` distinct lower-case letters, each
written `xY` (key `x`, value `Y` = the upper-case form of x's successor), in shuffled order,
then `|` and the start letter. The response takes `hops` steps. Step k writes a step counter
(the k-th symbol of `COUNTERS`), the current key, and the value that follows that key in the
prompt; the value, lower-cased, is the next key. It ends with the answer `#Y$`:

    prompt   ^sRtHrEhSlTeL|h                  (letters=6)
    response 0hS1sR2rE3eL4lT5tH6hS7sR#R$      (hops=8, answer R)

Why this shape:
- each value sits right after its key, in the prompt and in the response alike, which a small
  transformer learns quickly (an induction copy), yet the first lap of the cycle needs every link
  from the prompt;
- the counter makes stopping a local decision (the previous counter is three tokens back), so
  KV eviction hurts the walk only by dropping the links it needs, not by making the model lose
  count (a first design without counters never stopped once its early tokens were evicted);
- once a needed link is evicted the walk goes wrong and cannot recover, late in a chain several
  times longer than the KV budget.
The reward is exact: 1 if the letter after the last `#` is the right one, else 0.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Any

from .base import Example

# Digits then punctuation, minus the four characters with a role in the format.
COUNTERS = string.digits + "".join(c for c in string.punctuation if c not in "^|#$")

_ANSWER = re.compile(r"#([A-Za-z])\$?\s*$")


@dataclass(frozen=True)
class PointerWalkTask:
    """`letters` is the difficulty knob (cycle length, 2..26); `hops` the chain length."""

    letters: int = 12
    hops: int = 32
    name: str = "pointer_walk"

    def __post_init__(self) -> None:
        if not 2 <= self.letters <= 26:
            raise ValueError(f"task.difficulty must be in 2..26 letters, got {self.letters}")
        if not 1 <= self.hops <= len(COUNTERS):
            raise ValueError(f"task.hops must be in 1..{len(COUNTERS)}, got {self.hops}")

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        rng = random.Random(f"pointer_walk/{split}/{seed}/{self.letters}/{self.hops}")
        return [make_example(rng, self.letters, self.hops) for _ in range(count)]

    def reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        labels = kwargs["label"]
        return [float(extract_answer(c) == label) for c, label in zip(completions, labels)]

    @property
    def max_response_chars(self) -> int:
        return 3 * self.hops + 3

    @property
    def default_max_new_tokens(self) -> int:
        # A little slack past the correct length, so a wandering chain is cut rather than padded forever.
        return self.max_response_chars + 6

    @property
    def prompt_chars(self) -> int:
        return 2 * self.letters + 3


def make_example(rng: random.Random, letters: int, hops: int) -> Example:
    nodes = rng.sample(string.ascii_lowercase, letters)
    successor = {node: nodes[(i + 1) % letters] for i, node in enumerate(nodes)}
    links = [key + successor[key].upper() for key in nodes]
    rng.shuffle(links)
    start = rng.choice(nodes)
    steps, node = [], start
    for counter in COUNTERS[:hops]:
        steps.append(counter + node + successor[node].upper())
        node = successor[node]
    answer = node.upper()
    prompt = "^" + "".join(links) + "|" + start
    return Example(prompt=prompt, label=answer, demonstration="".join(steps) + "#" + answer + "$")


def extract_answer(completion: str) -> str | None:
    match = _ANSWER.search(completion)
    return match.group(1) if match else None
