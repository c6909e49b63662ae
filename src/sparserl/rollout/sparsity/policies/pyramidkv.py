"""PyramidKV (Cai et al., 2024): SnapKV's scores with budgets that shrink with depth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ....errors import ConfigError
from .base import option, register
from .snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV scores with budgets that shrink linearly with depth (PyramidKV, Cai et al. 2024).

    As the reference, the part of the budget above the window, E = budget - window, runs from
    top = 2E - bottom at layer 0 down to bottom = max(1, floor(E / beta)) at the last layer; the
    arithmetic sequence has mean E, and rounding down keeps the total <= num_layers * budget.
    Every layer keeps >= window + 1. `window` is the compression's window, which the engine sets.
    """

    name: ClassVar[str] = "pyramidkv"
    beta: float = option(20.0, "pyramidkv: how steeply budgets shrink with depth (the last layer keeps "
                               "(budget - window) / beta above the window; >= 1)")
    window: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ConfigError(f"kv_beta must be >= 1, got {self.beta}")

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int) -> int:
        extra = budget - self.window
        if num_layers <= 1 or extra <= 1:
            return budget
        bottom = max(1, int(extra // self.beta))
        top = 2 * extra - bottom
        steps_from_bottom = num_layers - 1 - layer_idx
        return self.window + bottom + (top - bottom) * steps_from_bottom // (num_layers - 1)
