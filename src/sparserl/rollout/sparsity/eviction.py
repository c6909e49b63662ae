"""Where the cache is compressed: KV eviction's settings (`KVCompression`) and the compression step itself.

Once a row's cache holds more than the budget B, every Δ decode steps each full-attention layer keeps the w most
recent real tokens plus the B - w best-scored others (`policies.select_slots` on the layer's KV policy's scores)
and moves them to the front of its buffers (`BufferLayer.keep`); the slots past B are free again. Sliding-window
layers are never compressed. The layers that hold the same number of slots and keep the same budget (all of them,
but under PyramidKV's per-layer budgets) are scored and selected as one batch, their rows stacked: one pass of the
policy's operations for all of them, not one per layer. The engine's decode loop decides when
(`engine/decode_loop.py`); this decides what.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..cache import BufferCache
from .budgets import BinnedBudget, BudgetSchedule, FixedBudget
from .policies import (
    KVPolicy,
    ScoringInputs,
    build_policy,
    policy_options,
    select_slots,
)


@dataclass(frozen=True)
class KVCompression:
    """Sparse-rollout settings: budget B, observation window w, interval Δ (a cache past B is compressed
    back to B every Δ decode steps, always keeping the w most recent tokens)."""

    policy: str = "rkv"
    budget: int = 32
    window: int = 8
    interval: int = 8
    per_head: bool = False
    policy_options: tuple[tuple[str, object], ...] = ()  # (config key, value) of the policies' options
    # A budget that grows with the cached length; None keeps `budget` throughout.
    schedule: BudgetSchedule | None = None

    @classmethod
    def from_rollout_config(cls, rollout) -> KVCompression:
        """The settings of a `sparserl.config.schema.RolloutConfig` (its `kv_*` fields). An adaptive schedule
        starts at `kv_budget`; training moves it (`budgets.AdaptiveBudget`, `train.hooks`)."""
        options = tuple((key, getattr(rollout, key)) for key in policy_options())
        schedule = BinnedBudget.from_yaml(rollout.kv_schedule) if rollout.kv_schedule not in (None, "adaptive") \
            else None
        return cls(policy=rollout.kv_policy, budget=rollout.kv_budget, window=rollout.kv_window,
                   interval=rollout.kv_interval, per_head=rollout.kv_per_head, policy_options=options,
                   schedule=schedule)

    @property
    def budgets(self) -> BudgetSchedule:
        return self.schedule or FixedBudget(self.budget)

    def build_policy(self) -> KVPolicy:
        return build_policy(self.policy, dict(self.policy_options), self.window)


def compress_rows(policy: KVPolicy, window: int, cache: BufferCache, attention, first: int, count: int,
                  budgets: list[int], record: bool) -> list[tuple[int, torch.Tensor | None]]:
    """Compress batch rows `first`... `first + count` (a cohort: one length, one policy state) in every layer
    past its budget (`budgets[layer]`). `attention` is the decode loop's mask provider: the window queries and
    attention mass the policy scores with, told what was kept (`after_keep`). Returns (layer, the columns each row
    kept `[count, Hs, B]`, or None when not `record`) for each layer compressed, in layer order."""
    block = slice(first, first + count)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)  # (slots held, budget) -> layers
    for layer_idx, layer in enumerate(cache.layers):
        budget, length = budgets[layer_idx], layer.row_length(first)
        if not layer.is_sliding and length > budget:
            groups[(length, budget)].append(layer_idx)
    compressed = []
    for (length, budget), layers in groups.items():
        def stacked(part) -> torch.Tensor:
            return torch.cat([part(layer_idx) for layer_idx in layers]) if len(layers) > 1 else part(layers[0])

        masses = attention.mass
        inputs = ScoringInputs(
            keys=stacked(lambda i: cache.layers[i].keys[block, :, :length]),
            queries=stacked(lambda i: attention.queries[i][block]),
            query_real=attention.window_real[block].repeat(len(layers), 1),
            real=stacked(lambda i: cache.layers[i].real[block, :, :length]),
            columns=stacked(lambda i: cache.layers[i].columns[block, :, :length]),
            attention_mass=stacked(lambda i: masses[i][block, :, :length]) if masses else None,
            layers=tuple(layers),
        )
        slots = select_slots(policy.score(inputs), inputs.real, inputs.columns, budget, window)
        policy.before_keep(inputs, slots)
        for index, layer_idx in enumerate(layers):
            layer_slots = slots[index * count:(index + 1) * count]
            cache.layers[layer_idx].keep(layer_slots, first)
            attention.after_keep(layer_idx, layer_slots, first)
            kept = cache.layers[layer_idx].columns[block, :, :budget].clone() if record else None
            compressed.append((layer_idx, kept))
    return sorted(compressed, key=lambda part: part[0])
