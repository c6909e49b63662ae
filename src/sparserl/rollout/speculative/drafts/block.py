"""A block draft: Sparrow's block-sparse attention over the verifier's cache, the sink page, the 2 most recent pages
and the best-scored others (`sparsity/block_sparse.py`), pages scored by centroids of verified slots only."""

from __future__ import annotations

import torch

from ...cache import BufferCache
from ...sparsity.block_sparse import BlockSelector, BlockSparsity, PageCentroids
from .base import DenseDraft, register_draft


@register_draft("block", BlockSparsity, BlockSparsity.from_rollout_config)
class _BlockDraft(DenseDraft):
    """A `BlockSelector` whose page centroids hold only verified slots.

    The selector folds every slot it sees into its centroids; draft slots are rolled back and rejected
    slots become holes, so here its centroids ignore that and take the verified slots (`commit_slots`), and
    are rebuilt when slots move (`recommit`: compaction, rows leaving)."""

    def __init__(self, sparsity: BlockSparsity, cache: BufferCache, steps: int, width: int):
        self.sparsity = sparsity
        self.selector = BlockSelector(sparsity, cache, steps, width, record=False)

    @property
    def attended_frac(self) -> float:
        return self.selector.attended_frac

    def begin_step(self, cached_len: int, length: int) -> None:
        self.selector.begin_step(cached_len, length)

    def static_key(self) -> tuple:
        """The settings the selector reads (page size, budget, dense layers) and the pages it attends this step."""
        return (self.sparsity, *self.selector.static_key())

    def static_tensors(self) -> list[torch.Tensor]:
        return self.selector.static_tensors()

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.selector.select(layer_idx, query, mask)

    def commit_slots(self, cache: BufferCache, slots: torch.Tensor, real: torch.Tensor) -> None:
        for layer_idx, centroids in self.selector.centroids.items():
            keys = cache.layers[layer_idx].keys
            index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            centroids.commit_slots(keys.gather(2, index), real, slots)

    def recommit(self, cache: BufferCache) -> None:
        some = cache.layers[0]
        max_pages = -(-some.max_capacity // self.sparsity.page_size)
        self.selector.centroids = {
            i: _CommittedCentroids(some.batch, some.kv_heads, some.head_dim, max_pages, self.sparsity.page_size,
                                   some.device) for i in self.selector.centroids}
        for layer_idx, centroids in self.selector.centroids.items():
            centroids.extend(cache.layers[layer_idx].keys[:, :, :some.length], some.real[:, 0, :some.length])


class _CommittedCentroids(PageCentroids):
    def fold(self, keys: torch.Tensor, real: torch.Tensor, slots: torch.Tensor) -> None:
        """Ignored: the selector calls it with the draft's own slots."""

    def commit_slots(self, keys: torch.Tensor, real: torch.Tensor, slots: torch.Tensor) -> None:
        super().fold(keys, real, slots)
