"""The rollout scheduler: a batch of requests runs through a sampler at most S rows at a time.

S, the rows in flight, comes from a KV memory budget (`--rollout-kv-memory`): each row reserves the
bytes its cache can reach (`Sampler.row_bytes`): the whole sequence for a dense row, the
compressed capacity (max(prompt, budget) + one interval, the schedule's largest budget when there
is a schedule) for a sparse one, the whole cache for block-sparse attention. A compressed sampler
therefore runs proportionally more rows in the same bytes. `--max-concurrent-rows` caps S directly.

At most S rows decode at once: a row that ends leaves the batch, so it stops costing compute, and
waiting requests are prefilled into the rows freed (continuous batching, as vLLM does; the engine's
`DecodeLoop`). Block-sparse and static-batch engines, which keep every row to the end, take the
requests S at a time instead (waves), the next wave starting when the last row of one ends.

Every row samples from its own seed, and every request is padded to the same prompt width, so a
row's tokens do not depend on S, on which rows share the batch with it, or on how a step is sharded:
what changes with S is float rounding in batched matrix products (nothing in float64).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ConfigError
from ..batch import EvictionEvent, KVStats, RolloutBatch, SamplingConfig
from ..quantization import KVScales
from ..sampler import Sampler
from ..sizes import parse_memory
from ..sparsity.block_sparse import BlockSelections

AUTO_MEMORY_SHARE = 0.9  # of the memory free after the weights, as vLLM's gpu_memory_utilization
# Rows an inference command decodes at once when neither --max-concurrent-rows nor --rollout-kv-memory is set.
INFERENCE_ROWS = 256


@dataclass(frozen=True)
class RowLimits:
    """The user's settings of how rows decode: a KV memory budget in bytes for the rows in flight (None: none), a row
    count (0: none), and how the static decode step runs (`engine.step.StepRunner`: auto, true or false)."""

    kv_memory_bytes: int | None = None
    max_rows: int = 0
    compile_decode: str = "auto"

    @classmethod
    def from_rollout_config(cls, rollout, device: torch.device) -> RowLimits:
        """`--rollout-kv-memory` (a size, or auto: a share of what is free on `device`), `--max-concurrent-rows` and
        `--compile-decode`."""
        return cls(resolve_kv_memory(rollout.rollout_kv_memory, device), rollout.max_concurrent_rows,
                   rollout.compile_decode)

    def for_inference(self) -> RowLimits:
        """These limits, or INFERENCE_ROWS rows at a time when none is set (an evaluation's prompts would
        otherwise all decode at once)."""
        if self.kv_memory_bytes is not None or self.max_rows:
            return self
        return dataclasses.replace(self, max_rows=INFERENCE_ROWS)

    def sampling_fields(self) -> dict:
        """These settings as `SamplingConfig` takes them."""
        return {"kv_memory_bytes": self.kv_memory_bytes, "max_rows": self.max_rows,
                "compile_decode": self.compile_decode}


def step_seed(seed: int, step: int) -> int:
    """The seed of training step `step` of a run seeded `seed`: its prompts and its rows' sampling seeds derive
    from it (`sparserl train` and the TRL integration alike)."""
    return seed * 1_000_003 + step


def request_seed(seed: int, row: int, stream: int = 0) -> int:
    """The sampling seed of row `row` of a batch seeded `seed` (a step's, an evaluation's): an
    independent stream per (seed, row), and per `stream` where one seed serves several batches (0: the first)."""
    entropy = [seed, row] + ([stream] if stream else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on `device` now (after the weights are loaded): the GPU's, or the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def resolve_kv_memory(setting: str | None, device: torch.device) -> int | None:
    """The KV budget in bytes for the --rollout-kv-memory `setting` (None: no budget)."""
    if setting is None:
        return None
    size = parse_memory(setting)
    return int(AUTO_MEMORY_SHARE * free_memory_bytes(device)) if size == "auto" else size


def rows_in_flight(sampler: Sampler, sampling: SamplingConfig, width: int, requests: int) -> int:
    """S for `requests` rows: the KV budget's rows, capped by `sampling.max_rows` and by the requests."""
    rows = requests
    if sampling.max_rows:
        rows = min(rows, sampling.max_rows)
    if sampling.kv_memory_bytes is not None:
        each = sampler.row_bytes(width, sampling.max_new_tokens)
        fits = sampling.kv_memory_bytes // each
        if fits < 1:
            raise ConfigError(f"rollout_kv_memory {sampling.kv_memory_bytes / 2**20:.2f} MiB holds no row: one "
                              f"row of this cache needs {each / 2**20:.2f} MiB ({width}-token prompts, "
                              f"{sampling.max_new_tokens} new tokens); give at least that")
        rows = min(rows, fits)
    return rows


