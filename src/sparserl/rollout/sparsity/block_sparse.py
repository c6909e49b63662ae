"""Block-sparse attention rollouts (Sparrow's own sparsity): full KV kept, pages attended.

The cache keeps every token (in the dense cache a slot is a column). A page is `page_size`
consecutive slots, and its centroid is the mean of its real keys. At each decode step a sparse
layer's query scores every page by the mean over query heads of query · centroid (each query head
uses its KV head's centroid, GQA), and attends to `budget // page_size` pages only: the first page
holding a real token of the row (the attention sink; prompts are left-padded) and the 2 most
recent pages (the current, possibly partial, one and the one before) always, then the best-scored
others. Prefill, the first `dense_layers` layers and sliding-window layers stay dense.

`BlockSelector` is one rollout's state: page centroids kept up to date as tokens arrive (scoring then
reads one centroid per page, not every key), the pages' keys and values gathered for the query, the
attended fraction, and the record (`BlockSelections`) the replay turns into masks. Inside the engine's static
decode step (`engine/step.py`) it reads every page of the buffers (empty ones score -inf) and folds in the one slot
the step wrote, with tensor indices only; the speculative sampler's draft steps are static steps too (their centroids
hold only the verified slots: `speculative/drafts/block.py`). Prefill attends densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import BufferCache
from .budgets import BinnedBudget, BudgetSchedule, FixedBudget

ALWAYS_KEPT = 3  # the sink page and the 2 most recent pages


@dataclass(frozen=True)
class BlockSparsity:
    """Block-sparse settings: attended tokens per sparse layer and step (`budget`, or a schedule over
    the cached length), in pages of `page_size` tokens; layers below `dense_layers` attend densely."""

    budget: int = 64
    page_size: int = 16
    dense_layers: int = 2
    # A budget that grows with the cached length; None keeps `budget` throughout.
    schedule: BudgetSchedule | None = None

    @classmethod
    def from_rollout_config(cls, rollout) -> BlockSparsity:
        """The settings of a `sparserl.config.schema.RolloutConfig` (`kv_budget`, `kv_schedule`, `block_*`). An
        adaptive schedule starts at `kv_budget`; training moves it (`budgets.AdaptiveBudget`, `train.hooks`)."""
        schedule = BinnedBudget.from_yaml(rollout.kv_schedule) if rollout.kv_schedule not in (None, "adaptive") \
            else None
        return cls(budget=rollout.kv_budget, page_size=rollout.block_page_size,
                   dense_layers=rollout.block_dense_layers, schedule=schedule)

    @property
    def budgets(self) -> BudgetSchedule:
        return self.schedule or FixedBudget(self.budget)

    def pages(self, cached_len: int) -> int:
        """Pages a sparse layer attends at this cached length (never fewer than the always-kept ones)."""
        return max(ALWAYS_KEPT, self.budgets.budget(cached_len) // self.page_size)


class PageCentroids:
    """One layer's running per-page sums of real keys `[N, Hkv, pages, D]` (float32), real-token
    counts `[N, pages]` and centroids (`means`, like `sums`), folded in as slots arrive."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_pages: int, page_size: int,
                 device: torch.device):
        self.page_size = page_size
        self.sums = torch.zeros(batch, kv_heads, max_pages, head_dim, dtype=torch.float32, device=device)
        self.counts = torch.zeros(batch, max_pages, dtype=torch.float32, device=device)
        self.means = torch.zeros_like(self.sums)
        self.length = 0  # slots folded in so far

    def fold(self, keys: torch.Tensor, real: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold in the slots a static step wrote: keys `[N, Hkv, Q, D]`, real `[N, Q]` bool, at `slots [N, Q]`."""
        pages = slots // self.page_size
        index = pages[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        self.sums.scatter_add_(2, index, keys.float() * real[:, None, :, None])
        self.counts.scatter_add_(1, pages, real.float())
        counts = self.counts.gather(1, pages).clamp(min=1.0)[:, None, :, None]
        self.means.scatter_(2, index, self.sums.gather(2, index) / counts)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.sums, self.counts, self.means = (t.index_select(0, rows) for t in (self.sums, self.counts, self.means))

    def extend(self, keys: torch.Tensor, real: torch.Tensor) -> None:
        """Fold in the next slots: keys `[N, Hkv, n, D]`, real `[N, n]` bool."""
        end = self.length + keys.shape[2]
        pages = torch.arange(self.length, end, device=keys.device) // self.page_size
        self.sums.index_add_(2, pages, keys.float().masked_fill(~real[:, None, :, None], 0.0))
        self.counts.index_add_(1, pages, real.float())
        # Only the pages just touched change: a decode step divides one page, not all of them.
        first, stop = self.length // self.page_size, -(-end // self.page_size)
        counts = self.counts[:, None, first:stop, None].clamp(min=1.0)
        self.means[:, :, first:stop] = self.sums[:, :, first:stop] / counts
        self.length = end


def page_scores(query: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`[N, pages]` mean over query heads of query · page centroid; -inf for pages without a real key.

    query `[N, Hq, 1, D]`; centroids `[N, Hkv, pages, D]`; counts `[N, pages]` real keys per page.
    Query head h uses KV head h // (Hq / Hkv), as transformers' `repeat_kv` does. No soft-capping
    (Gemma-2): a centroid's dot product is no key's logit, only a ranking of pages, and the replay
    reads the pages chosen, not these scores.
    """
    batch, q_heads, _, dim = query.shape
    kv_heads = centroids.shape[1]
    # Summing a group's queries first scores each KV head's centroids once.
    grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads, dim).sum(dim=2)
    scores = (grouped[:, :, None, :] @ centroids.transpose(-1, -2)).squeeze(-2).sum(dim=1) / q_heads
    return scores.masked_fill(counts == 0, float("-inf"))


