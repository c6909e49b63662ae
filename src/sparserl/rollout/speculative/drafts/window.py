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
        device = cache.layers[0].device
        self.fraction_sum = torch.zeros((), device=device)
        self.fractions = torch.zeros((), device=device)
        self.binds = False  # whether the next draft step's cache is longer than the window

    @property
    def attended_frac(self) -> float:
        """Mean over draft layer steps of attended real keys / cached real keys (a mean over rows)."""
        counted = float(self.fractions)
        return float(self.fraction_sum) / counted if counted else 1.0

    def begin_step(self, cached_len: int, length: int) -> None:
        self.binds = length > self.settings.budget

    def static_key(self) -> tuple:
        """The settings `select` reads (its slices' sizes) and whether the window binds yet."""
        return (self.settings, self.binds)

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.fraction_sum, self.fractions]

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        """Keys and values `[A, Hkv, budget, D]` of the sink and the window ending at the query's slot, and
        `mask [A, Hm, 1, budget]` on them."""
        layer = self.cache.layers[layer_idx]
        self.fractions += 1
        if layer.is_sliding or not self.binds:
            self.fraction_sum += 1.0
            return None
        sink, budget = self.settings.sink, self.settings.budget
        end = layer.static_slots[:, 0] + 1  # each row's slots, the query's own included
        recent = end[:, None] - (budget - sink) + torch.arange(budget - sink, device=end.device)
        slots = torch.cat([torch.arange(sink, device=end.device).expand(len(end), -1), recent], dim=1)  # [A, budget]
        narrowed = mask.gather(3, slots[:, None, None, :].expand(-1, mask.shape[1], 1, -1))
        cached = mask[:, 0, -1].sum(dim=-1).clamp(min=1)
        self.fraction_sum += (narrowed[:, 0, -1].sum(dim=-1) / cached).mean()
        index = slots[:, None, :, None].expand(-1, layer.kv_heads, -1, layer.head_dim)
        return layer.keys.gather(2, index), layer.values.gather(2, index), narrowed


