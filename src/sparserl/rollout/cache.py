"""The engine's KV cache: one `BufferLayer` per decoder layer (`cache_layer.py`: preallocated buffers that evict in
place, and so really free memory, optionally quantized), what the static decode step reads of it as a step
participant (`engine/participants.py`), and the bytes it holds.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..model.structure import layer_types, layer_windows, text_config
from .cache_layer import BufferLayer
from .arena import StepArena
from .quantization import KVFormat, KVScales

__all__ = ["BufferCache", "BufferLayer", "build_cache"]


class BufferCache(Cache):
    """The engine's cache: one `BufferLayer` per decoder layer."""

    def __init__(self, layers: list[BufferLayer]):
        super().__init__(layers=layers)

    def append_rows(self, other: BufferCache) -> None:
        """Add the rows of `other` (newly prefilled, same layers) after this cache's."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.append_rows(theirs)

    def adopt(self, arena: StepArena, rows: int) -> None:
        """Keep every layer's buffers in `arena` from now on (`arena.py`), with room for `rows` rows."""
        for index, layer in enumerate(self.layers):
            layer.adopt(arena, f"layer {index} ", rows)

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
        step twice writes the same values to them. A quantized cache's fixed scales too, which it only reads."""
        return [t for layer in self.layers for t in (*layer.slot_tensors().values(), *layer.fixed_scales().values())]

    def step_state(self) -> list[torch.Tensor]:
        """The counts the static step advances (each layer's `slot_counts`)."""
        return [layer.slot_counts for layer in self.layers]

    def step_key(self) -> tuple:
        return ()

    def varying_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Rows and capacity: `[N, H, C, ...]` buffers; rows: fixed scales `[N, Hkv, 1, Dk]` and `[N]` counts."""
        slots = [t for layer in self.layers for t in layer.slot_tensors().values()]
        rows = [t for layer in self.layers for t in layer.fixed_scales().values()] + self.step_state()
        return [(t, (0, 2)) for t in slots] + [(t, (0,)) for t in rows]

    def begin_step(self, rows) -> None:
        """The decode step feeds one token per row of `rows` (`engine.step_state.RowState`)."""
        self.begin_static(rows.columns[:, None], rows.fed_real[:, None])

    def end_step(self) -> None:
        self.end_static()

    def peak_bytes(self) -> dict[str, int]:
        totals = {"full_attention": 0, "sliding_attention": 0}
        for layer in self.layers:
            totals["sliding_attention" if layer.is_sliding else "full_attention"] += layer.peak_bytes
        return totals

    def slot_bytes(self) -> int:
        """KV bytes one token takes in one row, over every layer (a quantized slot's own scales included): what a
        dense cache holds per row and token."""
        return sum(layer.slot_bytes() for layer in self.layers)

    def kv_scales(self) -> KVScales | None:
        """A quantized cache's rows' fixed scales over every layer (None when not quantized)."""
        first = self.layers[0]
        if first.format is None:
            return None
        keys = torch.stack([layer.key_scale[:, :, 0] for layer in self.layers], dim=1)
        values = None if first.value_scale is None else \
            torch.stack([layer.value_scale[:, :, 0] for layer in self.layers], dim=1)
        return KVScales(first.format.name, keys, values)


def build_cache(model, batch: int, capacities: list[int], per_head_selection: bool,
                dtype: torch.dtype, device: torch.device, full_capacity: int, growth: int = 64,
                page_size: int = 1, kv_format: KVFormat | None = None) -> BufferCache:
    """One buffer layer per decoder layer, holding up to `capacities[i]` slots and growing
    `growth` slots at a time (capacities kept multiples of `page_size`); sliding-window layers get
    the dense `full_capacity`. `kv_format`: every layer stores its keys and values quantized (None: in `dtype`)."""
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
            page_size=page_size, is_sliding=sliding, kv_format=kv_format,
        ))
    return BufferCache(layers)
