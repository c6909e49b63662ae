"""Exact replay of a sparse rollout: one teacher-forced forward that sees what the sampler saw.

The engine records, per compression and per layer, which columns the cache held afterwards
(`EvictionEvent`). A query at column j therefore saw the columns held after the last compression
before j, plus every column fed since that compression, plus itself. `replay_masks` turns the
record into per-layer boolean masks `[N, Hs, S, S]` (`sampler_masks` for a batch's rows), under which one
forward of the model (`model.forward.response_hidden(..., masks=...)`, which may share each group's prompt)
reproduces the sampler's log-probs (to float32 rounding) with gradients available, which DistillSparse
trains through and α rebuilds the sampler's distributions with. A block-sparse rollout records instead the
pages each decode query attended (`BlockSelections`), which narrow those query rows of the dense causal mask.

A rollout sampled through a quantized cache (`--kv-dtype`) records its rows' scales (`KVScales`): its replay also
passes every layer's keys and values through the same quantization (`quantization.KVFakeQuant`). `sampler_replay`
returns both, masks and that transform, as one `SamplerView`: what every replay forward takes, so that no caller
replays the masks without the quantization (`sampler_masks`, masks alone, refuses a quantized batch).
"""

from __future__ import annotations

import torch

from ...model.attention import SamplerView
from ...model.shared_prompt import causal_masks
from ...model.structure import layer_windows, text_config
from ..batch import EvictionEvent, RolloutBatch
from ..quantization import KVFakeQuant
from .block_sparse import BlockSelections


def replay_masks(attention_mask: torch.Tensor, events: list[EvictionEvent], num_layers: int,
                 sliding_windows: list[int | None] | None = None,
                 blocks: BlockSelections | None = None) -> list[torch.Tensor]:
    """Per-layer bool masks `[N, Hs, S, S]` (Hs = 1, or KV heads for per-head selection): the plain causal
    masks (`model.shared_prompt.causal_masks`), narrowed where the sampler held less.

    attention_mask: `[N, S]` 1 on real tokens in the engine's column layout.
    """
    plain = causal_masks(attention_mask, sliding_windows or [None] * num_layers)
    batch, width = attention_mask.shape
    columns = torch.arange(width, device=attention_mask.device)
    masks = []
    for layer in range(num_layers):
        layer_events = sorted((e for e in events if e.layer == layer), key=lambda e: e.first_column)
        narrowed_by_pages = blocks is not None and layer in blocks.pages
        if not layer_events and not narrowed_by_pages:
            masks.append(plain[layer])  # the sampler saw what a dense forward sees
            continue
        heads = layer_events[0].kept_columns.shape[1] if layer_events else 1
        mask = plain[layer].expand(batch, heads, width, width).clone()
        for index, event in enumerate(layer_events):
            start = event.first_column
            stop = layer_events[index + 1].first_column if index + 1 < len(layer_events) else width
            held = torch.zeros(batch, heads, width, dtype=torch.bool, device=mask.device)
            held.scatter_(2, event.kept_columns.to(mask.device), True)
            since = (columns >= start)[None, None, :]
            mask[:, :, start:stop, :] &= (held | since)[:, :, None, :]
        if narrowed_by_pages:
            mask = blocks.restrict(mask, layer)
        mask |= torch.eye(width, dtype=torch.bool, device=mask.device)[None, None]  # every query sees itself
        masks.append(mask)
    return masks


def sampler_replay(model, batch: RolloutBatch, rows: slice | torch.Tensor | None = None) -> SamplerView:
    """Everything a teacher-forced forward of `batch`'s rows `rows` (all when None) needs to reproduce their
    sampler: the masks of what each query saw (`sampler_masks`) and, for a quantized cache, the quantization of
    every layer's keys and values with the rows' recorded scales. Pass it as `model.forward.response_hidden`'s
    `masks`."""
    rows = slice(None) if rows is None else rows
    scales = batch.kv_scales
    return SamplerView(_masks(model, batch, rows), KVFakeQuant(scales.rows(rows)) if scales is not None else None)


def sampler_masks(model, batch: RolloutBatch, rows: slice | torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per layer `[n, Hs, S, S]`, what each query of `batch`'s rows `rows` saw in the sparse sampler (its
    eviction record or page selections over the column layout): pass them to `model.forward.response_hidden`,
    whose forward then reproduces the sampler. A batch sampled through a quantized cache is refused: its replay is
    `sampler_replay`'s."""
    if batch.kv_scales is not None:
        raise ValueError(f"this batch was sampled through a {batch.kv_scales.kv_dtype} KV cache: masks alone do not "
                         "replay it; use rollout.sparsity.replay.sampler_replay (masks and the K/V quantization)")
    return _masks(model, batch, slice(None) if rows is None else rows)


def _masks(model, batch: RolloutBatch, rows: slice | torch.Tensor) -> list[torch.Tensor]:
    config = text_config(model)
    events = [EvictionEvent(e.first_column, e.layer, e.kept_columns[rows]) for e in batch.evictions]
    blocks = batch.block_selections.rows(rows) if batch.block_selections is not None else None
    return replay_masks(batch.attention_mask[rows], events, config.num_hidden_layers, layer_windows(config), blocks)
