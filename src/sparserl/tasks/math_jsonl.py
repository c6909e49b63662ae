"""A task read from a JSONL file of math problems, graded by math-verify.

Each non-blank line is a JSON object with a prompt and a label (the gold answer), e.g.

    {"prompt": "What is 1/4 + 1/4?", "label": "1/2"}

The key names are options (`prompt_key`, `label_key`); numeric labels are turned into strings.
The prompt shown to the model is `template.format(prompt=...)`.

Split: the records are shuffled once with a fixed seed (`split_seed`, not the `examples` seed,
so the split never moves), and the last `test_fraction` of them (at least 1) is the "test"
split, the rest "train". `examples(count, seed, split)` draws a seeded sample from that split
(see `seeded_sample`). Completions are graded by `math_verify_reward`, a plain function: the
trainer and the evaluators call it through `RewardRunner`, which bounds its time.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError, DataError
from .base import Example, TaskOption, register_task
from .grading import math_verify_reward

T = TypeVar("T")

SPLITS = ("train", "test")


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, as that format defines them: split at "\\n" only, a "\\r" before it dropped.
    Not `str.splitlines()`, which also breaks at U+2028, U+2029, U+0085 and form feed: JSON allows those raw
    inside a string, so a valid record would be cut in two."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def seeded_sample(pool: Sequence[T], count: int, rng: random.Random, split: str = "train") -> list[T]:
    """`count` items of `pool` without repeats while it lasts, then, for training, further reshuffled passes.

    Passes rather than an error when `count > len(pool)`, so a small file still fills a batch. A held-out split
    (`split` "test") is never repeated: a prompt scored twice would count twice in its accuracy, so it gives each
    item once and warns.
    """
    if not pool:
        raise DataError("cannot sample from an empty split")
    if split != "train" and count > len(pool):
        warnings.warn(f"the {split} split holds {len(pool)} example(s), fewer than the {count} asked for: each is "
                      "used once (ask for at most that many, or give a larger data file)", stacklevel=3)
        count = len(pool)
    out: list[T] = []
    while len(out) < count:
        take = min(count - len(out), len(pool))
        out.extend(rng.sample(list(pool), take))
    return out


@register_task(
    "math_jsonl",
    TaskOption("data_path", str | None, None, "math_jsonl: the JSONL file, one JSON object per line"),
    TaskOption("prompt_key", str, "prompt", "math_jsonl: the key holding the prompt"),
    TaskOption("label_key", str, "label", "math_jsonl: the key holding the answer"),
    TaskOption("template", str, "{prompt}", "math_jsonl: how the prompt is put to the model ({prompt} is replaced)"))
class MathJsonlTask:
    """Math problems from a JSONL file; the file is read and checked when the task is built."""

    @classmethod
    def from_config(cls, config) -> MathJsonlTask:
        """From a `TaskConfig`: data_path, prompt_key, label_key and template."""
        if not config.data_path:
            raise ConfigError("task math_jsonl needs --data-path FILE.jsonl (one JSON object per line)")
        return cls(path=config.data_path, prompt_key=config.prompt_key, label_key=config.label_key,
                   template=config.template)

    def __init__(
        self,
        path: str | Path,
        prompt_key: str = "prompt",
        label_key: str = "label",
        template: str = "{prompt}",
        name: str = "math_jsonl",
        test_fraction: float = 0.1,
        split_seed: int = 0,
    ) -> None:
        self.path = Path(path)
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.template = template
        self.name = name
        if not 0.0 < test_fraction < 1.0:
            raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
        try:
            template.format(prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise DataError(
                f"task.template {template!r} must use only the placeholder {{prompt}} "
                f"(write literal braces as {{{{ }}}}): {exc!r}"
            ) from None
        records = self._load()
        if len(records) < 2:
            raise DataError(f"{self.path}: {len(records)} record(s); need at least 2 for a train/test split")
        order = list(range(len(records)))
        random.Random(f"math_jsonl/split/{split_seed}").shuffle(order)
        n_test = max(1, math.floor(len(records) * test_fraction))
        self._splits: dict[str, list[Example]] = {
            "train": [records[i] for i in order[:-n_test]],
            "test": [records[i] for i in order[-n_test:]],
        }

    def _load(self) -> list[Example]:
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file; set --data-path (data_path in a config's task section)")
        try:
            lines = json_lines(self.path.read_text(encoding="utf-8-sig"))  # -sig: a leading BOM is no error
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8, "
                            "e.g. `iconv -f UTF-16 -t UTF-8 FILE > NEW`") from None
        return [self._record(line, lineno) for lineno, line in enumerate(lines, start=1) if line.strip()]

    def _record(self, line: str, lineno: int) -> Example:
        where = f"{self.path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                            "each line must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = self._field(obj, self.prompt_key, "prompt_key", where, numbers_ok=False)
        label = self._field(obj, self.label_key, "label_key", where, numbers_ok=True)
        # The record's other fields travel as reward columns, as a dataset's columns do in TRL.
        others = {k: v for k, v in obj.items() if k not in (self.prompt_key, self.label_key)}
        return Example(prompt=self.template.format(prompt=prompt), label=label,
                       extra={**others, "line": lineno})

    @staticmethod
    def _field(obj: dict[str, Any], key: str, option: str, where: str, numbers_ok: bool) -> str:
        if key not in obj:
            present = ", ".join(map(str, obj)) or "none"
            raise DataError(f"{where}: missing key {key!r} (keys present: {present}); "
                            f"set --{option.replace('_', '-')} (task.{option} in a config file)")
        value = obj[key]
        # bool is an int in Python, but `true` is never a math answer.
        if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            kinds = "a string or a number" if numbers_ok else "a string"
            raise DataError(f"{where}: key {key!r} is {type(value).__name__} {value!r}; "
                            f"it must be {kinds}")
        if not value.strip():
            raise DataError(f"{where}: key {key!r} is empty")
        return value

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        if split not in self._splits:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return seeded_sample(self._splits[split], count, rng, split)

    def reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        return math_verify_reward(completions, **kwargs)