def select_pages(scores: torch.Tensor, forced: torch.Tensor, keep: int) -> torch.Tensor:
    """The `keep` attended pages `[N, keep]` (ascending) of each row, from scores `[N, pages]`.

    The pages `forced [N, k]` always (the sink and the 2 most recent); then the best scores, ties going to
    the earlier page (a stable sort), so that the selection is deterministic.
    """
    ranked = scores.scatter(1, forced, float("inf"))
    order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :keep]
    return order.sort(dim=1).values


@dataclass
class BlockSelections:
    """What each decode query of each sparse layer attended: the query at column `first_column + t`
    saw the pages `pages[layer][:, t]` (bool `[N, T, max_pages]`; all True where a step attended densely)."""

    page_size: int
    first_column: int
    pages: dict[int, torch.Tensor]

    def rows(self, rows: slice | torch.Tensor) -> BlockSelections:
        return BlockSelections(self.page_size, self.first_column, {k: v[rows] for k, v in self.pages.items()})

    def restrict(self, mask: torch.Tensor, layer: int) -> torch.Tensor:
        """`mask [N, Hs, S, S]` with the decode query rows of `layer` narrowed to their pages."""
        if layer not in self.pages:
            return mask
        width = mask.shape[-1]
        queries = width - self.first_column
        key_pages = torch.arange(width, device=mask.device) // self.page_size
        seen = self.pages[layer][:, :queries].to(mask.device)[:, :, key_pages]  # [N, queries, S]
        mask[:, :, self.first_column:] &= seen[:, None]
        return mask


