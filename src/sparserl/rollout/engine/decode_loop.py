"""One rollout's decode loop, with continuous batching: waiting requests join as finished rows leave.

`RolloutEngine.generate` runs a `DecodeLoop` over its prompts with at most `max_rows` rows decoding at
once. A row that has ended (EOS or its length limit) leaves the batch, its cache rows dropped, once an
eighth of the rows in the batch have ended, and as many waiting requests as there are free rows are
prefilled and join it: a *cohort*. A cohort's rows share a prompt width, a cache length, a compression
clock and a KV policy instance, so when and how a row is compressed depends on its own steps only,
never on the rows beside it, and every row draws its tokens from its own seed (`token_draws.py`): a
request samples the same tokens whatever the rows in flight, up to float rounding in batched products.
Cohorts sit in the batch in the order they joined, each a contiguous block of rows.

Block-sparse rollouts keep every row to the end and admit no one (their page record is per step).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...model.attention import masked_attention
from ...model.clock import Stopwatch
from ...model.shared_prompt import prompt_groups
from ...model.structure import cache_keyword, positions_from_mask
from ..batch import EvictionEvent, KVStats
from ..cache import BufferCache, build_cache
from ..sparsity.block_sparse import BlockSelector, BlockSparsity
from ..sparsity.eviction import compress_rows
from ..sparsity.policies import KVPolicy, additive_mask
from .token_draws import draw_tokens, row_uniforms


class RolloutAttention:
    """The mask provider during a rollout: masks from the cache, and the queries policies score with."""

    def __init__(self, cache: BufferCache, window: int, keep_queries: bool, keep_mass: bool,
                 selector: BlockSelector | None = None):
        self.cache = cache
        self.selector = selector
        self.window = window
        self.keep_queries = keep_queries
        self.keep_mass = keep_mass
        self.query_columns: torch.Tensor | None = None  # [N, Q]
        self.query_real: torch.Tensor | None = None  # [N, Q]
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [N, Hq, <=w, D]
        self.window_real: torch.Tensor | None = None  # [N, <=w]
        self.mass: dict[int, torch.Tensor] = {}  # layer -> [N, Hkv, L]

    def begin_forward(self, columns: torch.Tensor, real: torch.Tensor) -> None:
        self.query_columns, self.query_real = columns, real
        self.cache.set_incoming(columns, real)
        if self.keep_queries:
            previous = self.window_real if self.window_real is not None else real[:, :0]
            self.window_real = torch.cat([previous, real], dim=1)[:, -self.window:]

    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        return self.cache.layers[layer_idx].visible(self.query_columns)

    def select_keys(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.selector.select(layer_idx, query, mask) if self.selector is not None else None

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> None:
        layer = self.cache.layers[layer_idx]
        if layer.is_sliding:
            return
        if self.keep_queries:
            previous = self.queries.get(layer_idx)
            joined = query if previous is None else torch.cat([previous, query], dim=2)
            self.queries[layer_idx] = joined[:, :, -self.window:]
        if self.keep_mass:
            self._accumulate_mass(layer_idx, query, key, mask)

    def _accumulate_mass(self, layer_idx, query, key, mask) -> None:
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        group = q_heads // kv_heads
        grouped = query.reshape(batch, kv_heads, group * q_len, dim)
        logits = grouped @ key.transpose(-1, -2) / dim ** 0.5
        # The mask [N, Hm, Q, K] broadcast over the group (no repeated copy of it).
        logits.view(batch, kv_heads, group, q_len, -1).add_(additive_mask(mask)[:, :, None])
        probs = logits.softmax(dim=-1).nan_to_num_(0.0)
        received = probs.sum(dim=2)  # [N, Hkv, K]
        previous = self.mass.get(layer_idx)
        if previous is not None:
            received[:, :, : previous.shape[2]] += previous
        self.mass[layer_idx] = received

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (the others finished); called after the cache dropped them, so
        the mass spans the slots the layer still holds (fewer when the longest rows left)."""
        self.queries = {layer: q.index_select(0, rows) for layer, q in self.queries.items()}
        self.mass = {layer: m.index_select(0, rows)[:, :, : self.cache.layers[layer].length]
                     for layer, m in self.mass.items()}
        if self.window_real is not None:
            self.window_real = self.window_real.index_select(0, rows)

    def append_rows(self, other: RolloutAttention) -> None:
        """Add the rows of `other` (the provider of newly prefilled rows) after this one's. Their query
        window is no wider than ours (the same prompt width, fewer steps): it is padded on the left
        with unreal queries, which the policies mask; their attention mass is padded with zeros."""
        if self.window_real is not None:
            padding = self.window_real.shape[1] - other.window_real.shape[1]
            self.queries = {layer: torch.cat([q, F.pad(other.queries[layer], (0, 0, padding, 0))])
                            for layer, q in self.queries.items()}
            self.window_real = torch.cat([self.window_real, F.pad(other.window_real, (padding, 0), value=False)])
        # Called after the cache took the rows: the mass spans the slots the layer now holds.
        self.mass = {layer: _cat_padded(m, other.mass[layer])[:, :, : self.cache.layers[layer].length]
                     for layer, m in self.mass.items()}

    def after_keep(self, layer_idx: int, slots: torch.Tensor, first_row: int, length: int) -> None:
        """Rows `first_row`... kept the slots `slots [n, Hs, B]`; the layer now holds `length` slots at most."""
        if layer_idx not in self.mass:
            return
        mass = self.mass[layer_idx]
        per_head = slots if slots.shape[1] != 1 else slots.expand(-1, mass.shape[1], -1)
        if slots.shape[0] == mass.shape[0]:
            self.mass[layer_idx] = mass.gather(2, per_head)
            return
        block = slice(first_row, first_row + slots.shape[0])
        kept = slots.shape[2]
        mass[block, :, :kept] = mass[block].gather(2, per_head)
        mass[block, :, kept:] = 0.0
        self.mass[layer_idx] = mass[:, :, :length]


