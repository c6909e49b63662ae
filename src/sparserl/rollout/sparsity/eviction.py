"""Where the cache is compressed: KV eviction's settings (`KVCompression`) and the compression step itself.

Once a row's cache holds more than the budget B, every Δ decode steps each full-attention layer keeps the w most
recent real tokens plus the B - w best-scored others (`policies.select_slots` on the layer's KV policy's scores)
and moves them to the front of its buffers (`BufferLayer.keep`); the slots past B are free again. Sliding-window
layers are never compressed. The engine's decode loop decides when (`engine/decode_loop.py`); this decides what.
"""

from __future__ import annotations

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
    kept `[count, Hs, B]`, or None when not `record`) for each layer compressed."""
    block = slice(first, first + count)
    compressed = []
    for layer_idx, layer in enumerate(cache.layers):
        budget, length = budgets[layer_idx], layer.row_length(first)
        if layer.is_sliding or length <= budget:
            continue
        mass = attention.mass.get(layer_idx)
        inputs = ScoringInputs(
            keys=layer.keys[block, :, :length], queries=attention.queries[layer_idx][block],
            query_real=attention.window_real[block], real=layer.real[block, :, :length],
            columns=layer.columns[block, :, :length],
            attention_mass=mass[block, :, :length] if mass is not None else None,
            layer_idx=layer_idx, num_layers=len(cache.layers),
        )
        slots = select_slots(policy.score(inputs), inputs.real, inputs.columns, budget, window)
        policy.before_keep(inputs, slots)
        layer.keep(slots, first)
        attention.after_keep(layer_idx, slots, first, layer.length)
        compressed.append((layer_idx, layer.columns[block, :, :budget].clone() if record else None))
    return compressed
