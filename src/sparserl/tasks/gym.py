"""A task backed by one of reasoning-gym's procedural datasets (generated locally, no network).

Each split is a fixed pool of `size` items: `reasoning_gym.create_dataset(dataset, size=size,
seed=..., **config)`, with seed `data_seed` for "train" and `data_seed + size` for "test".
reasoning-gym builds item i from `Random(seed + i)`, so those seeds give disjoint streams; test
items whose question also occurs in train are dropped as well. `examples(count, seed, split)`
draws a seeded sample from the pool, as `MathJsonlTask` does.

The prompt is the question followed by `ANSWER_INSTRUCTION`:

    <question>
    Give your final answer inside <answer></answer> tags, e.g. <answer>42</answer>.

The label is `str(entry["answer"])`, and `extra["entry"]` holds the raw item, because the score
is the dataset's own `score_answer(extract_answer(completion), entry)`: in [0, 1], and partial
for some datasets (chain_sum gives a little credit to a near miss).
"""

from __future__ import annotations

import random
from typing import Any

from ..errors import ConfigError
from .base import Example, TaskOption, register_task
from .grading import completion_text
from .math_jsonl import SPLITS, seeded_sample

GYM_PREFIX = "gym:"  # `gym:<dataset>` names a reasoning-gym dataset directly

ANSWER_INSTRUCTION = "Give your final answer inside <answer></answer> tags, e.g. <answer>42</answer>."
PROMPT_TEMPLATE = "{question}\n" + ANSWER_INSTRUCTION


def dataset_names() -> list[str]:
    """All reasoning-gym dataset names, sorted."""
    import reasoning_gym  # lazy: it takes about a second and pulls in sympy and matplotlib

    return sorted(reasoning_gym.factory.DATASETS)


@register_task("reasoning_gym", TaskOption("gym_dataset", str, "chain_sum", "reasoning_gym: the dataset name"))
class ReasoningGymTask:
    """`dataset` is a reasoning-gym name (e.g. chain_sum); `config` its config fields."""

    @classmethod
    def from_config(cls, config) -> ReasoningGymTask:
        """From a `TaskConfig`: gym_dataset, or the dataset named in `task: gym:<dataset>`."""
        name = config.task
        return cls(dataset=name[len(GYM_PREFIX):] if name.startswith(GYM_PREFIX) else config.gym_dataset)

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        config: dict[str, Any] | None = None,
        name: str | None = None,
        data_seed: int = 0,
    ) -> None:
        if size < 1:
            raise ConfigError(f"size must be >= 1, got {size}")
        names = dataset_names()
        if dataset not in names:
            close = [n for n in names if dataset.lower() in n or n in dataset.lower()]
            raise ConfigError(
                f"unknown reasoning-gym dataset {dataset!r}; "
                + (f"did you mean {', '.join(close[:5])}? " if close else "")
                + f"e.g. {', '.join(['chain_sum', 'basic_arithmetic', 'countdown', 'leg_counting'])}. "
                f"All {len(names)}: python -c 'from sparserl.tasks.gym import dataset_names; "
                f"print(dataset_names())'"
            )
        self.dataset = dataset
        self.size = size
        self.config = dict(config or {})
        self.name = name or f"gym:{dataset}"
        self.data_seed = data_seed
        self._datasets: dict[str, Any] = {}
        self._pools: dict[str, list[Example]] = {}
        # Fail on a bad config now, not at the first training step.
        self._dataset("train")

    def _dataset(self, split: str) -> Any:
        if split not in self._datasets:
            import reasoning_gym

            seed = self.data_seed + (self.size if split == "test" else 0)
            try:
                self._datasets[split] = reasoning_gym.create_dataset(
                    self.dataset, size=self.size, seed=seed, **self.config
                )
            except TypeError as exc:  # an unknown config field
                raise ConfigError(f"bad config for reasoning-gym dataset {self.dataset!r}: {exc}") from None
        return self._datasets[split]

    def _pool(self, split: str) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._pools:
            items = list(self._dataset(split))
            if split == "test":
                seen = {e.extra["entry"]["question"] for e in self._pool("train")}
                items = [item for item in items if item["question"] not in seen]
                if not items:
                    raise ConfigError(f"{self.name}: every test item also occurs in train; "
                                     "raise size or loosen the config")
            self._pools[split] = [
                Example(prompt=PROMPT_TEMPLATE.format(question=item["question"]),
                        label=str(item["answer"]), extra={"entry": item})
                for item in items
            ]
        return self._pools[split]

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return seeded_sample(self._pool(split), count, rng, split)

    def reward(self, completions: list[Any], **kwargs: Any) -> list[float]:
        from reasoning_gym.utils import extract_answer

        scorer = self._dataset("train")  # score_answer is per dataset, not per item
        return [
            float(scorer.score_answer(extract_answer(completion_text(c)), extra["entry"]))
            for c, extra in zip(completions, kwargs["extra"], strict=True)
        ]
