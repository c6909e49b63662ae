"""Where the cache is compressed: KV eviction's settings (`KVCompression`) and the compression step itself.

Once a row's cache holds more than the budget B, every Δ decode steps each full-attention layer keeps the w most
recent real tokens plus the B - w best-scored others (`policies.select_slots` on the layer's KV policy's scores)
and moves them to the front of its buffers (`BufferLayer.keep`); the slots past B are free again. Sliding-window
layers are never compressed. The layers that hold the same number of slots and keep the same budget (all of them,
but under PyramidKV's per-layer budgets) are scored and selected as one batch, their rows stacked: one pass of the
policy's operations for all of them, not one per layer, up to `SCORED_KEY_BYTES` of float32 keys a pass: past
that, the pass's copies (keys, logits, R-KV's unit keys) would outgrow the cache itself, and a pass that large
gains nothing more from batching. The engine's decode loop decides when (`engine/decode_loop.py`); this decides
what.
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


# A stack of 28 layers × 512 rows × 4,096 slots × 2 KV heads × 128 dims is 60 GB in float32: it ran out of memory
# on a 141 GB GPU (docs/benchmarks.md, "On a GPU"). One layer of it is 2 GiB, still thousands of slots per kernel.
SCORED_KEY_BYTES = 2 << 30


def scored_stacks(layers: list[int], bytes_per_layer: int) -> list[list[int]]:
    """`layers` (sharing a length and budget) in consecutive stacks of at most `SCORED_KEY_BYTES` of float32
    keys each, one layer at least. Always the same stacks for the same layers and size, so that a policy's state
    kept per stack (R-KV's row sums) finds its stack at the next compression."""
    per_stack = max(1, SCORED_KEY_BYTES // max(bytes_per_layer, 1))
    return [layers[start:start + per_stack] for start in range(0, len(layers), per_stack)]


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
    stacks = []
    for (length, budget), layers in groups.items():
        keys = cache.layers[layers[0]].keys
        bytes_per_layer = count * keys.shape[1] * length * keys.shape[-1] * 4
        stacks += [(length, budget, stack) for stack in scored_stacks(layers, bytes_per_layer)]
    for length, budget, layers in stacks:
        def stacked(part) -> torch.Tensor:
            return torch.cat([part(layer_idx) for layer_idx in layers]) if len(layers) > 1 else part(layers[0])

        masses = attention.mass
        inputs = ScoringInputs(
            keys=stacked(lambda i: cache.layers[i].read_keys(block, length)),  # dequantized, if quantized
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
