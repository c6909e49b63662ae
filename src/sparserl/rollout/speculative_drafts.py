"""The drafts of speculative rollouts (`speculative.py`): which cached keys the draft's decode query reads.

Every draft reads the one full cache the verifier writes; it only narrows what a draft query
attends to (`select`, the mask provider's `select_keys`):
- `BlockSparsity`: Sparrow's block-sparse attention, the sink page, the 2 most recent pages and the
  best-scored others (`block_sparse.py`), pages scored by centroids of verified slots only;
- `WindowDraft`: StreamingLLM's pattern, the first `sink` slots and the most recent ones, `budget` in
  all: two contiguous slices of the buffers, so nothing to score and little to copy;
- None: every key (a draft identical to the verifier, which accepts every draft; the tests' case).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_sparse import BlockSelector, BlockSparsity, PageCentroids
from .kv_cache import BufferCache


@dataclass(frozen=True)
class WindowDraft:
    """A draft attending to the first `sink` cache slots (the prompt's start) and the most recent
    `budget − sink` slots (holes of rejected drafts included)."""

    budget: int = 256
    sink: int = 64


def draft_from_config(rollout) -> BlockSparsity | WindowDraft:
    """The draft a `RolloutConfig` asks for with `speculative_draft`, at its `kv_budget`."""
    if rollout.speculative_draft == "window":
        return WindowDraft(budget=rollout.kv_budget, sink=min(WindowDraft.sink, rollout.kv_budget // 4))
    return BlockSparsity.from_rollout_config(rollout)


def build_draft(settings: BlockSparsity | WindowDraft | None, cache: BufferCache, steps: int, width: int):
    """The draft for one rollout over `cache` (prompts of width `width`, `steps` new tokens)."""
    if isinstance(settings, BlockSparsity):
        return _BlockDraft(settings, cache, steps, width)
    if isinstance(settings, WindowDraft):
        return _WindowDraft(settings, cache)
    return _DenseDraft()


class _DenseDraft:
    attended_frac = 1.0

    def begin_step(self, cached_len: int, length: int) -> None:
        pass

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return None

    def commit(self, cache: BufferCache, start: int, real: torch.Tensor) -> None:
        pass

    def recommit(self, cache: BufferCache) -> None:
        pass


class _WindowDraft(_DenseDraft):
    def __init__(self, settings: WindowDraft, cache: BufferCache):
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


class _BlockDraft(_DenseDraft):
    """A `BlockSelector` whose page centroids hold only verified slots.

    The selector folds every slot it sees into its centroids; draft slots are rolled back and rejected
    slots become holes, so here its centroids ignore that and take the verified slots (`commit`), and
    are rebuilt when slots move (`recommit`: compaction, rows leaving)."""

    def __init__(self, sparsity: BlockSparsity, cache: BufferCache, steps: int, width: int):
        self.sparsity = sparsity
        self.selector = BlockSelector(sparsity, cache, steps, width, record=False)

    @property
    def attended_frac(self) -> float:
        return self.selector.attended_frac

    def begin_step(self, cached_len: int, length: int) -> None:
        self.selector.begin_step(0, cached_len, length)

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.selector.select(layer_idx, query, mask)

    def recommit(self, cache: BufferCache) -> None:
        some = cache.layers[0]
        max_pages = -(-some.max_capacity // self.sparsity.page_size)
        self.selector.centroids = {
            i: _CommittedCentroids(some.batch, some.kv_heads, some.head_dim, max_pages, self.sparsity.page_size,
                                   some.device) for i in self.selector.centroids}
        self.commit(cache, 0, some.real[:, 0, :some.length])

    def commit(self, cache: BufferCache, start: int, real: torch.Tensor) -> None:
        """Fold the slots from `start` on (`real [A, n]`: which hold a token) into the centroids."""
        for layer_idx, centroids in self.selector.centroids.items():
            keys = cache.layers[layer_idx].keys[:, :, start:start + real.shape[1]]
            centroids.commit(keys, real)


class _CommittedCentroids(PageCentroids):
    def extend(self, keys: torch.Tensor, real: torch.Tensor) -> None:
        """Ignored: the selector calls it with the draft's own slots."""

    def commit(self, keys: torch.Tensor, real: torch.Tensor) -> None:
        super().extend(keys, real)
