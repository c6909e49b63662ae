"""The built-in task: follow a pointer chain whose links are listed in the prompt.

The prompt lists the links of a random cycle over n distinct lower-case letters, each written
`xY` (key `x`, value `Y` = the upper-case form of x's successor), in shuffled order; then `|`,
the start letter, and the counter symbol of the last hop to take. The response takes H hops:
hop k writes the k-th symbol of `COUNTERS`, the current key, and the value that follows that key
in the prompt; the value, lower-cased, is the next key. It ends with the answer `#Y$`:

    prompt   ^sRtHrEhSlTeL|h4                 (n = 6 letters, last counter 4: H = 5 hops)
    response 0hS1sR2rE3eL4lT#T$               (answer T)

Each prompt draws its own cycle length n (from `min_letters` to `letters`, the difficulty knob)
and its own hop count H (from ceil(n/3) to n - 1). Why this shape:
- H < n: the walk never completes a lap, so every hop needs a link that only the prompt holds.
  A model cannot copy its own earlier output (no period exists to exploit), which is what the
  first version of this task allowed: with a fixed 12-cycle and 32 hops, looping back with a
  period of 8 landed on the right letter every time (32 = 8 mod 12) without following a link.
- H and n vary per prompt and H is stated in the prompt, so stopping is a decision that reads
  the prompt, and no fixed hop count, period, offset or constant answer scores above chance.
  `tests/test_pointer_walk.py` plays those shortcut policies to prove it.
- Each value sits right after its key, in the prompt and in the response alike, which a small
  transformer learns quickly (an induction copy).
- Once a needed link is evicted from the KV cache, the walk cannot recover it.
The reward is exact: 1 if the response is the walk itself (every counter, key and value, the end
marker and the answer), else 0. A reward on the final letter alone was tried and dropped: GRPO
then let the counters drift (doubled or skipped counter symbols in 14% of rewarded responses
after 60 steps), since nothing paid for them. `walk_metrics` reports the final-letter accuracy
beside the exact walks, where it first deviates, so that a gap between the two stays visible.
"""

from __future__ import annotations

import math
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import Example, TaskOption, register_task

# Digits then punctuation, minus the four characters with a role in the format.
COUNTERS = string.digits + "".join(c for c in string.punctuation if c not in "^|#$")
HOP_CHARS = 3  # counter, key, value

_ANSWER = re.compile(r"#([A-Za-z])\$?\s*$")


@dataclass(frozen=True)
@register_task(
    "pointer_walk",
    TaskOption("difficulty", int, 26, "pointer_walk: the longest cycle (3..26); each prompt draws its own length "
               "and hop count", check=lambda v, c: None if 3 <= v <= 26 else
               "difficulty must be in 3..26 (letters in the longest cycle)"),
    TaskOption("min_difficulty", int, 0, "pointer_walk: the shortest cycle; 0 = difficulty - 10 (at least 3)",
               check=lambda v, c: None if v == 0 or 3 <= v <= c.difficulty else
               "min_difficulty must be 0 (difficulty - 10) or in 3..difficulty"))
