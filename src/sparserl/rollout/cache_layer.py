"""One layer of the engine's KV cache (`cache.py`): preallocated buffers that evict tokens in place, and so really
free memory.

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

A quantized cache (`--kv-dtype fp8 | int8`, `quantization.py`) stores keys and values in one byte each, with int8's
per-token value scales beside them (`value_scales`, moved with their slots) and each row's scales fixed at its
prefill (`key_scale`, `value_scale`, moved with their rows); every write quantizes, and the attention reads the
buffers dequantized (`read`), a token's own keys and values included, which is what the replay reproduces.

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
from transformers.cache_utils import CacheLayerMixin

from .arena import StepArena, placed
from .quantization import KVFormat, bytes_view


class BufferLayer(CacheLayerMixin):
    """One layer's cache. `selection_heads` is 1 (one kept set per layer) or the KV head count.

    Each row's slot count is kept twice: on the host (`length`, the longest row's, and `row_lengths` while rows
    differ), which decides growth and compressions without reading the device, and on the device (`slot_counts`),
    which is where the static decode step writes (`begin_static`)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_capacity: int, selection_heads: int,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None = None,
                 growth: int = 64, page_size: int = 1, is_sliding: bool = False, kv_format: KVFormat | None = None):
        """`is_sliding`: a hybrid model's local layer (never compressed); `sliding_window` masks by distance;
        `kv_format`: keys and values stored quantized (None: in `dtype`)."""
        super().__init__()
        self.is_sliding = is_sliding
        self.sliding_window = sliding_window
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.selection_heads = selection_heads
        self.max_capacity = max_capacity
        self.growth = growth
        self.page_size = page_size  # the capacity stays a multiple of it
        self.dtype, self.device, self.format = dtype, device, kv_format
        self.length = 0  # the longest row's slots
        self.row_lengths: np.ndarray | None = None  # per-row slot counts `[N]` while rows differ, else None
        self.slot_counts = torch.zeros(batch, dtype=torch.long, device=device)  # every row's, on the device
        stored = dtype if kv_format is None else kv_format.store_dtype
        self.keys = torch.empty(batch, kv_heads, 0, head_dim, dtype=stored, device=device)
        self.values = torch.empty_like(self.keys)
        # int8's value scale of each slot and head `[N, Hkv, C, 1]` (in `dtype`); each row's scales fixed at its
        # prefill, keys `[N, Hkv, 1, Dk]` and fp8's values `[N, Hkv, 1, 1]`. None where the format has none.
        self.value_scales = torch.empty(batch, kv_heads, 0, 1, dtype=dtype, device=device) \
            if kv_format is not None and kv_format.value_per_token else None
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None
        self.columns = torch.empty(batch, selection_heads, 0, dtype=torch.long, device=device)
        self.real = torch.empty(batch, selection_heads, 0, dtype=torch.bool, device=device)
        self.is_initialized = True
        self.peak_bytes = 0
        # Rows that ended and stay only to keep the batch at a captured size (`decode_loop.py`, row buckets): not
        # counted in the peak, so that KV held is one figure however the step runs.
        self.padding_rows = 0
        # Filled by the engine before each forward: the columns and realness of the incoming tokens.
        self.incoming_columns: torch.Tensor | None = None
        self.incoming_real: torch.Tensor | None = None
        # Set while the static decode step runs (`engine/step.py`): the slots `[N, Q]` the rows write their incoming
        # tokens to; the step then reads whole buffers, and the decode loop counts the slots on the host (`advance`).
        self.static_slots: torch.Tensor | None = None
        self.static_rows: torch.Tensor | None = None  # `[N, 1]`: each row's index, for the slots' indexed writes
        # Where the buffers live while a captured step holds them (`arena.py`), under roles named `role`...
        self.arena: StepArena | None = None
        self.role = ""

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
        if self.format is not None and self.key_scale is None:  # the prefill: the rows' scales for the rollout
            self.key_scale, self.value_scale = self.format.row_scales(key_states, value_states, self.incoming_real)
            self._note_peak()
        keys, values, scales = self._encoded(key_states, value_states)
        bytes_view(self.keys)[:, :, self.length:end] = bytes_view(keys)
        bytes_view(self.values)[:, :, self.length:end] = bytes_view(values)
        if scales is not None:
            self.value_scales[:, :, self.length:end] = scales
        self.columns[:, :, self.length:end] = self.incoming_columns[:, None, :]
        self.real[:, :, self.length:end] = self.incoming_real[:, None, :]
        self.length = end
        self.slot_counts += incoming
        return self.read(end)

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
        keys, values, scales = self._encoded(key_states, value_states)
        bytes_view(self.keys)[rows, :, slots] = bytes_view(keys).transpose(1, 2)
        bytes_view(self.values)[rows, :, slots] = bytes_view(values).transpose(1, 2)
        if scales is not None:
            self.value_scales[rows, :, slots] = scales.transpose(1, 2)
        self.columns[rows, :, slots] = self.incoming_columns[:, :, None]
        self.real[rows, :, slots] = self.incoming_real[:, :, None]
        return self.read()

    # --- what is stored, and what the attention reads ---------------------------------------------
    def _encoded(self, keys: torch.Tensor, values: torch.Tensor):
        """New keys and values `[N, Hkv, Q, D]` as stored, and their per-token value scales (None if none)."""
        if self.format is None:
            return keys, values, None
        return self.format.encode(keys, values, self.key_scale, self.value_scale)

    def read(self, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[N, Hkv, end, D]` in the model's dtype (dequantized), of the slots before `end` (None:
        the whole buffers)."""
        keys, values = (t if end is None else t[:, :, :end] for t in (self.keys, self.values))
        if self.format is None:
            return keys, values
        tokens = self.value_scales if end is None or self.value_scales is None else self.value_scales[:, :, :end]
        return (self.format.dequantize(keys, self.key_scale, self.dtype),
                self.format.dequantize(values, tokens if tokens is not None else self.value_scale, self.dtype))

    def read_keys(self, rows: slice, length: int) -> torch.Tensor:
        """Keys `[n, Hkv, length, D]` of the batch rows `rows` in the model's dtype: what the KV policies score."""
        keys = self.keys[rows, :, :length]
        return keys if self.format is None else self.format.dequantize(keys, self.key_scale[rows], self.dtype)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The buffers `[N, H, C, ...]` indexed by slot, by attribute name."""
        return {name: getattr(self, name) for name in ("keys", "values", "value_scales", "columns", "real")
                if getattr(self, name) is not None}

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """The per-row tensors: slot counts `[N]`, fixed scales (`fixed_scales`)."""
        return {"slot_counts": self.slot_counts, **self.fixed_scales()}

    def fixed_scales(self) -> dict[str, torch.Tensor]:
        """A quantized layer's rows' scales fixed at their prefill, `[N, Hkv, 1, Dk]` (none before it, or when not
        quantized)."""
        return {name: getattr(self, name) for name in ("key_scale", "value_scale") if getattr(self, name) is not None}

    def slot_bytes(self) -> int:
        """Bytes one slot of one row takes here: its keys and values, and a quantized slot's own scales."""
        if self.format is None:
            return 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        return self.format.slot_bytes(self.kv_heads, self.head_dim, self.dtype)

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
        """KV bytes held: keys, values and a quantized cache's scales (per slot and per row)."""
        held = (self.keys, self.values, self.value_scales, self.key_scale, self.value_scale)
        return sum(t.nbytes for t in held if t is not None)

    def reserve(self, needed: int) -> None:
        """Grow the buffers to hold `needed` slots per row, `growth` slots at a time (whole pages)."""
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise RuntimeError(f"KV buffer overflow: {needed} slots > capacity {self.max_capacity}")
        new_capacity = self._whole_pages(max(needed, self.capacity + self.growth))
        grow = new_capacity - self.capacity
        for name, tensor in self.slot_tensors().items():
            self._set(name, _grow(tensor, grow, 2))
        self._note_peak()

    def shrink(self, needed: int) -> None:
        """Cut the buffers to `needed` slots per row (whole pages) if they hold more; `needed` covers the longest
        row. A copy, so that the memory past it is freed."""
        capacity = self._whole_pages(needed)
        if capacity >= self.capacity:
            return
        if capacity < self.length:
            raise RuntimeError(f"KV buffer shrink to {capacity} slots would cut rows holding {self.length}")
        for name, tensor in self.slot_tensors().items():
            self._set(name, tensor[:, :, :capacity].clone())

    def _note_peak(self) -> None:
        """The most KV bytes held so far, of the rows that are not padding (every tensor is per row)."""
        per_row = self.nbytes() // self.batch if self.batch else 0
        self.peak_bytes = max(self.peak_bytes, per_row * (self.batch - self.padding_rows))

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
        for tensor in (self.keys, self.values, self.value_scales):
            if tensor is not None:
                raw, width = bytes_view(tensor), tensor.shape[-1]
                raw[block, :, :kept] = raw.view(-1, width).index_select(0, rows).view(count, self.kv_heads, kept, width)
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
        host, needed while rows hold different lengths. How many of them are padding the caller set first
        (`padding_rows`)."""
        for name, tensor in {**self.slot_tensors(), **self.row_tensors()}.items():
            self._set(name, bytes_view(tensor).index_select(0, rows).view(tensor.dtype))
        self.batch = len(rows)
        self._note_peak()
        if self.row_lengths is not None:
            self._set_lengths(self.row_lengths[host_rows])

    def append_rows(self, other: BufferLayer) -> None:
        """Add the rows of `other` (a cache of newly prefilled rows, one length for all) after this one's."""
        lengths = np.concatenate([self._lengths(), other._lengths()])
        capacity = max(self.capacity, other.capacity)
        theirs = {**other.slot_tensors(), **other.row_tensors()}
        for name, mine in self.slot_tensors().items():
            grown = [_grow(t, capacity - t.shape[2], 2) for t in (mine, theirs[name])]
            self._set(name, _cat(grown))
        for name, mine in self.row_tensors().items():
            self._set(name, _cat([mine, theirs[name]]))
        self.batch += other.batch
        self._note_peak()
        self._set_lengths(lengths)

    def adopt(self, arena: StepArena, role: str, rows: int) -> None:
        """Keep the buffers, counts and scales in `arena` from now on, under roles starting `role` (the decode
        loop's cache, when its step is captured: `arena.py`), with room for `rows` rows at the maximum
        capacity."""
        self.arena, self.role = arena, role
        for name, tensor in self.slot_tensors().items():
            self._set(name, tensor, rows, self.max_capacity)
        for name, tensor in self.row_tensors().items():
            self._set(name, tensor, rows)

    def _set(self, name: str, tensor: torch.Tensor, rows: int | None = None, slots: int | None = None) -> None:
        setattr(self, name, placed(self.arena, f"{self.role}{name}", tensor, rows, slots))

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
        if self.format is not None:
            raise RuntimeError("block-sparse pages of a quantized cache: the engine refuses the pair; this is a bug")
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
    raw = bytes_view(tensor)
    return torch.cat([raw, raw.new_zeros(shape)], dim=dim).view(tensor.dtype)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat` along rows, float8 by its bytes."""
    return torch.cat([bytes_view(t) for t in tensors]).view(tensors[0].dtype)
