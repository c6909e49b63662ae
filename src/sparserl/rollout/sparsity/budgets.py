"""KV budgets that grow with the cached length (Sparrow's dynamic sparsity schedule).

`BudgetSchedule.budget(cached_len)` is the budget a compression uses when the cache has been fed
`cached_len` tokens (prompt plus response so far). `FixedBudget` is the classic constant budget.
`BinnedBudget` is a step function over length bins, as `sparserl calibrate` writes it:

    # schedule.yaml
    bin_size: 16          # cached-length bins [0, 16), [16, 32), ...
    budgets: [40, 48, 56, 72, 80, 96]   # one per bin; the last holds for every longer length
    tau: 0.86             # what it was calibrated for (information only)

Budgets never shrink along a schedule (a smaller budget later would evict what an earlier bin
decided to keep), so a file whose budgets decrease is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ...errors import ConfigError


class BudgetSchedule:
    def budget(self, cached_len: int) -> int:
        raise NotImplementedError

    @property
    def max_budget(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class FixedBudget(BudgetSchedule):
    value: int

    def budget(self, cached_len: int) -> int:
        return self.value

    @property
    def max_budget(self) -> int:
        return self.value


@dataclass(frozen=True)
class BinnedBudget(BudgetSchedule):
    bin_size: int
    budgets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.bin_size < 1 or not self.budgets or min(self.budgets) < 1:
            raise ConfigError(f"a schedule needs bin_size >= 1 and budgets >= 1, got {self.bin_size} and {self.budgets}")
        if any(b < a for a, b in zip(self.budgets, self.budgets[1:])):
            raise ConfigError(f"schedule budgets must not decrease along the sequence, got {list(self.budgets)}")

    def budget(self, cached_len: int) -> int:
        return self.budgets[min(max(cached_len, 0) // self.bin_size, len(self.budgets) - 1)]

    @property
    def max_budget(self) -> int:
        return self.budgets[-1]

    @classmethod
    def from_yaml(cls, path: str | Path) -> BinnedBudget:
        path = Path(path)
        held = "a schedule file holds `bin_size: N` and `budgets: [B, B, ...]` (as `sparserl calibrate` writes)"
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise ConfigError(f"--kv-schedule {path}: cannot read it ({error.strerror}); {held}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or "not YAML"
            raise ConfigError(f"--kv-schedule {path}: invalid YAML{where} ({problem}); {held}") from None
        if not isinstance(data, dict) or "bin_size" not in data or "budgets" not in data:
            raise ConfigError(f"--kv-schedule {path}: needs `bin_size` and a list `budgets` (see `sparserl calibrate`)")
        try:
            return cls(int(data["bin_size"]), tuple(int(b) for b in data["budgets"]))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"--kv-schedule {path}: {error}") from None

    def to_yaml(self, path: str | Path, **info) -> None:
        Path(path).write_text(yaml.safe_dump({"bin_size": self.bin_size, "budgets": list(self.budgets), **info},
                                             sort_keys=False))


class AdaptiveBudget:
    """The controller of `--kv-schedule adaptive`: a binned schedule that training adjusts from each step's own
    α tail. Samplers never hold it: each step samples under its `snapshot()`, a fixed `BinnedBudget`, so a
    step's budgets are those in force when it started, wherever it is sampled (here or on Ray workers).

    `update(tails)` takes {bin start: tail} of the step's rollouts. When a bin's tail fell below τ,
    every bin up to it gains `step` tokens: under eviction a late failure comes from what earlier
    compressions dropped, so raising that bin alone would not help. When every bin held τ + margin,
    every bin gives back `step` tokens (never below `floor`). Budgets stay non-decreasing along the
    sequence. The state is a plain list, saved in checkpoints.
    """

    def __init__(self, initial: int, bin_size: int, tau: float, step: int, floor: int, margin: float = 0.05):
        self.bin_size, self.tau, self.step, self.floor, self.margin = bin_size, tau, step, floor, margin
        self.budgets: list[int] = [initial]

    def snapshot(self) -> BinnedBudget:
        """The budgets in force now, as a fixed schedule."""
        return BinnedBudget(self.bin_size, tuple(self.budgets))

    def update(self, tails: dict[int, float]) -> None:
        if not tails:
            return
        last = max(tails) // self.bin_size
        while len(self.budgets) <= last:  # bins seen for the first time start at the current last budget
            self.budgets.append(self.budgets[-1])
        failing = [start // self.bin_size for start, tail in tails.items() if tail < self.tau]
        if failing:
            for i in range(max(failing) + 1):
                self.budgets[i] += self.step
        elif all(tail >= self.tau + self.margin for tail in tails.values()):
            self.budgets = [max(self.floor, b - self.step) for b in self.budgets]
        for i in range(1, len(self.budgets)):  # non-decreasing along the sequence
            self.budgets[i] = max(self.budgets[i], self.budgets[i - 1])