def _cat_padded(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """`[A + k, H, max(L1, L2)]` of `mine [A, H, L1]` and `theirs [k, H, L2]`, zeros where one is shorter."""
    length = max(mine.shape[2], theirs.shape[2])
    return torch.cat([F.pad(t, (0, length - t.shape[2])) for t in (mine, theirs)])


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
    order given: `response_ids`, `logprobs` `[N, T]`, `lengths`, `ended`, `held`, `fed_tokens` `[N]`."""

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
        self.full = engine.full_capacity(self.width, self.steps)
        self.capacities = engine.capacities(self.width, self.steps, engine.num_layers)
        # Compressed buffers grow an interval at a time, so that memory follows a growing schedule; a budget
        # that can never bind grows as the dense cache does (and so costs the same memory when rows leave).
        self.growth = self.comp.interval if self.comp and min(self.capacities) < self.full else 64
        self.prompt_lengths = prompt_mask.sum(dim=1)
        batch, device = self.requests, self.device
        self.response_ids = torch.full((batch, self.steps), sampling.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch, self.steps), dtype=torch.float32, device=device)
        self.live = torch.ones(batch, dtype=torch.bool, device=device)  # still generating
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.held = torch.zeros(batch, dtype=torch.float32, device=device)  # real tokens cached when a row left
        self.fed_tokens = self.prompt_lengths.clone()
        self.distributions: torch.Tensor | None = None  # [N, T, V] when recorded
        self.rows = torch.zeros(0, dtype=torch.long, device=device)  # the request of each batch row
        self.row_start = torch.zeros(0, dtype=torch.long, device=device)  # its cohort's start
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
        # [A]: the tokens the next forward feeds, which of them are real, and which rows go on after them.
        self.token = self.fed_real = self.still = None

    def run(self) -> DecodeLoop:
        if self.steps == 0:
            return self
        logits = self._admit(min(self.max_rows, self.requests), start=0)
        with masked_attention(self.model, self.provider):
            step = 0
            while True:
                self._draw(logits, step)
                self._release_finished(step)
                joining = min(self.requests - self.admitted, self.max_rows - len(self.rows))
                if not len(self.rows) and not joining:
                    break
                logits = self._decode(step) if len(self.rows) else None
                if joining:
                    joined = self._admit(joining, start=step + 1)
                    logits = joined if logits is None else torch.cat([logits, joined])
                step += 1
        self.stats.waves = self.cohorts_admitted
        self.stats.compress_seconds = self.compress_watch.seconds()
        return self

    # --- the stages of a step ---------------------------------------------------------------------
    def _admit(self, count: int, start: int) -> torch.Tensor:
        """Prefill the next `count` requests as a cohort drawing its first token at step `start`; returns
        their next-token logits `[count, V]`."""
        requests = torch.arange(self.admitted, self.admitted + count, device=self.device)
        comp = self.comp
        ids, mask = self.prompt_ids[requests], self.prompt_mask[requests]
        # A group's G rows share their prompt: it is prefilled once, and its cache rows and next-token logits are
        # given to each of them (the same values a prefill of every row computes, up to float rounding).
        group, first = prompt_groups(ids, mask)
        cache = build_cache(self.model, len(first), self.capacities, bool(comp and comp.per_head), self.dtype,
                            self.device, full_capacity=self.full, growth=self.growth,
                            page_size=self.block.page_size if self.block else 1)
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
        # Block attention narrows decode queries only: its page state starts after the prefill.
        selector = BlockSelector(self.block, cache, self.steps, self.width, self.engine.record_evictions) \
            if self.block else None
        provider.selector = selector
        if self.cache is None:
            self.cache, self.provider, self.selector = cache, provider, selector
        else:
            self.cache.append_rows(cache)
            self.provider.append_rows(provider)
        self.rows = torch.cat([self.rows, requests])
        self.row_start = torch.cat([self.row_start, torch.full((count,), start, device=self.device)])
        self.cohorts.append(Cohort(start, count, self._fresh_policy() if comp else None))
        self.cohorts_admitted += 1
        self.admitted += count
        return logits

    def _fresh_policy(self) -> KVPolicy:
        """A copy of the engine's policy with no state: each cohort keeps its own rows' state."""
        policy = dataclasses.replace(self.engine.policy)
        policy.begin_rollout()
        return policy

    def _draw(self, logits: torch.Tensor, step: int) -> None:
        """Draw each row's token at its own step from `logits [A, V]` and record it."""
        rows, own = self.rows, step - self.row_start
        draws = row_uniforms(self.seeds[rows], own) if self.seeds is not None else None
        token, token_logprob, step_logp = draw_tokens(logits, self.sampling.temperature, self.generator, draws)
        if self.record_distributions:
            if self.distributions is None:
                self.distributions = step_logp.new_zeros(self.requests, self.steps, step_logp.shape[-1])
            self.distributions[rows, own] = step_logp
        fed_real = self.live[rows]
        token = torch.where(fed_real, token, self.sampling.pad_token_id)
        self.response_ids[rows, own] = token
        self.logprobs[rows, own] = torch.where(fed_real, token_logprob, 0.0)
        self.lengths[rows] += fed_real.long()
        still = fed_real
        eos = self.sampling.eos_token_id
        if eos is not None:
            hit_eos = fed_real & (token == eos)
            self.ended[rows] |= hit_eos
            still = still & ~hit_eos
        if any(self._at_limit(cohort, step) for cohort in self.cohorts):
            still = still & (own < self.steps - 1)
        self.live[rows] = still
        # The EOS token is fed (and cached) as a real token; the rows it ended feed padding after it.
        self.token, self.fed_real, self.still = token, fed_real, still

    def _at_limit(self, cohort: Cohort, step: int) -> bool:
        return step - cohort.start == self.steps - 1

    def _release_finished(self, step: int) -> None:
        """Let the ended rows leave once an eighth of the batch has ended, or a cohort reached its length
        limit, or every row ended."""
        at_limit = [self._at_limit(c, step) for c in self.cohorts]
        if self.sampling.eos_token_id is None and not any(at_limit):
            return
        if self.sampling.eos_token_id is None:
            staying = np.concatenate([np.arange(first, first + c.size) for first, c, done
                                      in zip(self._firsts(), self.cohorts, at_limit) if not done] + [np.zeros(0, int)])
        else:
            still = self.still
            staying = None if any(at_limit) else int(still.sum())  # the one host sync of a step
            if staying is not None:
                ended = len(self.rows) - staying
                leave = staying == 0 or (self.engine.release_finished_rows and self.block is None
                                         and ended >= max(1, len(self.rows) // 8))
                if not leave:
                    return
            index = still.nonzero().squeeze(1)
            return self._keep_rows(index.cpu().numpy(), index)
        self._keep_rows(staying)

    def _keep_rows(self, staying: np.ndarray, index: torch.Tensor | None = None) -> None:
        """Keep the batch rows `staying` (sorted; `index`: the same on the device, if at hand)."""
        self.held[self.rows] = held_tokens(self.cache, self.fed_tokens[self.rows])
        if len(staying) == len(self.rows):
            return
        if index is None:
            index = torch.as_tensor(staying, dtype=torch.long, device=self.device)
        self.rows, self.row_start = self.rows[index], self.row_start[index]
        self.token, self.fed_real, self.still = self.token[index], self.fed_real[index], self.still[index]
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

    def _firsts(self) -> list[int]:
        """Each cohort's first batch row."""
        return np.cumsum([0] + [c.size for c in self.cohorts[:-1]]).tolist()

    def _decode(self, step: int) -> torch.Tensor:
        """Compress the cohorts due, then feed each row's token; returns the next logits `[A, V]`."""
        if self.comp is not None:
            for first, cohort in zip(self._firsts(), self.cohorts):
                due = cohort.since_compression >= self.comp.interval
                if due and self._compress(cohort, first, step - cohort.start):
                    cohort.since_compression = 0
        own = step - self.row_start
        self.provider.begin_forward((self.width + own)[:, None], self.fed_real[:, None])
        if self.selector is not None:
            self.selector.begin_step(step, self.width + step, self.width + step + 1)
        logits = self.model(input_ids=self.token[:, None], position_ids=(self.prompt_lengths[self.rows] + own)[:, None],
                            **{self.cache_keyword: self.cache}, use_cache=True).logits[:, -1]
        for cohort in self.cohorts:
            cohort.since_compression += 1
        self.fed_tokens[self.rows] += self.fed_real.long()
        if self.on_step is not None:
            self.on_step(1)
        return logits

    def _compress(self, cohort: Cohort, first: int, own_step: int) -> bool:
        """Compress the cohort's rows in every layer past its budget (`sparsity.eviction.compress_rows`).
        Records, per (column, layer), the columns each request kept."""
        self.compress_watch.start()
        column = self.width + own_step  # the column about to be fed
        # The schedule reads the cached length of the longest prompt's row (padded columns).
        budgets = self.engine.layer_budgets(self.comp.budgets.budget(column), len(self.cache.layers))
        compressed = compress_rows(cohort.policy, self.comp.window, self.cache, self.provider, first, cohort.size,
                                   budgets, record=self.engine.record_evictions)
        for layer_idx, kept in compressed:
            if kept is not None:
                self.kept_columns[(column, layer_idx)].append((self.rows[first:first + cohort.size], kept))
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


def held_tokens(cache: BufferCache, fed_tokens: torch.Tensor) -> torch.Tensor:
    """Real tokens each cache row holds `[A]`, averaged over full-attention layers (all fed ones without any)."""
    held = [layer.real[:, :, : layer.length].sum(dim=-1).float().mean(dim=1)
            for layer in cache.layers if not layer.is_sliding]
    return torch.stack(held).mean(dim=0) if held else fed_tokens.float()
