"""StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens; scores nothing it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ....errors import ConfigError
from .base import KVPolicy, ScoringInputs, option, register


@register
@dataclass
class StreamingLLM(KVPolicy):
    """Attention sinks (the first `sinks` real tokens of each row) plus the most recent tokens."""

    name: ClassVar[str] = "streamingllm"
    sinks: int = option(4, "streamingllm: attention-sink tokens always kept")

    def __post_init__(self):
        if self.sinks < 0:
            raise ConfigError(f"kv_sinks must be >= 0, got {self.sinks}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        real, columns = inputs.per_kv_head()
        length = real.shape[-1]
        # Rank by column among real slots only: left padding must not take a sink's place.
        order_key = torch.where(real, columns, torch.full_like(columns, torch.iinfo(columns.dtype).max))
        rank = order_key.argsort(dim=-1, stable=True).argsort(dim=-1).float()
        sink = real & (rank < self.sinks)
        # Ranks are < L, so 2L puts every sink above every recency score.
        score = torch.where(sink, torch.full_like(rank, 2.0 * length), rank)
        return torch.where(real, score, torch.full_like(score, -1.0))
