"""What every room of the rollout side reads and writes: sampling settings, the sampled batch, the eviction
record and the KV figures. The engine, the sparsity, the speculative sampler and the dispatch all import this,
and it imports none of them, so the arrows inside `rollout/` point one way.

Layout: prompts are left-padded to width P and responses right-padded to width T, so a token's column in the
`[N, P + T]` sequence is its identity for masks and for the eviction record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # types in fields, not imports at run time: block sparsity and the cache read this module
    from .quantization import KVScales
    from .sparsity.block_sparse import BlockSelections


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    eos_token_id: int | None = None
    pad_token_id: int = 0
    # Pad prompts to at least this width (the step's longest prompt): a row's columns, and so when its
    # cache is compressed, then do not depend on which rows share its batch. None: the batch's longest.
    prompt_width: int | None = None
    # The rollout scheduler's limits on rows in flight (`scheduler.py`): a KV memory budget in bytes
    # (None: none) and a row count (0: none); and how the static decode step runs (`engine/step.py`).
    kv_memory_bytes: int | None = None
    max_rows: int = 0
    compile_decode: str = "auto"


@dataclass
class EvictionEvent:
    """Just before column `first_column` was fed, layer `layer` was compressed to `kept_columns [N, Hs, B]`."""

    first_column: int
    layer: int
    kept_columns: torch.Tensor


def kv_saved(sparse_peak_bytes: float, dense_peak_bytes: float | None) -> float | None:
    """KV saved, the one figure sparserl reports under that name: 1 − the sparse sampler's measured peak bytes / the
    dense sampler's measured peak bytes on the same prompts. None where no dense run was measured (say so, rather
    than divide by a bound: a dense cache padded to the response cap, or evicted tokens, overstate it)."""
    if not dense_peak_bytes:
        return None
    return 1.0 - sparse_peak_bytes / dense_peak_bytes


STEP_COUNTS = ("step_compilations", "step_compile_seconds", "step_captures", "step_capture_seconds", "step_fallbacks")


@dataclass
class KVStats:
    """What a rollout's cache cost; bytes are measured from the buffers' own `nbytes`. `kv_dense_bytes` is a bound,
    not a measurement: what a dense cache of the rows first in flight would hold (in this cache's format, `kv_dtype`)
    at the prompt width plus the longest response *this* sampler wrote (a sparse sampler that loops to the cap
    inflates it); `kv_saved` compares measured peaks instead."""

    kv_peak_bytes: int = 0
    kv_dense_bytes: int = 0
    # How the cache stores a token: `kv_dtype` (auto: the model's dtype; fp8 or int8: quantized,
    # `rollout/quantization.py`), and the bytes one slot of one row takes over every layer (scales stored per slot
    # included): the regime a report states.
    kv_dtype: str = "auto"
    kv_slot_bytes: int = 0
    kv_peak_bytes_by_layer_type: dict[str, int] = field(default_factory=dict)
    compressions: int = 0
    compress_seconds: float = 0.0
    kept_tokens: torch.Tensor | None = None  # [N] real tokens held at the end (full-attention layers, mean)
    evicted_tokens: torch.Tensor | None = None  # [N] real tokens evicted over the rollout (same average)
    # Block-sparse attention: mean over decode steps and sparse layers of attended real keys / cached
    # real keys (1.0 for dense and eviction rollouts, which attend to all they hold).
    attended_frac: float = 1.0
    rows_in_flight: int = 0  # the most rows decoding at once (the scheduler's S; 0: not scheduled)
    waves: int = 1  # groups of rows that started together: cohorts joining freed rows, or waves run in turn
    # What running the static decode steps cost beyond the steps (`engine.step.StepCounts`): torch.compile
    # compilations and CUDA graph captures made during this rollout, the seconds they took, and fallbacks (steps
    # past dynamo's limit of shapes run uncompiled from then on, for the rest of the run).
    step_compilations: int = 0
    step_compile_seconds: float = 0.0
    step_captures: int = 0
    step_capture_seconds: float = 0.0
    step_fallbacks: int = 0
    # Captured steps kept across rollouts at the rollout's end (`StepRunner`), and the memory their tensors' storages
    # hold between rollouts (`arena.py`); 0 when the step is not captured.
    step_graphs_kept: int = 0
    step_arena_bytes: int = 0

    def add_step_counts(self, counts) -> None:
        """Count a rollout's `engine.step.StepCounts`."""
        self.step_compilations += counts.compilations
        self.step_compile_seconds += counts.compile_seconds
        self.step_captures += counts.captures
        self.step_capture_seconds += counts.capture_seconds
        self.step_fallbacks += counts.fallbacks

    @classmethod
    def merged(cls, stats: list[KVStats], rows: list[int]) -> KVStats:
        """The figures of several rollouts (`rows[i]` rows in `stats[i]`): waves and evaluation chunks run
        one after the other, a step's shards in this process or on Ray workers. The one rule for memory:
        figures are per sampler, the most one of them held at once (each sampler has its memory of its own,
        and `--rollout-kv-memory` is its budget), so peak and dense-equivalent bytes and rows in flight are
        the largest rollout's, and the same for a step sampled here or on workers. Counts and seconds add
        up, per-row figures are concatenated, the attended fraction is a mean over rows."""
        total = max(sum(rows), 1)
        per_row = {name: None if any(getattr(s, name) is None for s in stats) else
                   torch.cat([getattr(s, name) for s in stats]) for name in ("kept_tokens", "evicted_tokens")}
        return cls(
            kv_peak_bytes=max(s.kv_peak_bytes for s in stats),
            kv_dense_bytes=max(s.kv_dense_bytes for s in stats),
            kv_dtype=stats[0].kv_dtype, kv_slot_bytes=max(s.kv_slot_bytes for s in stats),
            kv_peak_bytes_by_layer_type={k: max(s.kv_peak_bytes_by_layer_type.get(k, 0) for s in stats)
                                         for k in stats[0].kv_peak_bytes_by_layer_type},
            compressions=sum(s.compressions for s in stats),
            compress_seconds=sum(s.compress_seconds for s in stats),
            attended_frac=sum(s.attended_frac * n for s, n in zip(stats, rows)) / total,
            rows_in_flight=max(s.rows_in_flight for s in stats),
            waves=sum(s.waves for s in stats),
            step_graphs_kept=max(s.step_graphs_kept for s in stats),
            step_arena_bytes=max(s.step_arena_bytes for s in stats),
            **{name: sum(getattr(s, name) for s in stats) for name in STEP_COUNTS},
            **per_row,
        )

    def summary(self, rollout_seconds: float) -> dict[str, float]:
        """The figures under the names every report uses (training metrics, evaluation, sweeps)."""
        kept, evicted = self.kept_tokens, self.evicted_tokens
        return {
            "kv_peak_bytes": self.kv_peak_bytes, "kv_dense_bytes": self.kv_dense_bytes,
            "kv_slot_bytes": self.kv_slot_bytes,
            "kv_kept_tokens_mean": float(kept.mean()), "kv_evicted_tokens_mean": float(evicted.mean()),
            "kv_kept_frac": float(kept.sum() / (kept + evicted).sum().clamp(min=1)),
            "kv_compressions": self.compressions,
            "kv_compress_time_frac": self.compress_seconds / max(rollout_seconds, 1e-9),
            "kv_attended_frac": self.attended_frac,
            "rows_in_flight": self.rows_in_flight, "rollout_waves": self.waves,
            **{name: getattr(self, name) for name in STEP_COUNTS},
            "step_graphs_kept": self.step_graphs_kept, "step_arena_bytes": self.step_arena_bytes,
        }


@dataclass
class RolloutBatch:
    """N sampled sequences. P = padded prompt width, T = padded response width."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] bool
    response_ids: torch.Tensor  # [N, T] long, right-padded
    response_mask: torch.Tensor  # [N, T] float {0,1}
    sampler_logprobs: torch.Tensor  # [N, T] float32, log-prob of each sampled token under the sampler
    prompt_lengths: torch.Tensor  # [N] long
    response_lengths: torch.Tensor  # [N] long
    ended: torch.Tensor  # [N] bool, the response ends with EOS (not cut at max length)
    rollout_seconds: float
    kv: KVStats = field(default_factory=KVStats)
    evictions: list[EvictionEvent] = field(default_factory=list)
    # The sampler's whole processed next-token distribution `[N, T, V]` as log-probs, kept when the
    # engine is asked to (what the acceptance rate needs) and V <= FULL_DISTRIBUTION_VOCAB. Above
    # that it would not fit ([64, 4096, 150k] floats is 150 GB), and α replays the sampler instead.
    sampler_distribution: torch.Tensor | None = None
    # The batch holds what the exact replay of its sampler needs: dense rollouts, or sparse ones
    # recorded with `record_evictions` (eviction events or block selections).
    replayable: bool = False
    # Block-sparse rollouts recorded with `record_evictions`: the pages each decode query attended.
    block_selections: BlockSelections | None = None
    # Sampled through a quantized cache (`--kv-dtype fp8 | int8`): the format and each row's scales, always recorded;
    # the replay quantizes every layer's keys and values with them (`sparsity.replay.sampler_replay`).
    kv_scales: KVScales | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        """`[N, P + T]` prompt and response in the column layout."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """`[N, P + T]` long, 1 on real tokens."""
        return torch.cat([self.prompt_mask.long(), self.response_mask.long()], dim=1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def left_pad(prompts: list[list[int]], pad_token_id: int,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, P]` ids and bool mask for left-padded prompts; P is the longest prompt, or `width` if larger."""
    width = max(width or 0, max(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = True
    return ids, mask
