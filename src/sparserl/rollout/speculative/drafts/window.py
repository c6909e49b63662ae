"""A window draft: StreamingLLM's pattern over the verifier's cache, the first `sink` slots and the most recent
ones, `budget` in all: two contiguous slices of the buffers, so nothing to score and little to copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache import BufferCache
from .base import DenseDraft, register_draft


@dataclass(frozen=True)
class WindowDraft:
    """A draft attending to the first `sink` cache slots (the prompt's start) and the most recent
    `budget − sink` slots (holes of rejected drafts included)."""

    budget: int = 256
    sink: int = 64

    @classmethod
    def from_rollout_config(cls, rollout) -> WindowDraft:
        """`kv_budget` slots, of which the first min(64, kv_budget / 4)."""
        return cls(budget=rollout.kv_budget, sink=min(cls.sink, rollout.kv_budget // 4))


@register_draft("window", WindowDraft, WindowDraft.from_rollout_config)
class _WindowDraft(DenseDraft):
    def __init__(self, settings: WindowDraft, cache: BufferCache, steps: int, width: int):
        self.settings = settings
        self.cache = cache
        self.fraction_sum, self.fractions = 0.0, 0

    @property
    def attended_frac(self) -> float:
        """Mean over draft layer steps of attended real keys / cached real keys (a mean over rows)."""
        return float(self.fraction_sum) / self.fractions if self.fractions else 1.0

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        """Keys and values `[A, Hkv, budget, D]` of the sink and the window, and `mask [A, Hm, 1, K]` on them."""
        layer = self.cache.layers[layer_idx]
        self.fractions += 1
        if layer.is_sliding or layer.length <= self.settings.budget:
            self.fraction_sum += 1.0
            return None
        sink, recent = slice(0, self.settings.sink), slice(layer.length - self.settings.budget + self.settings.sink,
                                                            layer.length)
        narrowed = torch.cat([mask[..., sink], mask[..., recent]], dim=-1)
        cached = mask[:, 0, -1].sum(dim=-1).clamp(min=1)
        self.fraction_sum += (narrowed[:, 0, -1].sum(dim=-1) / cached).mean()  # stays on the device
        return (torch.cat([layer.keys[:, :, sink], layer.keys[:, :, recent]], dim=2),
                torch.cat([layer.values[:, :, sink], layer.values[:, :, recent]], dim=2), narrowed)


