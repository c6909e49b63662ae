"""A step's shards: fixed sets of whole prompt groups, how one is sampled, and the learner's batch of them.

A step's prompt groups are split into `rollout_shards` fixed shards (`plan_shards`). Every row samples from its
own seed, derived from (step seed, row), and every shard pads its prompts to the step's longest, so neither the
shards, nor where they are sampled (in this process one after the other, `local.py`, or on Ray workers,
`ray_workers.py`), nor the rows in flight change a sampled token. `sample_shard` is what both backends run: the
shard's rows through the rows-in-flight scheduler, DistillSparse's adapter on while they sample.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from ...model.clock import now
from ..adapter import SamplerAdapter, sampler_context
from ..batch import KVStats, RolloutBatch, SamplingConfig
from ..sampler import Sampler, SamplerStats
from .scheduler import request_seed, schedule_rollouts


@dataclass(frozen=True)
class Shard:
    """Whole prompt groups sampled as one batch: `prompts` holds each prompt G times, group by group;
    `seeds` one sampling seed per row."""

    index: int
    prompts: list[list[int]]
    seeds: list[int]


def plan_shards(prompts: list[list[int]], group_size: int, shards: int, step_seed: int) -> list[Shard]:
    """Split the step's rows (groups of `group_size` consecutive rows) into `shards` contiguous shards
    of whole groups, the first ones one group larger when they do not divide evenly."""
    groups = len(prompts) // group_size
    if groups * group_size != len(prompts) or not 1 <= shards <= groups:
        raise ConfigError(f"cannot split {len(prompts)} rows in groups of {group_size} into {shards} shards")
    plan, start = [], 0
    for index in range(shards):
        count = groups // shards + (index < groups % shards)
        rows = range(start * group_size, (start + count) * group_size)
        plan.append(Shard(index, prompts[rows.start:rows.stop], [request_seed(step_seed, row) for row in rows]))
        start += count
    return plan


@dataclass
class ShardResult:
    """One sampled shard; `version`: the weights it was sampled with; `stats`: what the sampler counted."""

    index: int
    batch: RolloutBatch
    version: int
    compute_seconds: float
    stats: SamplerStats | None = None
    weight_load_seconds: float = 0.0


def sample_shard(sampler: Sampler, shard: Shard, sampling: SamplingConfig, version: int,
                 adapter: SamplerAdapter | None = None) -> ShardResult:
    """The shard's rows sampled by `sampler` (at most the rows `sampling` allows at once), with DistillSparse's
    adapter on while they are (when there is one)."""
    device = next(sampler.model.parameters()).device
    started = now(device)
    sampler.model.eval()
    with sampler_context(adapter):
        batch = schedule_rollouts(sampler, shard.prompts, sampling, shard.seeds)
    return ShardResult(shard.index, batch, version, now(device) - started, sampler.take_stats())


@dataclass
class StepRollouts:
    """All shards of a step, in shard order, and what sampling them cost."""

    shards: list[RolloutBatch]
    wall_seconds: float  # from the request to the last shard back
    stats: SamplerStats | None = None  # what the samplers counted, over every shard
    retries: int = 0  # shards sampled again because their worker died or hung
    timeouts: int = 0  # of which hung past rollout_timeout
    timings: dict[str, float] = field(default_factory=dict)  # weight push and transfer (Ray only)


def fold_stats(results: list[ShardResult]) -> SamplerStats | None:
    """The shards' sampler counts as one (None when the samplers counted nothing)."""
    counted = [r.stats for r in results if r.stats is not None]
    if not counted:
        return None
    total = type(counted[0])()
    for stats in counted:
        total.add(stats)
    return total


def concat_rollouts(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """One batch of the shards' rows for the learner: prompts left-padded and responses right-padded
    to the widest shard. The shards' eviction records and sampler distributions refer to their own
    column layouts, so the merged batch carries none; the replay and α read the shards themselves.
    One shard is returned as it is."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.prompt_ids.shape[1] for b in batches)
    span = max(b.response_ids.shape[1] for b in batches)

    def pad(tensors, size, value, left=False):
        padded = []
        for t in tensors:
            extra = size - t.shape[1]
            fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
            padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
        return torch.cat(padded)

    return RolloutBatch(
        prompt_ids=pad([b.prompt_ids for b in batches], width, pad_token_id, left=True),
        prompt_mask=pad([b.prompt_mask for b in batches], width, False, left=True),
        response_ids=pad([b.response_ids for b in batches], span, pad_token_id),
        response_mask=pad([b.response_mask for b in batches], span, 0.0),
        sampler_logprobs=pad([b.sampler_logprobs for b in batches], span, 0.0),
        prompt_lengths=torch.cat([b.prompt_lengths for b in batches]),
        response_lengths=torch.cat([b.response_lengths for b in batches]),
        ended=torch.cat([b.ended for b in batches]),
        rollout_seconds=sum(b.rollout_seconds for b in batches),
        kv=KVStats.merged([b.kv for b in batches], [len(b) for b in batches]),
    )


def move_to(value, device: torch.device):
    """`value` (a tensor, or a dataclass, list, tuple or dict holding tensors) with every tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: move_to(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


def rollout_metrics(batch: RolloutBatch, rollouts: StepRollouts) -> dict[str, float]:
    """What a step's rollouts were and cost. batch: the merged shards."""
    lengths = batch.response_lengths.float()
    return {
        "response_len_mean": float(lengths.mean()), "response_len_max": float(lengths.max()),
        "truncated_frac": float((~batch.ended).float().mean()),
        **batch.kv.summary(batch.rollout_seconds),
        "rollout_s": rollouts.wall_seconds,
        "tokens_per_s": float(batch.response_mask.sum()) / max(rollouts.wall_seconds, 1e-9),
        "rollout_retries": rollouts.retries, "rollout_timeouts": rollouts.timeouts, **rollouts.timings,
    }
