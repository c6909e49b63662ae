"""Attention whose key mask comes from us, per layer, instead of from transformers.

transformers builds one mask for all layers from the 2-D padding mask. After eviction every layer
holds its own set of tokens (and, per head, possibly different ones), so the rollout engine and the
replay install a `MaskProvider` while they run, and the model's attention calls `attend` below. It lives
with the model because both sides use it: the sampler, and the learner's exact replay of it. It also
lets the provider see each layer's post-RoPE queries, which SnapKV, R-KV and H2O score with, and
narrow a decode query to a subset of keys it gathers (block-sparse attention reads fewer keys), and transform
every layer's keys and values before attention (the replay of a quantized KV cache: `kv_transform`).
Outside `masked_attention(...)` the model runs its normal attention, untouched. Attention logit
soft-capping (Gemma-2's `attn_logit_softcapping`: scores = cap · tanh(scores / cap)) is applied as
transformers' eager attention applies it, before the mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

IMPLEMENTATION_NAME = "sparserl_masked"


class MaskProvider(Protocol):
    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        """Bool `[N, Hm, Q, K]` (Hm = 1 or the number of KV heads): which keys each query sees."""
        ...

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> None:
        """Called before attention with post-RoPE `query [N, Hq, Q, D]` and cached `key [N, Hkv, K, D]`."""
        ...

    # Optional: `select_keys(layer_idx, query [N, Hq, 1, D], mask [N, Hm, 1, K])` for a decode query
    # returns the keys and values `[N, Hkv, K', D]` it attends to instead, with their mask `[N, Hm, 1, K']`,
    # or None to attend to every key under `mask`.
    # Optional: `kv_transform`, a `KVTransform` (or None) applied to every layer's keys and values first.


class KVTransform(Protocol):
    """What a replay does to each layer's keys and values before attention: a quantized cache's quantization
    (`rollout.quantization.KVFakeQuant`), element by element, so that it applies to a forward's keys in one piece or
    in the parts of a shared-prompt forward alike."""

    def __call__(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`key`, `value` `[N, Hkv, K, D]` as the sampler read them."""
        ...

    def rows(self, index: torch.Tensor | slice) -> KVTransform:
        """The transform of the forward's rows `index` only."""
        ...


@dataclass
class SamplerView:
    """What a teacher-forced forward needs to see what a sampler saw (`rollout.sparsity.replay.sampler_replay`): per
    layer, bool masks `[N, Hs, S, S]`, and the transform of every layer's keys and values (None: none)."""

    masks: list[torch.Tensor]
    kv_transform: KVTransform | None = None

    @classmethod
    def of(cls, masks: list[torch.Tensor] | SamplerView | None) -> SamplerView | None:
        """`masks` as a view (plain masks: no transform)."""
        return masks if masks is None or isinstance(masks, SamplerView) else cls(masks)