def schedule_rollouts(sampler: Sampler, prompts: list[list[int]], sampling: SamplingConfig,
                      seeds: list[int], on_step=None) -> RolloutBatch:
    """Sample one response per prompt (row i from `seeds[i]`), at most S rows at a time (see the module)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    width = max(sampling.prompt_width or 0, max(len(p) for p in prompts))
    sampling = dataclasses.replace(sampling, prompt_width=width)
    rows = rows_in_flight(sampler, sampling, width, len(prompts))
    if sampler.refills_rows:
        batch = sampler.generate(prompts, sampling, seeds=seeds, on_step=on_step, max_rows=rows)
        batch.kv.rows_in_flight = rows
        return batch
    waves = [sampler.generate(prompts[start:start + rows], sampling, seeds=seeds[start:start + rows], on_step=on_step)
             for start in range(0, len(prompts), rows)]
    merged = merge_waves(waves, sampling.pad_token_id)
    merged.kv.rows_in_flight = rows
    return merged


def merge_waves(waves: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """One batch of the waves' rows, in order. The waves share their prompt width and compression
    clock, so their eviction records line up event by event; a wave that had ended before an event
    holds column 0 there (its later queries are padding). Peak memory is the largest wave's: they
    run one after the other."""
    if len(waves) == 1:
        return waves[0]
    span = max(w.response_ids.shape[1] for w in waves)

    def right_pad(tensors: list[torch.Tensor], value) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(t, (0, span - t.shape[1]), value=value) if t.dim() == 2 else
                          torch.nn.functional.pad(t, (0, 0, 0, span - t.shape[1]), value=value) for t in tensors])

    distributions = [w.sampler_distribution for w in waves]
    return RolloutBatch(
        prompt_ids=torch.cat([w.prompt_ids for w in waves]),
        prompt_mask=torch.cat([w.prompt_mask for w in waves]),
        response_ids=right_pad([w.response_ids for w in waves], pad_token_id),
        response_mask=right_pad([w.response_mask for w in waves], 0.0),
        sampler_logprobs=right_pad([w.sampler_logprobs for w in waves], 0.0),
        prompt_lengths=torch.cat([w.prompt_lengths for w in waves]),
        response_lengths=torch.cat([w.response_lengths for w in waves]),
        ended=torch.cat([w.ended for w in waves]),
        rollout_seconds=sum(w.rollout_seconds for w in waves),
        kv=KVStats.merged([w.kv for w in waves], [len(w) for w in waves]),
        evictions=_merge_evictions(waves),
        sampler_distribution=right_pad(distributions, 0.0) if all(d is not None for d in distributions) else None,
        replayable=all(w.replayable for w in waves),
        block_selections=_merge_blocks([w.block_selections for w in waves]),
        kv_scales=KVScales.cat([w.kv_scales for w in waves]),
    )


def _merge_evictions(waves: list[RolloutBatch]) -> list[EvictionEvent]:
    by_event: dict[tuple[int, int], dict[int, torch.Tensor]] = defaultdict(dict)
    for index, wave in enumerate(waves):
        for event in wave.evictions:
            by_event[(event.first_column, event.layer)][index] = event.kept_columns
    merged = []
    for (column, layer), kept in sorted(by_event.items()):
        some = next(iter(kept.values()))
        parts = [kept.get(i, some.new_zeros(len(w), *some.shape[1:])) for i, w in enumerate(waves)]
        merged.append(EvictionEvent(column, layer, torch.cat(parts)))
    return merged


def _merge_blocks(records: list[BlockSelections | None]) -> BlockSelections | None:
    if any(r is None for r in records):
        return None
    first = records[0]
    return BlockSelections(first.page_size, first.first_column,
                           {layer: torch.cat([r.pages[layer] for r in records]) for layer in first.pages})
