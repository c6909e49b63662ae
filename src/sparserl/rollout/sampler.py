"""The one contract every rollout sampler implements and every caller is typed with.

Two samplers implement it: `engine.RolloutEngine` (dense, KV eviction or block-sparse attention) and
`speculative.SpeculativeSampler` (exact dense samples, drafted sparsely). The rows-in-flight scheduler
(`dispatch/scheduler.py`) drives either through it, and a step's sampler is built from a
`dispatch.spec.SamplerSpec` wherever the step samples, in this process or on a Ray worker; nobody changes a
sampler's settings after it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .batch import RolloutBatch, SamplingConfig


@runtime_checkable
class SamplerStats(Protocol):
    """What a sampler counted while it sampled (the speculative sampler's acceptance, say), to be folded over the
    shards of a step and turned into metrics."""

    def add(self, other: SamplerStats) -> None: ...

    def metrics(self, bin_size: int) -> dict[str, float]: ...


@runtime_checkable
class Sampler(Protocol):
    """Samples one response per prompt.

    `refills_rows`: whether `generate` admits waiting prompts into rows that ended (continuous batching); a
    sampler that keeps every row to the end is given its prompts `max_rows` at a time (waves) instead.
    """

    refills_rows: bool
    model: torch.nn.Module  # the policy it samples from

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *, seeds: list[int],
                 on_step: Callable[[int], None] | None = None, max_rows: int | None = None) -> RolloutBatch:
        """Row i from `seeds[i]` (its tokens a function of its seed, its prompt and the weights), at most
        `max_rows` rows decoding at once (None: all); `on_step(k)` after each step that advanced the longest row
        by k tokens."""
        ...

    def row_bytes(self, width: int, steps: int) -> int:
        """The KV bytes one row can reach, for prompts of width `width` and `steps` new tokens."""
        ...

    def take_stats(self) -> SamplerStats | None:
        """What was counted since the last call (None: nothing to count), then reset."""
        ...