class BlockSelector:
    """One rollout's block-sparse attention over `cache` (whose capacity is a multiple of the page)."""

    def __init__(self, sparsity: BlockSparsity, cache: BufferCache, steps: int, first_column: int, record: bool):
        self.sparsity = sparsity
        self.cache = cache
        page = sparsity.page_size
        layers = [i for i, layer in enumerate(cache.layers) if i >= sparsity.dense_layers and not layer.is_sliding]
        max_pages = -(-cache.layers[0].max_capacity // page)
        some = cache.layers[0]
        self.centroids = {i: PageCentroids(some.batch, some.kv_heads, some.head_dim, max_pages, page, some.device)
                          for i in layers}
        self.record = BlockSelections(page, first_column, {
            i: torch.ones(some.batch, steps, max_pages, dtype=torch.bool, device=some.device) for i in layers
        }) if record else None
        self.keep: int | None = None  # pages attended this step; None: every page (a dense step)
        self.fraction_sum = torch.zeros((), device=some.device)
        self.fractions = torch.zeros((), device=some.device)  # sparse-layer decode steps counted (a tensor: the
        # static step counts them where it cannot count on the host)
        self.static_step = torch.zeros((), dtype=torch.long, device=some.device)  # the static step's index

    def begin_step(self, cached_len: int, length: int) -> None:
        """The next decode step feeds a token at cache length `length` (after it); the budget reads `cached_len`."""
        keep = self.sparsity.pages(cached_len)
        self.keep = keep if keep < -(-length // self.sparsity.page_size) else None

    @property
    def attended_frac(self) -> float:
        """Mean over decode steps and sparse layers of attended real keys / cached real keys."""
        counted = float(self.fractions)
        return float(self.fraction_sum) / counted if counted else 1.0

    def fold_prompt(self) -> None:
        """Fold the prefilled slots into the centroids, before the static steps fold one slot each."""
        for layer_idx, centroids in self.centroids.items():
            layer = self.cache.layers[layer_idx]
            centroids.extend(layer.keys[:, :, :layer.length], layer.real[:, 0, :layer.length])

    def static_key(self) -> tuple:
        """What shapes the static step besides its tensors: the pages a step attends (None: a dense step)."""
        return (self.keep,)

    def static_tensors(self) -> list[torch.Tensor]:
        record = list(self.record.pages.values()) if self.record is not None else []
        return [self.fraction_sum, self.fractions, self.static_step, *record,
                *(t for c in self.centroids.values() for t in (c.sums, c.counts, c.means))]

    def end_static_step(self) -> None:
        self.static_step.add_(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the centroids of the batch rows `rows`. The record stays whole: it is per request, and block-sparse
        rows leave only all together, at the end (`decode_loop.py`)."""
        for centroids in self.centroids.values():
            centroids.select_rows(rows)

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        """The static step's decode query `query [N, Hq, 1, D]` narrowed to its pages: the keys and values
        `[N, Hkv, keep·page, D]` and `mask [N, Hs, 1, C]` gathered to them; or None where the layer attends densely
        (a dense layer, a step whose budget covers every page, a prefill). Every page of the buffers is scored (a page
        without a real key scores -inf), and the 2 most recent are those of the row's slot."""
        centroids = self.centroids.get(layer_idx)
        layer = self.cache.layers[layer_idx]
        if centroids is None or layer.static_slots is None:
            return None
        slot = layer.static_slots[:, 0]  # where the step wrote each row's token
        written = slot[:, None, None, None].expand(-1, layer.kv_heads, 1, layer.head_dim)
        centroids.fold(layer.keys.gather(2, written), layer.real[:, 0].gather(1, slot[:, None]), slot[:, None])
        self.fractions += 1
        if self.keep is None:
            self.fraction_sum += 1.0
            return None
        page = self.sparsity.page_size
        pages_held = layer.capacity // page
        counts = centroids.counts[:, :pages_held]
        current = slot // page
        forced = torch.stack([(counts > 0).float().argmax(dim=1), (current - 1).clamp(min=0), current], dim=1)
        pages = select_pages(page_scores(query, centroids.means[:, :, :pages_held], counts), forced, self.keep)
        chosen = torch.zeros_like(counts, dtype=torch.bool).scatter_(1, pages, True)
        self.fraction_sum += ((counts * chosen).sum(dim=1) / counts.sum(dim=1).clamp(min=1.0)).mean()
        if self.record is not None:
            rows = torch.arange(len(slot), device=slot.device)
            record = self.record.pages[layer_idx]
            record[rows, self.static_step.expand(len(slot)), :pages_held] = chosen
        keys, values = layer.gather_pages(pages, page)
        slots = (pages[:, :, None] * page + torch.arange(page, device=pages.device)).flatten(1)  # [N, keep·page]
        index = slots.clamp(max=layer.capacity - 1)[:, None, None, :].expand(-1, mask.shape[1], -1, -1)
        # The current page runs past the row's token: those slots hold none yet.
        return keys, values, mask.gather(3, index) & (slots <= slot[:, None])[:, None, None, :]
