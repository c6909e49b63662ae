"""The built-in task: walk a pointer cycle whose links are listed in the prompt.

The prompt lists the links of a random cycle over `letters` distinct lower-case letters, each
written `xY` (key `x`, value `Y` = the upper-case form of x's successor), in shuffled order,
then `|` and the start letter. The response takes `hops` steps, writing `Yy` per step (copy the
value that follows the current key, then lower-case it as the next key), and ends with the
answer `#Y$`:

    prompt   ^sRtHrEhSlTeL|h          (letters=6)
    response SsRrEeLlTtHhSsRr#R$      (hops=8, answer R)

Why this shape: each value sits right after its key, which a small transformer learns quickly
(an induction copy), yet every step needs a link from the prompt. Once a link is evicted from
the KV cache the walk goes wrong and cannot recover, so compression hurts in proportion to how
much of the prompt it drops, late in a chain several times longer than the KV budget.
The reward is exact: 1 if the text after the last `#` is the right letter, else 0.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Any

from .base import Example

_ANSWER = re.compile(r"#([A-Za-z])\$?\s*$")


@dataclass(frozen=True)
class PointerWalkTask:
    """`letters` is the difficulty knob (cycle length, 2..26); `hops` the chain length."""

    letters: int = 12
    hops: int = 40
    name: str = "pointer_walk"

    def __post_init__(self) -> None:
        if not 2 <= self.letters <= 26:
            raise ValueError(f"task.difficulty must be in 2..26 letters, got {self.letters}")
        if self.hops < 1:
            raise ValueError(f"task.hops must be >= 1, got {self.hops}")

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        rng = random.Random(f"pointer_walk/{split}/{seed}/{self.letters}/{self.hops}")
        return [make_example(rng, self.letters, self.hops) for _ in range(count)]

    def reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        labels = kwargs["label"]
        return [float(extract_answer(c) == label) for c, label in zip(completions, labels)]

    @property
    def max_response_chars(self) -> int:
        return 2 * self.hops + 3

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
    for _ in range(hops):
        node = successor[node]
        steps.append(node.upper() + node)
    answer = node.upper()
    prompt = "^" + "".join(links) + "|" + start
    return Example(prompt=prompt, label=answer, demonstration="".join(steps) + "#" + answer + "$")


def extract_answer(completion: str) -> str | None:
    match = _ANSWER.search(completion)
    return match.group(1) if match else None
