"""One rollout's decode loop, with continuous batching: waiting requests join as finished rows leave.

`RolloutEngine.generate` runs a `DecodeLoop` over its prompts with at most `max_rows` rows decoding at
once. The loop decides and the static step computes (`step.py`): between the events that change a shape, every
decode step is one call of the same function of device tensors, which reads nothing back to the host. The loop
reads the device every `check_every` steps (and when a cohort reaches its length limit) to see which rows ended; a
row that ended (EOS or its length limit) leaves the batch, its cache rows dropped, once an eighth of the rows have
ended, and as many waiting requests as there are free rows are prefilled and join it: a *cohort*. Until it leaves, a
row that ended feeds padding, which nothing records. A cohort's rows share a prompt width, a cache length, a
compression clock and a KV policy instance, so when and how a row is compressed depends on its own steps only, never
on the rows beside it, and every row draws its tokens from its own seed (`token_draws.py`): a request samples the
same tokens whatever the rows in flight, up to float rounding in batched products. Cohorts sit in the batch in the
order they joined, each a contiguous block of rows. Compressions run between steps, on the host's clock of each
cohort.

Block-sparse rollouts keep every row to the end and admit no one (their page record is per step).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from ...model.attention import masked_attention
from ...model.clock import Stopwatch
from ...model.shared_prompt import prompt_groups
from ...model.structure import cache_keyword, positions_from_mask
from ..batch import EvictionEvent, KVStats
from ..cache import BufferCache, build_cache
from ..quantization import KVScales
from ..sparsity.block_sparse import BlockSelector, BlockSparsity
from ..sparsity.eviction import compress_rows
from ..sparsity.policies import KVPolicy
from ..arena import placed
from .rollout_attention import RolloutAttention

from .step import draw_and_record, run_decode_step
from .step_state import Responses, RowState

# A cache that no budget binds grows in LADDER_RUNGS steps from its prompt to its whole sequence (in multiples of
# GROWTH_QUANTUM slots): a few capacities per run, each a CUDA graph of the static step, and its measured peak (what
# KV saved divides by) at most one step past the rows' need, the same figure however the step runs.
LADDER_RUNGS, GROWTH_QUANTUM = 8, 16


@dataclass
class Cohort:
    """Requests prefilled together: `size` rows of the batch, in a block, that draw their first token at
    global step `start`."""

    start: int
    size: int
    policy: KVPolicy | None
    since_compression: int = 0


class DecodeLoop:
    """The state of one `RolloutEngine.generate` call (see the module). Outputs are per request, in the
    order given: `out` (`step_state.Responses`: ids, log-probs, lengths, ended, tokens fed) and `held` `[N]`."""

    def __init__(self, engine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling,
                 generator: torch.Generator | None, seeds: torch.Tensor | None, max_rows: int,
                 record_distributions: bool, on_step=None):
        self.engine, self.model, self.sampling = engine, engine.model, sampling
        self.generator, self.seeds, self.on_step = generator, seeds, on_step
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.device = prompt_ids.device
        self.dtype = next(self.model.parameters()).dtype
        self.requests, self.width = prompt_ids.shape
        self.steps = sampling.max_new_tokens
        sparsity = engine.compression
        self.block = sparsity if isinstance(sparsity, BlockSparsity) else None
        self.comp = sparsity if sparsity is not None and self.block is None else None
        if self.block is not None and max_rows < self.requests:
            raise ValueError("block-sparse rollouts keep every row to the end: run them in waves")
        self.max_rows = max_rows
        self.record_distributions = record_distributions
        self.runner = engine.step_runner(sampling.compile_decode)
        self.arena = self.runner.arena  # where the step's tensors live when it is captured (None otherwise)
        self.full = engine.full_capacity(self.width, self.steps)
        self.capacities = engine.capacities(self.width, self.steps, engine.num_layers)
        self.growth = cache_growth(self.full, self.comp.interval if self.comp is not None else None,
                                   binds=self.comp is not None and min(self.capacities) < self.full)
        self.prompt_lengths = prompt_mask.sum(dim=1)
        batch, device = self.requests, self.device
        self.out = Responses(
            ids=torch.full((batch, self.steps), sampling.pad_token_id, dtype=torch.long, device=device),
            logprobs=torch.zeros((batch, self.steps), dtype=torch.float32, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
            ended=torch.zeros(batch, dtype=torch.bool, device=device),
            live=torch.ones(batch, dtype=torch.bool, device=device),
            fed=self.prompt_lengths.clone()).placed_in(self.arena, "responses")
        self.held = torch.zeros(batch, dtype=torch.float32, device=device)  # real tokens cached when a row left
        self.left = torch.zeros(batch, dtype=torch.bool, device=device)  # whether it left (or stays as padding)
        self.padding = 0  # batch rows that ended and stay only to keep the batch at its bucket size (`_padded`)
        self.rows: RowState | None = None  # the batch rows, as the static step reads them
        self.cohorts: list[Cohort] = []  # those with rows in the batch
        self.cohorts_admitted = 0
        self.admitted = 0  # requests
        self.cache: BufferCache | None = None
        self.provider: RolloutAttention | None = None
        self.selector: BlockSelector | None = None
        self.stats = KVStats()
        self.compress_watch = Stopwatch(self.device)
        self.kept_columns: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.cache_keyword = cache_keyword(self.model)
        self.kv_scales: KVScales | None = None  # a quantized cache's scales, per request (`_record_scales`)

    @property
    def batch_rows(self) -> int:
        return 0 if self.rows is None else len(self.rows.tokens)

    def run(self) -> DecodeLoop:
        if self.steps == 0:
            return self
        with self.runner.one_rollout(self.model) as step_counts:
            self._admit(min(self.max_rows, self.requests), start=0)
            step = 0
            with masked_attention(self.model, self.provider):
                while True:
                    self._release_finished(step)
                    joining = min(self.requests - self.admitted, self.max_rows - self.batch_rows)
                    if not self.batch_rows and not joining:
                        break
                    if self.batch_rows:
                        self._decode(step)
                    if joining:
                        self._admit(joining, start=step + 1)
                    step += 1
        if self.arena is not None:
            self.out = self.out.taken_out()
            self.stats.step_arena_bytes = self.arena.nbytes()
        self.stats.step_graphs_kept = self.runner.kept_graphs
        self.stats.add_step_counts(step_counts)
        self.stats.waves = self.cohorts_admitted
        self.stats.compress_seconds = self.compress_watch.seconds()
        return self

    # --- the stages of a step ---------------------------------------------------------------------
    def _admit(self, count: int, start: int) -> None:
        """Prefill the next `count` requests as a cohort drawing its first token at step `start`, draw it and add
        the rows to the batch."""
        requests = torch.arange(self.admitted, self.admitted + count, device=self.device)
        comp = self.comp
        ids, mask = self.prompt_ids[requests], self.prompt_mask[requests]
        # A group's G rows share their prompt: it is prefilled once, and its cache rows and next-token logits are
        # given to each of them (the same values a prefill of every row computes, up to float rounding).
        group, first = prompt_groups(ids, mask)
        cache = build_cache(self.model, len(first), self.capacities, bool(comp and comp.per_head), self.dtype,
                            self.device, full_capacity=self.full, growth=self.growth,
                            page_size=self.block.page_size if self.block else 1, kv_format=self.engine.kv_format)
        provider = RolloutAttention(cache, comp.window if comp else 0, keep_queries=comp is not None,
                                    keep_mass=bool(comp and self.engine.policy.needs_attention_mass))
        with masked_attention(self.model, provider):
            provider.begin_forward(torch.arange(self.width, device=self.device).expand(len(first), -1), mask[first])
            logits = self.model(input_ids=ids[first], position_ids=positions_from_mask(mask[first]),
                                **{self.cache_keyword: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        if len(first) < count:
            for layer in cache.layers:
                layer.select_rows(group)
            provider.select_rows(group)
            logits = logits.index_select(0, group)
        self._record_scales(cache.kv_scales(), requests)
        if self.block:
            # Block attention narrows decode queries only: its page state starts after the prefill.
            provider.selector = BlockSelector(self.block, cache, self.steps, self.width, self.engine.record_evictions)
            provider.selector.fold_prompt()
        rows = RowState(
            tokens=torch.zeros(count, dtype=torch.long, device=self.device),
            fed_real=torch.ones(count, dtype=torch.bool, device=self.device),
            positions=self.prompt_lengths[requests].clone(), columns=torch.full_like(requests, self.width),
            counters=torch.zeros_like(requests), requests=requests,
            seeds=self.seeds[requests] if self.seeds is not None else None)
        if self.record_distributions and self.out.distributions is None:
            self.out.distributions = placed(self.arena, "responses distributions", torch.zeros(
                self.requests, self.steps, logits.shape[-1], dtype=torch.float32, device=self.device))
        draw_and_record(logits, rows, self.out, self.sampling, rows.counters, self.generator)
        if self.cache is None:
            self.cache, self.provider, self.selector, self.rows = cache, provider, provider.selector, rows
            if self.arena is not None:
                cache.adopt(self.arena, self.max_rows)
                provider.adopt(self.arena, self.max_rows)
            self.rows = self.rows.placed_in(self.arena, "rows", self.max_rows)
        else:
            self.cache.append_rows(cache)
            self.provider.append_rows(provider)
            self.rows = self.rows.extended(rows).placed_in(self.arena, "rows")
        self.provider.fit_capacity()
        self.cohorts.append(Cohort(start, count, self._fresh_policy() if comp else None))
        self.cohorts_admitted += 1
        self.admitted += count

    def _record_scales(self, scales: KVScales | None, requests: torch.Tensor) -> None:
        """Keep the scales a quantized cache fixed at the prefill of `requests` (its rows, in order) for the batch,
        which the replay reads (None: the cache is not quantized)."""
        if scales is None:
            return
        if self.kv_scales is None:
            blank = (None if t is None else t.new_zeros(self.requests, *t.shape[1:]) for t in (scales.keys, scales.values))
            self.kv_scales = KVScales(scales.kv_dtype, *blank)
        self.kv_scales.keys[requests] = scales.keys
        if scales.values is not None:
            self.kv_scales.values[requests] = scales.values

    def _fresh_policy(self) -> KVPolicy:
        """A copy of the engine's policy with no state: each cohort keeps its own rows' state."""
        policy = dataclasses.replace(self.engine.policy)
        policy.begin_rollout()
        return policy

    def _at_limit(self, cohort: Cohort, step: int) -> bool:
        """Whether the cohort drew its last allowed token at `step`."""
        return step - cohort.start == self.steps - 1

    def _release_finished(self, step: int) -> None:
        """Let the ended rows leave once an eighth of the batch has ended, or every row ended, as read every
        `check_every` steps; and the rows of a cohort that reached its length limit at once. This and the check
        are the loop's only reads of the device between compressions."""
        at_limit = [self._at_limit(c, step) for c in self.cohorts]
        if self.sampling.eos_token_id is None and not any(at_limit):
            return
        if self.sampling.eos_token_id is None:
            staying = np.concatenate([np.arange(first, first + c.size) for first, c, done
                                      in zip(self._firsts(), self.cohorts, at_limit) if not done] + [np.zeros(0, int)])
            return self._keep_rows(staying)
        if not any(at_limit) and step % self.engine.check_every:
            return
        still = self.out.live[self.rows.requests]
        if not any(at_limit):
            staying = int(still.sum())  # the read of a check
            rows = self.batch_rows - self.padding  # the rows an uncaptured step would hold: the same decisions
            ended = rows - staying
            leave = staying == 0 or (self.engine.release_finished_rows and self.block is None
                                     and ended >= max(1, rows // 8))
            if not leave:
                return
        index = still.nonzero().squeeze(1)
        self._keep_rows(index.cpu().numpy(), index)

    def _keep_rows(self, staying: np.ndarray, index: torch.Tensor | None = None) -> None:
        """Keep the batch rows `staying` (sorted; `index`: the same on the device, if at hand), and as many ended
        ones as padding as the row bucket asks (`_padded`)."""
        requests = self.rows.requests
        # A row's held tokens are counted when it leaves, as padding too: one kept as padding is compressed on.
        counted = ~self.left[requests]
        self.held[requests[counted]] = held_tokens(self.cache, self.out.fed[requests])[counted]
        self.left[requests] |= ~self.out.live[requests]
        if index is None:
            index = torch.as_tensor(staying, dtype=torch.long, device=self.device)
        staying, index, self.padding = self._padded(staying, index)
        for layer in self.cache.layers:
            layer.padding_rows = self.padding
        if len(staying) == self.batch_rows:
            return
        self.rows = self.rows.select(index).placed_in(self.arena, "rows")
        for layer in self.cache.layers:
            layer.select_rows(index, staying)
        self.provider.select_rows(index)
        cohorts = []
        for first, cohort in zip(self._firsts(), self.cohorts):
            # `staying` is sorted and a cohort is a block of rows: its rows that stay are a run of it.
            begin, end = np.searchsorted(staying, [first, first + cohort.size])
            if begin < end < begin + cohort.size and cohort.policy is not None:
                cohort.policy.select_rows(index[begin:end] - first)  # on the device already: no upload
            cohort.size = int(end - begin)
            if cohort.size:
                cohorts.append(cohort)
        self.cohorts = cohorts

    def _padded(self, staying: np.ndarray, index: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, int]:
        """Row buckets: a captured step runs at a batch size from a fixed ladder (`row_bucket`), so that every rollout
        of a run meets the same few and replays their graphs. With the step captured and no request waiting, the
        rows `staying` are padded up to their bucket with rows that ended (they feed padding and record nothing, as
        an ended row does until it leaves). Returns the rows kept, on the host and the device, and the padding."""
        if self.arena is None or self.admitted < self.requests or not len(staying):
            return staying, index, 0
        extra = min(row_bucket(len(staying), self.max_rows), self.batch_rows) - len(staying)
        if not extra:
            return staying, index, 0
        kept = np.union1d(staying, np.setdiff1d(np.arange(self.batch_rows), staying)[:extra])
        return kept, torch.as_tensor(kept, dtype=torch.long, device=self.device), extra

    def _firsts(self) -> list[int]:
        """Each cohort's first batch row."""
        return np.cumsum([0] + [c.size for c in self.cohorts[:-1]]).tolist()

    def _decode(self, step: int) -> None:
        """Compress the cohorts due, then run the static step: each row feeds its token and draws the next."""
        moved = False
        if self.comp is not None:
            for first, cohort in zip(self._firsts(), self.cohorts):
                due = cohort.since_compression >= self.comp.interval
                if due and self._compress(cohort, first, step - cohort.start):
                    cohort.since_compression = 0
                    # The slots past the budget are free: a step attends over its whole buffer, so cut it to what
                    # the rows fill before their next compression.
                    moved |= self.cache.shrink(self.comp.interval + 1)
        grown = self.cache.reserve(1)
        if moved or grown:
            self.provider.fit_capacity()
        if self.selector is not None:
            self.selector.begin_step(self.width + step, self.width + step + 1)
        run_decode_step(self.runner, self.model, self.cache, self.provider, self.rows, self.out, self.sampling,
                        self.cache_keyword, self.generator)
        self.cache.advance(1)
        for cohort in self.cohorts:
            cohort.since_compression += 1
        if self.on_step is not None:
            self.on_step(1)

    def _compress(self, cohort: Cohort, first: int, own_step: int) -> bool:
        """Compress the cohort's rows in every layer past its budget (`sparsity.eviction.compress_rows`).
        Records, per (column, layer), the columns each request kept."""
        self.compress_watch.start()
        column = self.width + own_step  # the column about to be fed
        # The schedule reads the cached length of the longest prompt's row (padded columns).
        budgets = self.engine.layer_budgets(self.comp.budgets.budget(column), len(self.cache.layers))
        compressed = compress_rows(cohort.policy, self.comp.window, self.cache, self.provider, first, cohort.size,
                                   budgets, record=self.engine.record_evictions)
        requests = self.rows.requests[first:first + cohort.size]
        for layer_idx, kept in compressed:
            if kept is not None:
                self.kept_columns[(column, layer_idx)].append((requests, kept))
        if compressed:
            self.stats.compressions += 1
            self.compress_watch.stop()
        return bool(compressed)

    def evictions(self) -> list[EvictionEvent]:
        """The eviction record, one event per (column, layer), every request in it (a request that had
        not joined, or had left, holds column 0: its queries there are padding)."""
        events = []
        for (column, layer), parts in sorted(self.kept_columns.items()):
            kept = parts[0][1]
            record = kept.new_zeros(self.requests, *kept.shape[1:])
            for requests, columns in parts:
                record.index_copy_(0, requests, columns)
            events.append(EvictionEvent(column, layer, record))
        return events


def row_bucket(rows: int, most: int) -> int:
    """The batch size a captured step holds `rows` rows at: the smallest of 1, 2, 3, then 4, 5, 6 and 7 times each
    power of two (4 to 7, 8, 10, 12, 14, 16, 20, ...: four a doubling, so at most a fifth of a batch past 4 rows is
    padding), or `most`, the most rows in flight."""
    ladder = [1, 2, 3] + [m << k for k in range(max(most, 1).bit_length()) for m in (4, 5, 6, 7)]
    return min([size for size in ladder if rows <= size < most] + [most])


def cache_growth(full: int, interval: int | None, binds: bool) -> int:
    """Slots a rollout's cache grows by, whatever the compile mode (so that KV saved is one figure): a compressed
    cache one interval at a time, so that its memory follows a growing schedule; one that no budget binds (dense, or
    a budget that can never bind, which then costs what the dense cache costs) an eighth of its whole sequence
    `full`, in whole quanta."""
    if binds:
        return interval
    return -(-full // (LADDER_RUNGS * GROWTH_QUANTUM)) * GROWTH_QUANTUM


def held_tokens(cache: BufferCache, fed_tokens: torch.Tensor) -> torch.Tensor:
    """Real tokens each cache row holds `[A]`, averaged over full-attention layers (all fed ones without any)."""
    held = [layer.real[:, :, : layer.length].sum(dim=-1).float().mean(dim=1)
            for layer in cache.layers if not layer.is_sliding]
    return torch.stack(held).mean(dim=0) if held else fed_tokens.float()
