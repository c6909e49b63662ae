"""Exact replay of a sparse rollout: one teacher-forced forward that sees what the sampler saw.

The engine records, per compression and per layer, which columns the cache held afterwards
(`EvictionEvent`). A query at column j therefore saw the columns held after the last compression
before j, plus every column fed since that compression, plus itself. `replay_masks` turns the
record into per-layer boolean masks `[N, Hs, S, S]`, and `replay_attention` installs them so that
one forward of the model reproduces the sampler's log-probs (to float32 rounding) with gradients
available, which DistillSparse trains through and α rebuilds the sampler's distributions with. A block-sparse rollout records instead the pages each decode
query attended (`BlockSelections`), which narrow those query rows of the dense causal mask.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...model.attention import masked_attention
from ...model.forward import text_config
from ..batch import EvictionEvent, RolloutBatch
from ..cache import layer_windows
from .block_sparse import BlockSelections


def replay_masks(attention_mask: torch.Tensor, events: list[EvictionEvent], num_layers: int,
                 sliding_windows: list[int | None] | None = None,
                 blocks: BlockSelections | None = None) -> list[torch.Tensor]:
    """Per-layer bool masks `[N, Hs, S, S]` (Hs = 1, or KV heads for per-head selection).

    attention_mask: `[N, S]` 1 on real tokens in the engine's column layout.
    """
    real = attention_mask.bool()
    batch, width = real.shape
    columns = torch.arange(width, device=real.device)
    causal = columns[None, :] <= columns[:, None]  # [S(query), S(key)]
    base = real[:, None, None, :] & causal[None, None]
    masks = []
    for layer in range(num_layers):
        window = sliding_windows[layer] if sliding_windows else None
        layer_events = sorted((e for e in events if e.layer == layer), key=lambda e: e.first_column)
        heads = layer_events[0].kept_columns.shape[1] if layer_events else 1
        mask = base.expand(batch, heads, width, width).clone()
        for index, event in enumerate(layer_events):
            start = event.first_column
            stop = layer_events[index + 1].first_column if index + 1 < len(layer_events) else width
            held = torch.zeros(batch, heads, width, dtype=torch.bool, device=real.device)
            held.scatter_(2, event.kept_columns.to(real.device), True)
            since = (columns >= start)[None, None, :]
            mask[:, :, start:stop, :] &= (held | since)[:, :, None, :]
        if blocks is not None:
            mask = blocks.restrict(mask, layer)
        if window is not None:
            mask &= (columns[None, :] > columns[:, None] - window)[None, None]
        mask |= torch.eye(width, dtype=torch.bool, device=real.device)[None, None]
        masks.append(mask)
    return masks


class _ReplayAttention:
    def __init__(self, masks: list[torch.Tensor]):
        self.masks = masks

    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        return self.masks[layer_idx]

    def observe(self, layer_idx, query, key, mask) -> None:
        pass


@contextmanager
def replay_attention(model, batch: RolloutBatch, rows: slice | torch.Tensor | None = None):
    """Inside, a teacher-forced forward of `batch.input_ids[rows]` sees what the sparse sampler saw."""
    rows = slice(None) if rows is None else rows
    config = text_config(model)
    windows = layer_windows(config)
    events = [EvictionEvent(e.first_column, e.layer, e.kept_columns[rows]) for e in batch.evictions]
    blocks = batch.block_selections.rows(rows) if batch.block_selections is not None else None
    masks = replay_masks(batch.attention_mask[rows], events, config.num_hidden_layers, windows, blocks)
    with masked_attention(model, _ReplayAttention(masks)):
        yield
