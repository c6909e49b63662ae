"""Teacher-forced forwards that read each group's prompt once (Prefix Grouper, arXiv 2506.05433).

A GRPO batch holds G responses per prompt, group by group, and at our shapes the prompt is most of every row
(121 of ~165 tokens on the SmolLM2 config, 56 of ~100 on the built-in task): a plain forward computes each prompt
G times. Here runs of consecutive rows with the same prompt (ids and padding) are groups, and the forward runs in
two parts:

1. the prompts, one row per group `[Gr, P]`, each layer's keys and values kept (`_PromptCache`);
2. every row's response `[N, T]`, its queries reading its group's prompt keys (gathered to the group's rows, so
   that autograd sums the G rows' gradients back into the one prompt) and its own earlier response keys.

Both parts run under the package's masked attention with exactly the masks of one forward over the whole
sequence (`causal_masks`: real keys, causal, each layer's sliding window), or with the replay's masks of a sparse
sampler, whose prompt rows are causal too: a sampler compresses only while it decodes. A quantized sampler's K/V
transform (`attention.SamplerView`) is elementwise, so it applies to the prompt part's keys and to the response
part's (its group's prompt keys, kept as computed, then its own) as to the one forward's. So hidden states,
log-probs and every parameter's gradient are those of the plain forward (equal to 1e-10 in float64,
`tests/test_shared_prompt.py`), for any rows: groups of any size, prompts of different lengths, a micro-batch
that cuts a group.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import FixedMasks, SamplerView, masked_attention
from .structure import (
    cache_keyword,
    layer_types,
    layer_windows,
    positions_from_mask,
    text_config,
)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the group of each row `[N]`, the first row of each group `[Gr]`): runs of consecutive rows whose prompt
    ids and mask `[N, P]` are equal."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same])
    return starts.long().cumsum(dim=0) - 1, starts.nonzero().squeeze(1)


def causal_masks(attention_mask: torch.Tensor, windows: list[int | None]) -> list[torch.Tensor]:
    """Per layer, bool `[N, 1, S, S]`: what one forward over the whole left-padded sequence sees (a real key at
    or before the query, within the layer's window), each query seeing itself too (so that padding queries,
    whose outputs nothing reads, stay finite). Layers with the same window share one tensor."""
    real = attention_mask.bool()
    columns = torch.arange(real.shape[1], device=real.device)
    distance = columns[:, None] - columns[None, :]  # [query, key]
    by_window: dict[int | None, torch.Tensor] = {}
    for window in dict.fromkeys(windows):
        seen = distance >= 0 if window is None else (distance >= 0) & (distance < window)
        by_window[window] = (real[:, None, None, :] & seen[None, None]) | (distance == 0)[None, None]
    return [by_window[window] for window in windows]


class _PromptLayer(CacheLayerMixin):
    """One layer's keys and values of the group prompts, then of every row's prompt followed by its response."""

    is_compileable = False

    def __init__(self, is_sliding: bool):
        super().__init__()
        self.is_sliding = is_sliding
        self.keys = self.values = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.keys is None:  # the prompts' forward
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=2), torch.cat([self.values, value_states], dim=2)

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class _PromptCache(Cache):
    def __init__(self, model):
        super().__init__(layers=[_PromptLayer(kind == "sliding_attention") for kind in layer_types(text_config(model))])

    def share(self, group: torch.Tensor) -> None:
        """Give every row its group's prompt keys and values (`group` `[N]`)."""
        for layer in self.layers:
            layer.keys, layer.values = layer.keys.index_select(0, group), layer.values.index_select(0, group)


def shared_prompt_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                         masks: list[torch.Tensor] | SamplerView | None = None) -> torch.Tensor:
    """Final hidden states `[N, T, H]` at the positions that predict the response tokens (those of
    `forward.response_hidden`), each group's prompt computed once. `masks`: per layer `[N, Hs, S, S]` what each
    query sees (a sparse sampler's replay), or a `SamplerView` (with its K/V transform), else `causal_masks`."""
    width = prompt_width
    group, first = prompt_groups(input_ids[:, :width], attention_mask[:, :width])
    view = SamplerView.of(masks) or SamplerView(causal_masks(attention_mask, layer_windows(text_config(model))))
    masks, transform = view.masks, view.kv_transform
    positions = positions_from_mask(attention_mask)
    cache = _PromptCache(model)
    provider = FixedMasks([mask[first, :, :width, :width] for mask in masks],
                          transform.rows(first) if transform is not None else None)
    decoder, keyword = model.get_decoder(), cache_keyword(model.get_decoder())
    with masked_attention(model, provider):
        prompts = decoder(input_ids=input_ids[first, :width], position_ids=positions[first, :width],
                          **{keyword: cache}, use_cache=True).last_hidden_state
        cache.share(group)
        provider.masks, provider.kv_transform = [mask[:, :, width:] for mask in masks], transform
        responses = decoder(input_ids=input_ids[:, width:], position_ids=positions[:, width:],
                            **{keyword: cache}, use_cache=True).last_hidden_state
    # The first response token is predicted at the prompt's last column, which its group computed.
    return torch.cat([prompts[:, -1:].index_select(0, group), responses[:, :-1]], dim=1)
