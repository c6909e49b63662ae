"""H2O (Zhang et al., 2023): heavy hitters, the tokens that received the most attention so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KVPolicy, ScoringInputs, register


@register
@dataclass
class H2O(KVPolicy):
    """Heavy hitters: the attention each cached token has received so far, summed over queries."""

    name: ClassVar[str] = "h2o"
    needs_attention_mass: ClassVar[bool] = True

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.attention_mass is None:
            raise ValueError("h2o needs attention_mass; the engine collects it when needs_attention_mass is set")
        return inputs.attention_mass.float()
