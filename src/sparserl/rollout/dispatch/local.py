"""Shards sampled in this process, one after the other, with the trainer's own model (no copy of the weights)."""

from __future__ import annotations

import time

from ..adapter import SamplerAdapter
from ..batch import SamplingConfig
from .backends import register_backend
from .shards import Shard, StepRollouts, fold_stats, sample_shard
from .spec import SamplerCache, SamplerSpec


@register_backend("local")
class LocalRollouts:
    """The in-process backend (`--rollout-workers 0`)."""

    def __init__(self, model, adapter: SamplerAdapter | None = None):
        self.samplers = SamplerCache(model)
        self.adapter = adapter
        self.version = 0

    @classmethod
    def from_config(cls, config, model, adapter: SamplerAdapter | None, device) -> LocalRollouts:
        return cls(model, adapter)

    def sync_weights(self, model, version: int) -> None:
        self.version = version  # the sampler is the trainer's model: nothing to copy

    def generate(self, shards: list[Shard], sampling: SamplingConfig, spec: SamplerSpec) -> StepRollouts:
        started = time.perf_counter()
        sampler = self.samplers.get(spec)
        results = [sample_shard(sampler, shard, sampling, self.version, self.adapter) for shard in shards]
        return StepRollouts([r.batch for r in results], time.perf_counter() - started, fold_stats(results))

    def close(self) -> None:
        pass
