"""The sparse sampler a config asks for: KV eviction, block-sparse attention or neither (a full cache, which is
sparse only when stored quantized, `--kv-dtype`), and the adaptive budget controller that `--kv-schedule adaptive`
hands to training."""

from __future__ import annotations

from .block_sparse import ALWAYS_KEPT, BlockSparsity
from .budgets import AdaptiveBudget
from .eviction import KVCompression

Sparsity = KVCompression | BlockSparsity


def sparsity_from_config(rollout) -> Sparsity | None:
    """What a `RolloutConfig` asks for (`rollout.sparsity`): KV eviction, block attention, or None (`none`: the
    cache keeps every token)."""
    if rollout.sparsity == "none":
        return None
    if rollout.sparsity == "block":
        return BlockSparsity.from_rollout_config(rollout)
    return KVCompression.from_rollout_config(rollout)


def budgeted_sparsity(rollout, command: str) -> Sparsity:
    """`sparsity_from_config` for `command`, which works on the sampler's budget: `--sparsity none` has none."""
    sparsity = sparsity_from_config(rollout)
    if sparsity is None:
        from ...errors import ConfigError

        raise ConfigError(f"{command} works on a KV budget, and --sparsity none keeps every token: use --sparsity "
                          "eviction (or block)")
    return sparsity


def adaptive_budget(rollout) -> AdaptiveBudget:
    """The controller of `--kv-schedule adaptive`, from `kv_budget`: it moves an interval's worth of tokens at a
    time and never below the window (eviction), or a page at a time and never below the always-kept pages (block)."""
    if rollout.sparsity == "block":
        return AdaptiveBudget(rollout.kv_budget, rollout.alpha_bin_size, rollout.alpha_tau,
                              step=rollout.block_page_size, floor=ALWAYS_KEPT * rollout.block_page_size)
    return AdaptiveBudget(rollout.kv_budget, rollout.alpha_bin_size, rollout.alpha_tau,
                          step=rollout.kv_interval, floor=rollout.kv_window + 1)
