"""SnapKV (Li et al., 2024): the observation window's attention onto the cache, pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from ....errors import ConfigError
from .base import (
    KERNEL_HELP,
    POOLING_HELP,
    KVPolicy,
    ScoringInputs,
    additive_mask,
    option,
    register,
)


@register
@dataclass
class SnapKV(KVPolicy):
    """Attention of the observation-window queries onto the cache, pooled (SnapKV, Li et al. 2024).

    Candidates of the softmax are all real slots, the window's own keys included, with no causal
    mask inside the window: the window slots are kept anyway, so this only changes the softmax
    normaliser, and query columns are not part of `ScoringInputs`. Padding queries add nothing.
    The one `pooling` choice serves both the pooling over a KV group's query heads and the 1-D
    smoothing along the slots (max-pool or avg-pool, stride 1, padding kernel // 2, as the
    reference's `F.max_pool1d` / `F.avg_pool1d`, which counts the zero padding in the mean).

    The logits are q·k/√D for every model, as in the references (SnapKV, kvpress), and so is H2O's
    mass (`decode_loop.RolloutAttention._accumulate_mass`): neither a model's own scale (Gemma's
    query_pre_attn_scalar) nor Gemma-2's attention soft-capping enters, on purpose. The score only
    ranks tokens to keep, and the replay reads the kept columns, not the scores, so it stays exact
    either way; tanh is increasing, so each query orders keys the same capped or not, and a cap of
    50 moves a logit by 1.3% at 10 and 5% at 20: only sums over queries of the largest logits could
    rank differently, which is not worth a per-family rule in every policy.
    """

    name: ClassVar[str] = "snapkv"
    kernel_size: int = option(7, KERNEL_HELP)
    pooling: Literal["max", "mean"] = option("max", POOLING_HELP)

    def __post_init__(self):
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"kv_kernel_size must be odd and >= 1, so that pooling keeps the length; "
                              f"got {self.kernel_size}")
        if self.pooling not in ("max", "mean"):
            raise ConfigError(f"kv_pooling must be 'max' or 'mean', not {self.pooling!r}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        keys = inputs.keys.float()
        queries = inputs.queries.to(device=keys.device, dtype=torch.float32)
        n, hkv, length, dim = keys.shape
        hq, w = queries.shape[1], queries.shape[2]
        # Query head h reads KV head h // group (GQA), so group the queries under their KV head.
        grouped = queries.view(n, hkv, hq // hkv, w, dim)
        # In place on the fresh products (the same kernels, so the same values as out of place); masks
        # that would change nothing (every slot real, every window query real) are skipped.
        # The product einsum("nhgwd,nhld->nhgwl") makes, as the same batched matmul without its overhead.
        logits = torch.matmul(grouped.reshape(n, hkv, hq // hkv * w, dim), keys.transpose(-1, -2))
        logits = logits.view(n, hkv, hq // hkv, w, length).div_(dim ** 0.5)
        if not inputs.all_real():
            logits.add_(additive_mask(inputs.real)[:, :, None, None, :])
        probs = logits.softmax(dim=-1)
        if not inputs.every_row_real():  # a row with no real slot softmaxes to NaN: nothing to rank, so zero
            probs.nan_to_num_(0.0)
        if not inputs.all_queries_real():
            probs.mul_(inputs.query_real.to(probs)[:, None, None, :, None])
        summed = probs.sum(dim=3)  # [N, Hkv, group, L]
        if self.pooling == "max":  # the max over the group, one head at a time (exact, cheaper than amax)
            pooled = summed[:, :, 0]
            for head in range(1, summed.shape[2]):
                pooled = torch.maximum(pooled, summed[:, :, head])
        else:
            pooled = summed.mean(dim=2)
        flat = pooled.reshape(n * hkv, 1, length)
        pad = self.kernel_size // 2
        if self.pooling == "max":
            flat = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            flat = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        return flat.view(n, hkv, length)
