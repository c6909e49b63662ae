"""A KV cache in preallocated buffers that evicts tokens in place, and so really frees memory.

Each full-attention layer holds its keys and values in buffers `[N, Hkv, capacity, D]`. A slot
also records the column it came from (its index in the left-padded prompt+response layout) and
whether it holds a real token; that is all the mask needs, since a slot is visible to every later
query. A compression (`sparsity/eviction.py` picks the slots, `BufferLayer.keep` moves them) gathers the w
most recent real slots plus the B - w best-scored others to the front of the buffer; the buffers then shrink to
B + interval + 1 (`BufferCache.shrink`), since a decode step attends over its whole buffer: a 4,096-token prompt
compressed to 512 would otherwise cost every later step what a dense one costs (measured on an H200,
docs/benchmarks.md).

With no compression policy the same class is the dense cache: one code path for both, which is
what makes a sparse rollout with a huge budget bitwise the dense one. Block-sparse attention reads
whole pages of the dense cache (`gather_pages`), so there the capacity is kept a multiple of the page.
Sliding-window layers (hybrid models such as Gemma-3) keep every token and mask by distance;
they are never compressed. A window that every layer has (Mistral, Phi-3: `sliding_window` without
`layer_types`) masks by distance too, but its layers are compressed as full-attention ones.

Rows that joined the batch at different times (the engine refills freed rows, `decode_loop.py`)
hold different numbers of slots: each row's new tokens go after its own slots, and every slot past a row's
length stays unreal, so the mask hides it. A prefill writes one length for all rows; decoding writes through the
static step (`engine/step.py`), which reads whole buffers (the capacity, at most one growth past the longest row)
and writes each row at its own slot count, kept on the device (`slot_counts`) while the host keeps the same counts
for the decisions that must not wait for the device (growth, compressions).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..model.structure import layer_types, layer_windows, text_config


class BufferLayer(CacheLayerMixin):
    """One layer's cache. `selection_heads` is 1 (one kept set per layer) or the KV head count.

    Each row's slot count is kept twice: on the host (`length`, the longest row's, and `row_lengths` while rows
    differ), which decides growth and compressions without reading the device, and on the device (`slot_counts`),
    which is where the static decode step writes (`begin_static`)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_capacity: int, selection_heads: int,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None = None,
                 growth: int = 64, page_size: int = 1, is_sliding: bool = False):
        """`is_sliding`: a hybrid model's local layer (never compressed); `sliding_window` masks by distance."""
        super().__init__()
        self.is_sliding = is_sliding
        self.sliding_window = sliding_window
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.selection_heads = selection_heads
        self.max_capacity = max_capacity
        self.growth = growth
        self.page_size = page_size  # the capacity stays a multiple of it
        self.dtype, self.device = dtype, device
        self.length = 0  # the longest row's slots
        self.row_lengths: np.ndarray | None = None  # per-row slot counts `[N]` while rows differ, else None
        self.slot_counts = torch.zeros(batch, dtype=torch.long, device=device)  # every row's, on the device
        self.keys = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.columns = torch.empty(batch, selection_heads, 0, dtype=torch.long, device=device)
        self.real = torch.empty(batch, selection_heads, 0, dtype=torch.bool, device=device)
        self.is_initialized = True
        self.peak_bytes = 0
        # Filled by the engine before each forward: the columns and realness of the incoming tokens.
        self.incoming_columns: torch.Tensor | None = None
        self.incoming_real: torch.Tensor | None = None
        # Set while the static decode step runs (`engine/step.py`): the slots `[N, Q]` the rows write their incoming
        # tokens to; the step then reads whole buffers, and the decode loop counts the slots on the host (`advance`).
        self.static_slots: torch.Tensor | None = None
        self.static_rows: torch.Tensor | None = None  # `[N, 1]`: each row's index, for the slots' indexed writes

    # --- transformers' cache-layer protocol -------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static_slots is not None:
            return self._write_static(key_states, value_states)
        if self.row_lengths is not None:
            raise RuntimeError("rows of different lengths are written by the static decode step only; this is a bug")
        incoming = key_states.shape[2]
        self.reserve(self.length + incoming)
        end = self.length + incoming
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.columns[:, :, self.length:end] = self.incoming_columns[:, None, :]
        self.real[:, :, self.length:end] = self.incoming_real[:, None, :]
        self.length = end
        self.slot_counts += incoming
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_capacity

    # --- the static decode step -----------------------------------------------------------------
    def _write_static(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`update` inside the static decode step: each row's tokens `[N, Hkv, Q, D]` go to its slots, written in place
        with tensor indices only (no host value read, no shape that changes from step to step); returns the whole
        buffers, whose slots past a row's tokens are unreal and masked (`static_visible`)."""
        # Indexed assignment (index_put_), not scatter_: torch.compile writes an index_put_ in place, but turns a
        # scatter_ into a copy of the whole buffer (out of place, then back), which on a GPU cost more than the step
        # it fused (docs/benchmarks.md). Assigned `[N, Q, H, ...]`: the indexed dims first.
        rows, slots = self.static_rows, self.static_slots  # [N, 1], [N, Q]
        self.keys[rows, :, slots] = key_states.transpose(1, 2)
        self.values[rows, :, slots] = value_states.transpose(1, 2)
        self.columns[rows, :, slots] = self.incoming_columns[:, :, None]
        self.real[rows, :, slots] = self.incoming_real[:, :, None]
        return self.keys, self.values

    def static_visible(self) -> torch.Tensor:
        """Bool `[N, Hs, Q, C]` over the whole buffers for the static step's queries (their columns are
        `incoming_columns`, their slots `static_slots`): real slots not after the query (within the window), and
        its own slot, so that a padding query's softmax stays finite."""
        slots, capacity = self.static_slots, self.capacity
        own = torch.arange(capacity, device=slots.device) == slots[:, :, None]  # [N, Q, C]
        if slots.shape[1] == 1 and self.sliding_window is None:
            # One decode token: every cached real slot precedes it.
            return self.real[:, :, None, :] | own[:, None]
        q = self.incoming_columns[:, None, :, None]
        k = self.columns[:, :, None, :]
        seen = self.real[:, :, None, :] & (k <= q)
        if self.sliding_window is not None:
            seen &= k > q - self.sliding_window
        return seen | own[:, None]

    def advance(self, tokens: int = 1) -> None:
        """Count on the host the `tokens` slots the static step wrote in every row (it counted on the device)."""
        self.length += tokens
        if self.row_lengths is not None:
            self.row_lengths += tokens

    # --- ours ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, needed: int) -> None:
        """Grow the buffers to hold `needed` slots per row, `growth` slots at a time (whole pages)."""
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise RuntimeError(f"KV buffer overflow: {needed} slots > capacity {self.max_capacity}")
        new_capacity = self._whole_pages(max(needed, self.capacity + self.growth))
        grow = new_capacity - self.capacity
        self.keys = _grow(self.keys, grow, 2)
        self.values = _grow(self.values, grow, 2)
        self.columns = _grow(self.columns, grow, 2)
        self.real = _grow(self.real, grow, 2)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def shrink(self, needed: int) -> None:
        """Cut the buffers to `needed` slots per row (whole pages) if they hold more; `needed` covers the longest
        row. A copy, so that the memory past it is freed."""
        capacity = self._whole_pages(needed)
        if capacity >= self.capacity:
            return
        if capacity < self.length:
            raise RuntimeError(f"KV buffer shrink to {capacity} slots would cut rows holding {self.length}")
        self.keys, self.values, self.columns, self.real = (
            tensor[:, :, :capacity].clone() for tensor in (self.keys, self.values, self.columns, self.real))

    def _whole_pages(self, slots: int) -> int:
        """`slots` rounded up to whole pages, at most the maximum capacity."""
        return min(self.max_capacity, -(-slots // self.page_size) * self.page_size)

    def attention_mask(self) -> torch.Tensor:
        """Bool: what the incoming tokens' queries see, in the static step (`static_visible`) or in a prefill
        (`visible`)."""
        return self.static_visible() if self.static_slots is not None else self.visible()

    def visible(self) -> torch.Tensor:
        """Bool `[N, Hs, Q, K]` over the held slots for a prefill's queries (at `incoming_columns [N, Q]`): slot k is
        visible if real and not after the query (within the window), or the query's own."""
        q = self.incoming_columns[:, None, :, None]
        k = self.columns[:, :, None, : self.length]
        seen = self.real[:, :, None, : self.length] & (k <= q)
        if self.sliding_window is not None:
            seen &= k > q - self.sliding_window
        return seen | (k == q)

    def keep(self, slot_index: torch.Tensor, first_row: int = 0) -> None:
        """Move the slots `slot_index [n, Hs, B]` (in the order given) of rows `first_row`... `first_row + n`
        to the front of their buffers. Those rows hold the same number of slots (`row_length`)."""
        count, kept = slot_index.shape[0], slot_index.shape[2]
        length = self.row_length(first_row)
        block = slice(first_row, first_row + count)
        heads_index = slot_index if self.selection_heads == self.kv_heads else slot_index.expand(-1, self.kv_heads, -1)
        rows = self._flat_rows(heads_index, self.capacity, first_row)
        shape = (count, self.kv_heads, kept, self.head_dim)
        self.keys[block, :, :kept] = self.keys.view(-1, self.head_dim).index_select(0, rows).view(shape)
        self.values[block, :, :kept] = self.values.view(-1, self.head_dim).index_select(0, rows).view(shape)
        self.columns[block, :, :kept] = self.columns[block, :, :length].gather(2, slot_index)
        self.real[block, :, :kept] = self.real[block, :, :length].gather(2, slot_index)
        self.real[block, :, kept:] = False  # slots past a row's length stay unreal: the static step reads them
        self.slot_counts[block] = kept
        if count == self.batch:
            self._set_lengths(None, kept)
        else:
            lengths = self._lengths()
            lengths[block] = kept
            self._set_lengths(lengths)

    def row_length(self, row: int) -> int:
        """Slots that row `row` holds."""
        return self.length if self.row_lengths is None else int(self.row_lengths[row])

    def select_rows(self, rows: torch.Tensor, host_rows: np.ndarray | None = None) -> None:
        """Keep the batch rows `rows`, in that order: the others finished (the buffers shrink with them), or a
        row repeated gives a group's prefilled prompt to each of its rows. `host_rows`: the same indices on the
        host, needed while rows hold different lengths."""
        self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        self.columns, self.real = self.columns.index_select(0, rows), self.real.index_select(0, rows)
        self.slot_counts = self.slot_counts.index_select(0, rows)
        self.batch = len(rows)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        if self.row_lengths is not None:
            self._set_lengths(self.row_lengths[host_rows])

    def append_rows(self, other: BufferLayer) -> None:
        """Add the rows of `other` (a cache of newly prefilled rows, one length for all) after this one's."""
        lengths = np.concatenate([self._lengths(), other._lengths()])
        capacity = max(self.capacity, other.capacity)
        self.keys, self.values, self.columns, self.real = (
            torch.cat([_grow(mine, capacity - mine.shape[2], 2), _grow(theirs, capacity - theirs.shape[2], 2)])
            for mine, theirs in ((self.keys, other.keys), (self.values, other.values),
                                 (self.columns, other.columns), (self.real, other.real)))
        self.slot_counts = torch.cat([self.slot_counts, other.slot_counts])
        self.batch += other.batch
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        self._set_lengths(lengths)

    def _lengths(self) -> np.ndarray:
        """Per-row slot counts `[N]` on the host (a copy)."""
        return self.row_lengths.copy() if self.row_lengths is not None else np.full(self.batch, self.length)

    def _set_lengths(self, lengths: np.ndarray | None, uniform: int = 0) -> None:
        """Per-row slot counts on the host, or one count for all (`uniform`) when they agree."""
        if lengths is not None and (lengths == lengths[:1]).all():
            lengths, uniform = None, int(lengths[0]) if len(lengths) else 0
        self.row_lengths = lengths
        self.length = uniform if lengths is None else int(lengths.max())

    def gather_pages(self, pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[N, Hkv, k·page_size, D]` of the pages `pages [N, k]` (slots
        page·page_size onward), whole pages even past the length (the caller masks those slots)."""
        if self.capacity % page_size:
            raise ValueError(f"capacity {self.capacity} is not a multiple of the page size {page_size}")
        rows = self._flat_rows(pages[:, None, :].expand(-1, self.kv_heads, -1), self.capacity // page_size)
        shape = (self.batch, self.kv_heads, pages.shape[1] * page_size, self.head_dim)
        width = page_size * self.head_dim
        return (self.keys.view(-1, width).index_select(0, rows).view(shape),
                self.values.view(-1, width).index_select(0, rows).view(shape))

    def _flat_rows(self, index: torch.Tensor, per_head: int, first_row: int = 0) -> torch.Tensor:
        """Rows of the flattened `[N·Hkv·per_head, ...]` buffers for `index [n, Hkv, k]` of batch rows
        `first_row`...: index_select there is twice as fast on a CPU as a gather with an index expanded over D."""
        count = index.shape[0]
        offsets = torch.arange(first_row * self.kv_heads, (first_row + count) * self.kv_heads,
                               device=self.device).view(count, self.kv_heads, 1)
        return (index + offsets * per_head).reshape(-1)


def _grow(tensor: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


class BufferCache(Cache):
    """The engine's cache: one `BufferLayer` per decoder layer."""

    def __init__(self, layers: list[BufferLayer]):
        super().__init__(layers=layers)

    def append_rows(self, other: BufferCache) -> None:
        """Add the rows of `other` (newly prefilled, same layers) after this cache's."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.append_rows(theirs)

    def set_incoming(self, columns: torch.Tensor, real: torch.Tensor) -> None:
        """Columns `[N, Q]` and realness `[N, Q]` of the tokens the next forward will append."""
        for layer in self.layers:
            layer.incoming_columns, layer.incoming_real = columns, real

    def begin_static(self, columns: torch.Tensor, real: torch.Tensor) -> None:
        """The next forward is the static step's: its tokens (columns and realness `[N, Q]`) go to each row's next
        slots in every layer (a layer's rows may hold different counts: `slot_counts`)."""
        queries = columns.shape[1]
        rows = torch.arange(columns.shape[0], device=columns.device)[:, None]
        for layer in self.layers:
            slots = layer.slot_counts[:, None]
            layer.static_slots = slots if queries == 1 else slots + torch.arange(queries, device=slots.device)
            layer.static_rows = rows
            layer.incoming_columns, layer.incoming_real = columns, real

    def end_static(self) -> None:
        """The static step wrote its tokens: count them on the device, where the next step reads them."""
        for layer in self.layers:
            layer.slot_counts.add_(layer.static_slots.shape[1])
            layer.static_slots = layer.static_rows = None

    def reserve(self, slots: int) -> bool:
        """Make room for `slots` more in every row's buffers (growing them if needed); whether any buffer moved."""
        moved = False
        for layer in self.layers:
            capacity = layer.capacity
            layer.reserve(layer.length + slots)
            moved |= layer.capacity != capacity
        return moved

    def shrink(self, slots: int) -> bool:
        """Cut every compressed layer's buffers to its longest row plus `slots`; whether any buffer moved."""
        moved = False
        for layer in self.layers:
            if not layer.is_sliding:
                capacity = layer.capacity
                layer.shrink(layer.length + slots)
                moved |= layer.capacity != capacity
        return moved

    def advance(self, tokens: int = 1) -> None:
        for layer in self.layers:
            layer.advance(tokens)

    # --- a step participant (`engine/participants.py`) ---
    def step_buffers(self) -> list[torch.Tensor]:
        """The buffers the static step reads and writes (a captured step holds their addresses); writing the same
        step twice writes the same values to them."""
        return [t for layer in self.layers for t in (layer.keys, layer.values, layer.columns, layer.real)]

    def step_state(self) -> list[torch.Tensor]:
        """The counts the static step advances (each layer's `slot_counts`)."""
        return [layer.slot_counts for layer in self.layers]

    def step_key(self) -> tuple:
        return ()

    def varying_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Rows and capacity: `[N, H, C, ...]` buffers, `[N]` counts."""
        return [(t, (0, 2)) for t in self.step_buffers()] + [(t, (0,)) for t in self.step_state()]

    def begin_step(self, rows) -> None:
        """The decode step feeds one token per row of `rows` (`engine.step.RowState`)."""
        self.begin_static(rows.columns[:, None], rows.fed_real[:, None])

    def end_step(self) -> None:
        self.end_static()

    def peak_bytes(self) -> dict[str, int]:
        totals = {"full_attention": 0, "sliding_attention": 0}
        for layer in self.layers:
            totals["sliding_attention" if layer.is_sliding else "full_attention"] += layer.peak_bytes
        return totals

    def slot_bytes(self) -> int:
        """KV bytes one token takes in one row, over every layer: what a dense cache holds per row and token."""
        return sum(2 * layer.kv_heads * layer.head_dim * layer.keys.element_size() for layer in self.layers)


def build_cache(model, batch: int, capacities: list[int], per_head_selection: bool,
                dtype: torch.dtype, device: torch.device, full_capacity: int, growth: int = 64,
                page_size: int = 1) -> BufferCache:
    """One buffer layer per decoder layer, holding up to `capacities[i]` slots and growing
    `growth` slots at a time (capacities kept multiples of `page_size`); sliding-window layers get
    the dense `full_capacity`."""
    config = text_config(model)
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = []
    for kind, window, capacity in zip(layer_types(config), layer_windows(config), capacities):
        sliding = kind == "sliding_attention" and window is not None
        layers.append(BufferLayer(
            batch, kv_heads, head_dim,
            max_capacity=full_capacity if sliding else capacity,
            selection_heads=kv_heads if per_head_selection and not sliding else 1,
            dtype=dtype, device=device, sliding_window=window, growth=growth,
            page_size=page_size, is_sliding=sliding,
        ))
    return BufferCache(layers)