class PointerWalkTask:
    """`letters` is the difficulty knob: the longest cycle (3..26). Cycle lengths are drawn from
    `min_letters` (default: letters - 10, at least 3) to `letters`."""

    letters: int = 26
    min_letters: int | None = None
    name: str = "pointer_walk"

    @classmethod
    def from_config(cls, config) -> PointerWalkTask:
        """From a `TaskConfig`: its difficulty and min_difficulty (0: difficulty - 10)."""
        return cls(letters=config.difficulty, min_letters=config.min_difficulty or None)

    def __post_init__(self) -> None:
        if not 3 <= self.letters <= 26:
            raise ConfigError(f"task.difficulty (letters) must be in 3..26, got {self.letters}")
        if self.min_letters is not None and not 3 <= self.min_letters <= self.letters:
            raise ConfigError(f"task.min_letters must be in 3..{self.letters} (the difficulty), got {self.min_letters}")

    @property
    def letter_range(self) -> tuple[int, int]:
        low = self.min_letters if self.min_letters is not None else max(3, self.letters - 10)
        return low, self.letters

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        low, high = self.letter_range
        rng = random.Random(f"pointer_walk2/{split}/{seed}/{low}/{high}")
        return [make_example(rng, rng.randint(low, high)) for _ in range(count)]

    def reward(self, completions: list[str], demonstration: list[str], **kwargs: Any) -> list[float]:
        """1.0 for a completion that is its demonstration (a trailing `$` optional), else 0.0."""
        return [float(first_error_hop(c, d) is None) for c, d in zip(completions, demonstration)]

    def walk_metrics(self, completions: list[str], demonstrations: list[str]) -> dict[str, float]:
        """`walk_exact`: the fraction of completions equal to the demonstration (the whole walk and
        the answer); `answer_accuracy`: the fraction whose final letter is right, however reached;
        `first_error_hop`: mean 1-based hop of the first deviation over the inexact ones."""
        errors = [first_error_hop(c, d) for c, d in zip(completions, demonstrations)]
        wrong = [e for e in errors if e is not None]
        answers = [extract_answer(c) == extract_answer(d) for c, d in zip(completions, demonstrations)]
        out = {"walk_exact": 1.0 - len(wrong) / max(len(errors), 1),
               "answer_accuracy": sum(answers) / max(len(answers), 1)}
        if wrong:
            out["first_error_hop"] = sum(wrong) / len(wrong)
        return out

    @property
    def max_response_chars(self) -> int:
        return HOP_CHARS * (self.letters - 1) + 3

    @property
    def default_max_new_tokens(self) -> int:
        # A little slack past the longest correct response, so a wandering chain is cut rather than run forever.
        return self.max_response_chars + 6


def hop_range(letters: int) -> tuple[int, int]:
    """Hops for a cycle of `letters`: at least a third of it, never a full lap."""
    return max(1, math.ceil(letters / 3)), letters - 1


def make_example(rng: random.Random, letters: int) -> Example:
    """One prompt over a cycle of `letters` letters with a hop count drawn from `hop_range`."""
    hops = rng.randint(*hop_range(letters))
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
    prompt = "^" + "".join(links) + "|" + start + COUNTERS[hops - 1]
    return Example(prompt=prompt, label=answer, demonstration="".join(steps) + "#" + answer + "$",
                   extra={"letters": letters, "hops": hops})


def extract_answer(completion: str) -> str | None:
    match = _ANSWER.search(completion)
    return match.group(1) if match else None


def first_error_hop(completion: str, demonstration: str) -> int | None:
    """None if `completion` is the demonstration (a trailing `$` optional), else the 1-based hop
    whose three characters first differ; a deviation at or after the `#` counts as hop H + 1."""
    done, target = completion.removesuffix("$"), demonstration.removesuffix("$")
    if done == target:
        return None
    at = next((i for i, (a, b) in enumerate(zip(done, target)) if a != b), min(len(done), len(target)))
    hops = target.index("#") // HOP_CHARS
    return min(at // HOP_CHARS, hops) + 1


def needed_source(prompt: str, demonstration: str, index: int) -> tuple[str, str | None, int | None]:
    """What response character `index` of the demonstration is, and where its information lives.

    Returns (role, "prompt" | "response" | None, character index there): a value copies the
    character after its key in the prompt; a key is the previous value lower-cased (the start
    letter for the first hop); a counter follows the previous counter; the end marker `#` is
    decided by the prompt's last-counter symbol; the answer repeats the last value.
    """
    hops = demonstration.index("#") // HOP_CHARS
    if index >= HOP_CHARS * hops:
        return ("end marker", "prompt", len(prompt) - 1) if index == HOP_CHARS * hops else \
            ("answer", "response", HOP_CHARS * hops - 1)
    hop, slot = divmod(index, HOP_CHARS)
    if slot == 0:
        return ("counter", "response", index - HOP_CHARS) if hop else ("counter", None, None)
    if slot == 1:
        return ("key", "response", index - 2) if hop else ("key", "prompt", len(prompt) - 2)
    key = demonstration[index - 1]
    return "value", "prompt", prompt.index(key, 1, prompt.index("|")) + 1