# The provider of the forward running now. A module global, not a ContextVar: torch.compile traces a global's read
# (the static decode step compiles with fullgraph=True, `rollout/engine/step.py`) and cannot trace a ContextVar's.
# A forward runs in one thread at a time here, and `masked_attention` restores what it replaced.
_active_provider: MaskProvider | None = None


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled-dot-product attention under the active provider's per-layer mask, with the logits
    soft-capped where transformers passes `softcap`.

    Shapes: query `[N, Hq, Q, D]`, key/value `[N, Hkv, K, D]`; returns `[N, Q, Hq, D]`.
    """
    provider = _active_provider
    if provider is None:
        raise RuntimeError("sparserl attention ran outside masked_attention(); this is a bug")
    softcap = kwargs.get("softcap")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    key, value, mask = _provided(provider, module.layer_idx, query, key, value)
    if softcap is None and q_len == 1 and query.device.type == "cuda":
        # A decode query on a GPU: one fused kernel (SDPA's memory-efficient attention takes any mask) reads the keys
        # once; the explicit matmul below would run a float-accumulating batched GEMM, a masked softmax and another
        # GEMM, half of a decode step's GPU time at 4k cached tokens.
        out = _decode_sdpa(query, key, value, mask, scaling)
    elif q_len == 1 or softcap is not None:
        # One decode token on a CPU: a plain matmul and softmax beats the CPU SDPA kernel's per-call overhead (~12%
        # of a rollout), and every decode step, dense or sparse, takes this same path. SDPA cannot
        # soft-cap, so a soft-capped layer's prefill (and replay) computes its scores here too. Queries are grouped
        # under their KV head, so that per-KV-head masks broadcast without copying keys.
        grouped = query.reshape(batch, kv_heads, group * q_len, head_dim)
        grouped_mask = mask if q_len == 1 else \
            mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(batch, mask.shape[1], group * q_len, k_len)
        scale = scaling if scaling is not None else head_dim ** -0.5
        out = _explicit_attention(grouped, key, value, grouped_mask, scale, softcap)
    elif mask.shape[1] == 1:
        # SDPA broadcasts the one mask over every head and reads each KV head for its query group itself: the
        # mask it keeps for the backward pass is [N, 1, Q, K], as transformers' own forward keeps.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    else:
        # Per-KV-head masks: each KV head with its query group is a batch entry of its own, so the mask is a view.
        out = F.scaled_dot_product_attention(
            query.reshape(batch * kv_heads, group, q_len, head_dim), key.reshape(batch * kv_heads, 1, k_len, head_dim),
            value.reshape(batch * kv_heads, 1, k_len, head_dim), enable_gqa=True, scale=scaling,
            attn_mask=mask.reshape(batch * kv_heads, 1, q_len, k_len))
    out = out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).contiguous()
    return out, None


def _provided(provider: MaskProvider, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and mask a layer's queries attend to, from the provider: its transform of the keys and values
    (a quantized sampler's replay), its mask, which it observes, and a decode query's narrowing (block-sparse)."""
    transform = getattr(provider, "kv_transform", None)
    if transform is not None:
        key, value = transform(layer_idx, key, value)
    mask = provider.attention_mask(layer_idx, query.shape[2], key.shape[2])
    provider.observe(layer_idx, query, key, mask)
    select = getattr(provider, "select_keys", None) if query.shape[2] == 1 else None
    narrowed = select(layer_idx, query, mask) if select is not None else None
    return narrowed if narrowed is not None else (key, value, mask)


def _decode_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """Decode attention `[N, Hq, 1, D]` by SDPA, each KV head with its query group as one batch entry, so that a mask
    `[N, Hm, 1, K]` (one per layer or per KV head) is a view and no key is repeated."""
    batch, q_heads, _, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    grouped = query.reshape(batch * kv_heads, group, 1, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, key.reshape(batch * kv_heads, 1, k_len, head_dim), value.reshape(batch * kv_heads, 1, k_len, head_dim),
        attn_mask=mask.expand(batch, kv_heads, 1, k_len).reshape(batch * kv_heads, 1, 1, k_len), scale=scaling,
        enable_gqa=True)
    return out.reshape(batch, q_heads, 1, head_dim)


def _explicit_attention(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                        scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap(grouped · keyᵀ · scale) masked) · value, `[N, Hkv, G·Q, D]`, with the scores
    `[N, Hkv, G·Q, K]` materialised (as transformers' eager attention does). The cap is
    transformers' own operations in their order (/cap, tanh, ·cap); None applies none."""
    scores = (grouped @ key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return probs.to(value.dtype) @ value


AttentionInterface.register(IMPLEMENTATION_NAME, attend)


class FixedMasks:
    """A mask provider of masks known in advance: per layer, bool `[N, Hm, Q, K]` (the replay of a sparse
    sampler, the parts of a shared-prompt forward), and the keys' and values' transform (a quantized sampler's)."""

    def __init__(self, masks: list[torch.Tensor], kv_transform: KVTransform | None = None):
        self.masks = masks
        self.kv_transform = kv_transform

    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        return self.masks[layer_idx]

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> None:
        pass


@contextlib.contextmanager
def masked_attention(model: torch.nn.Module, provider: MaskProvider):
    """Route the model's attention through `attend` with `provider` for the duration."""
    global _active_provider
    configs = _attention_configs(model)
    previous = [c._attn_implementation for c in configs]
    replaced, _active_provider = _active_provider, provider
    for config in configs:
        config._attn_implementation = IMPLEMENTATION_NAME
    try:
        yield
    finally:
        for config, impl in zip(configs, previous):
            config._attn_implementation = impl
        _active_provider = replaced


def _attention_configs(model: torch.nn.Module) -> list:
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return list(configs.values())
