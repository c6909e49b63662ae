"""The mask provider of a rollout: masks from the cache, and what the KV policies score with.

A prefill (a cohort of new rows) reads the cache's masks for its columns (`BufferLayer.visible`); a decode step is
the static step (`step.py`), whose masks the cache computes from its realness and columns (`static_visible`). Beside
the masks it keeps, per full-attention layer, the window of the last w queries (SnapKV, R-KV and PyramidKV score with
them) as a fixed `[N, Hq, w, D]` ring written in place each step (a step's query replaces the oldest, at the device
position `ring_position`; the scorers sum over the window, so its order is theirs to ignore), and the attention mass
each slot received (H2O) as `[N, Hkv, capacity]`, added to in place: fixed shapes, so a captured step writes them.
Block-sparse attention narrows each decode query to its pages (`sparsity/block_sparse.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import BufferCache
from ..sparsity.block_sparse import BlockSelector
from ..sparsity.policies import additive_mask
from ..arena import StepArena, placed


class RolloutAttention:
    """The masks, window queries and attention mass of one rollout's cache (see the module)."""

    def __init__(self, cache: BufferCache, window: int, keep_queries: bool, keep_mass: bool,
                 selector: BlockSelector | None = None):
        self.cache = cache
        self.selector = selector
        self.window = window
        self.keep_queries = keep_queries
        self.keep_mass = keep_mass
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [N, Hq, w, D], a ring: the oldest at ring_position
        self.window_real: torch.Tensor | None = None  # [N, w], the same ring
        # [1] long, on the device: the ring slot the next step's query overwrites (a captured step advances it)
        self.ring_position: torch.Tensor | None = None
        self.mass: dict[int, torch.Tensor] = {}  # layer -> [N, Hkv, capacity]
        self.arena: StepArena | None = None  # where the step's tensors live while it is captured (`rollout/arena.py`)

    # --- a prefill -----------------------------------------------------------------------------------
    def begin_forward(self, columns: torch.Tensor, real: torch.Tensor) -> None:
        """A prefill of `columns [N, P]` (realness `real [N, P]`): its last w queries start the window, which holds
        unreal ones on the left while the prompt is shorter."""
        self.cache.set_incoming(columns, real)
        if self.keep_queries:
            # Contiguous, as every later copy is: a compiled step guards on strides (`_fitted`, `observe` too).
            self.window_real = F.pad(real[:, -self.window:], (self.window - min(self.window, real.shape[1]), 0),
                                     value=False).contiguous()
            self.ring_position = torch.zeros(1, dtype=torch.long, device=real.device)

    # --- the static step, as a step participant (`participants.py`) ------------------------------------------
    def begin_step(self, rows) -> None:
        """The static step feeds one token per row (`step_state.RowState`), real where `rows.fed_real [N]`: the window
        moves on by one."""
        if self.window_real is not None:
            self.window_real.index_copy_(1, self.ring_position, rows.fed_real[:, None])

    def end_step(self) -> None:
        if self.ring_position is not None:
            self.ring_position.add_(1).remainder_(self.window)
        if self.selector is not None:
            self.selector.end_static_step()

    def step_key(self) -> tuple:
        """What shapes the static step besides its tensors (block attention's pages per step)."""
        return self.selector.static_key() if self.selector is not None else ()

    def step_buffers(self) -> list[torch.Tensor]:
        return []

    def step_state(self) -> list[torch.Tensor]:
        """What the static step advances here: the windows and their ring's position, the masses, the block selector's
        state."""
        return [*self._window_tensors(), *self.mass.values(),
                *([self.ring_position] if self.ring_position is not None else []),
                *(self.selector.static_tensors() if self.selector is not None else [])]

    def varying_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Rows (`[N, ...]` windows) and capacity (`[N, Hkv, C]` masses); block attention's page state keeps its
        shapes (its rows stay to the end)."""
        return [(t, (0,)) for t in self._window_tensors()] + [(m, (0, 2)) for m in self.mass.values()]

    def _window_tensors(self) -> list[torch.Tensor]:
        return [*self.queries.values(), *([self.window_real] if self.window_real is not None else [])]

    def fit_capacity(self) -> None:
        """Fit the attention masses to their layers' buffers (after a buffer grew or shrank, or rows joined)."""
        self._set_rows({layer: self._fitted(mass, layer) for layer, mass in self.mass.items()}, self.queries,
                       self.window_real)

    def adopt(self, arena: StepArena, rows: int) -> None:
        """Keep the windows, masses and the ring's position in `arena` from now on (`rollout/arena.py`), with room
        for `rows` rows (and the masses for their layers' largest capacity)."""
        self.arena = arena
        self.ring_position = placed(arena, "ring position", self.ring_position)
        self._set_rows(self.mass, self.queries, self.window_real, rows)

    def _set_rows(self, mass: dict[int, torch.Tensor], queries: dict[int, torch.Tensor],
                  window_real: torch.Tensor | None, rows: int | None = None) -> None:
        """Hold these masses, windows and window realness (each placed in the arena, if any, with room for `rows`
        rows if given, and the masses for their layers' largest capacity)."""
        self.mass = {layer: placed(self.arena, f"mass {layer}", m, rows, self.cache.layers[layer].max_capacity)
                     for layer, m in mass.items()}
        self.queries = {layer: placed(self.arena, f"queries {layer}", q, rows) for layer, q in queries.items()}
        self.window_real = placed(self.arena, "window realness", window_real, rows)

    def _fitted(self, mass: torch.Tensor, layer_idx: int) -> torch.Tensor:
        extra = self.cache.layers[layer_idx].capacity - mass.shape[2]
        # A negative pad cuts: the slots past a shrink are free.
        return F.pad(mass, (0, extra)).contiguous() if extra else mass

    # --- the mask provider ---------------------------------------------------------------------------
    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        return self.cache.layers[layer_idx].attention_mask()

    def select_keys(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.selector.select(layer_idx, query, mask) if self.selector is not None else None

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> None:
        layer = self.cache.layers[layer_idx]
        if layer.is_sliding:
            return
        if self.keep_queries:
            if layer.static_slots is not None:
                self.queries[layer_idx].index_copy_(2, self.ring_position, query)
            else:
                width = min(self.window, query.shape[2])
                self.queries[layer_idx] = F.pad(query[:, :, -width:], (0, 0, self.window - width, 0)).contiguous()
        if self.keep_mass:
            self._accumulate_mass(layer_idx, query, key, mask)

    def _accumulate_mass(self, layer_idx, query, key, mask) -> None:
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        group = q_heads // kv_heads
        grouped = query.reshape(batch, kv_heads, group * q_len, dim)
        logits = grouped @ key.transpose(-1, -2) / dim ** 0.5
        # The mask [N, Hm, Q, K] broadcast over the group (no repeated copy of it).
        logits.view(batch, kv_heads, group, q_len, -1).add_(additive_mask(mask)[:, :, None])
        received = logits.softmax(dim=-1).nan_to_num_(0.0).sum(dim=2)  # [N, Hkv, K]
        if self.cache.layers[layer_idx].static_slots is not None:
            self.mass[layer_idx].add_(received)  # the static step reads the whole buffer: K is the capacity
        else:
            self.mass[layer_idx] = received

    # --- rows leaving, joining, compressed -------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (the others finished)."""
        self._set_rows({layer: m.index_select(0, rows) for layer, m in self.mass.items()},
                       {layer: q.index_select(0, rows) for layer, q in self.queries.items()},
                       None if self.window_real is None else self.window_real.index_select(0, rows))
        if self.selector is not None:
            self.selector.select_rows(rows)

    def append_rows(self, other: RolloutAttention) -> None:
        """Add the rows of `other` (the provider of newly prefilled rows) after this one's; called after the cache
        took them, so that the masses span the buffers' capacity. Their windows, oldest first, are turned to this
        ring's position (a read of the device, as an admission makes anyway)."""
        turn = int(self.ring_position) if self.ring_position is not None else 0
        self._set_rows(
            {layer: torch.cat([self._fitted(m, layer), self._fitted(other.mass[layer], layer)])
             for layer, m in self.mass.items()},
            {layer: torch.cat([q, other.queries[layer].roll(turn, dims=2)]) for layer, q in self.queries.items()},
            None if self.window_real is None else torch.cat([self.window_real, other.window_real.roll(turn, dims=1)]))

    def after_keep(self, layer_idx: int, slots: torch.Tensor, first_row: int) -> None:
        """Rows `first_row`... kept the slots `slots [n, Hs, B]`, now at the front of their buffers."""
        if layer_idx not in self.mass:
            return
        mass = self.mass[layer_idx]
        block = slice(first_row, first_row + slots.shape[0])
        per_head = slots if slots.shape[1] != 1 else slots.expand(-1, mass.shape[1], -1)
        kept = slots.shape[2]
        mass[block, :, :kept] = mass[block].gather(2, per_head)
        mass[block, :, kept:] = 0.0
