"""The rollout engine: batched sampling with its own decode loop and KV cache.

`RolloutEngine.generate` samples one response per prompt row (the caller repeats each prompt G
times for a group), recording for every response token the log-prob of the exact distribution it
was drawn from (temperature applied, no top-p/top-k). With a `KVCompression` it compresses the
cache while decoding (a sparse rollout); with a `BlockSparsity` it keeps the whole cache and each
decode step attends to a budget of pages (`block_sparse.py`); without either it is the dense
sampler. All run the same code, so a sparse rollout whose budget is never reached is bitwise the
dense rollout.

Layout: prompts are left-padded to width P and responses right-padded to width T, so a token's
column in the `[N, P + T]` sequence is its identity for masks and for the eviction record.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from .attention import masked_attention
from .block_sparse import BlockSelections, BlockSelector, BlockSparsity
from .kv_cache import BufferCache, EvictionEvent, KVStats, build_cache
from .kv_policies import KVPolicy, ScoringInputs, build_policy, policy_options, select_slots
from .schedule import AdaptiveBudget, BinnedBudget, BudgetSchedule, FixedBudget


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
    # (None: none) and a row count (0: none).
    kv_memory_bytes: int | None = None
    max_rows: int = 0


@dataclass(frozen=True)
class KVCompression:
    """Sparse-rollout settings: budget B, observation window w, interval Δ (a cache past B is compressed
    back to B every Δ decode steps, always keeping the w most recent tokens)."""

    policy: str = "rkv"
    budget: int = 32
    window: int = 8
    interval: int = 8
    per_head: bool = False
    policy_options: tuple[tuple[str, object], ...] = ()  # (config key, value) of the policies' options
    # A budget that grows with the cached length; None keeps `budget` throughout.
    schedule: BudgetSchedule | None = None

    @classmethod
    def from_rollout_config(cls, rollout) -> KVCompression:
        """The settings of a `sparserl.config.schema.RolloutConfig` (its `kv_*` fields)."""
        options = tuple((key, getattr(rollout, key)) for key in policy_options())
        if rollout.kv_schedule == "adaptive":
            schedule = AdaptiveBudget(rollout.kv_budget, rollout.alpha_bin_size, rollout.alpha_tau,
                                      step=rollout.kv_interval, floor=rollout.kv_window + 1)
        else:
            schedule = BinnedBudget.from_yaml(rollout.kv_schedule) if rollout.kv_schedule else None
        return cls(policy=rollout.kv_policy, budget=rollout.kv_budget, window=rollout.kv_window,
                   interval=rollout.kv_interval, per_head=rollout.kv_per_head, policy_options=options,
                   schedule=schedule)

    @property
    def budgets(self) -> BudgetSchedule:
        return self.schedule or FixedBudget(self.budget)

    def build_policy(self) -> KVPolicy:
        return build_policy(self.policy, dict(self.policy_options), self.window)


def sparsity_from_config(rollout) -> KVCompression | BlockSparsity:
    """The sparse sampler a `RolloutConfig` asks for (`rollout.sparsity`): KV eviction or block attention."""
    if rollout.sparsity == "block":
        return BlockSparsity.from_rollout_config(rollout)
    return KVCompression.from_rollout_config(rollout)


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


class _RolloutAttention:
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
        grouped = query.reshape(batch, kv_heads, q_heads // kv_heads * q_len, dim)
        logits = grouped @ key.transpose(-1, -2) / dim ** 0.5
        visible = mask if mask.shape[1] == kv_heads else mask.expand(-1, kv_heads, -1, -1)
        visible = visible.repeat(1, 1, q_heads // kv_heads, 1)
        probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        received = probs.sum(dim=2)  # [N, Hkv, K]
        previous = self.mass.get(layer_idx)
        if previous is not None:
            received[:, :, : previous.shape[2]] += previous
        self.mass[layer_idx] = received

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (the others finished)."""
        self.queries = {layer: q.index_select(0, rows) for layer, q in self.queries.items()}
        self.mass = {layer: m.index_select(0, rows) for layer, m in self.mass.items()}
        if self.window_real is not None:
            self.window_real = self.window_real.index_select(0, rows)

    def after_keep(self, layer_idx: int, slots: torch.Tensor) -> None:
        if layer_idx in self.mass:
            per_head = slots if slots.shape[1] != 1 else slots.expand(-1, self.mass[layer_idx].shape[1], -1)
            self.mass[layer_idx] = self.mass[layer_idx].gather(2, per_head)


FULL_DISTRIBUTION_VOCAB = 4096


def _cache_keyword(model) -> str:
    """The name under which the model's forward takes the KV cache: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); earlier 5.x know only the old."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class RolloutEngine:
    """Samples from a causal LM with a dense or compressed KV cache, or block-sparse attention.

    `record_distributions` keeps what the acceptance rate α needs: the sampler's processed next-token
    distribution at every response position for a vocabulary up to FULL_DISTRIBUTION_VOCAB, else
    the eviction records or page selections that replay the sampler exactly (`RolloutBatch`).
    """

    def __init__(self, model, compression: KVCompression | BlockSparsity | None = None,
                 record_evictions: bool = True, record_distributions: bool = False,
                 release_finished_rows: bool = True):
        """`release_finished_rows=False` keeps every row in the batch until the longest ends (a static
        batch, the engine's shape before rows could leave; `bench/scheduler.py` compares the two)."""
        self.model = model
        self.release_finished_rows = release_finished_rows
        self.compression = compression
        self.policy = compression.build_policy() if isinstance(compression, KVCompression) else None
        self.record_distributions = record_distributions
        large_vocabulary = model.get_output_embeddings().weight.shape[0] > FULL_DISTRIBUTION_VOCAB
        self.record_evictions = record_evictions or (record_distributions and large_vocabulary)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 generator: torch.Generator | None = None, on_step=None,
                 seeds: list[int] | None = None) -> RolloutBatch:
        """Sample one response per prompt. Randomness comes from `seeds` (one per row: a row's draw at a
        step is a function of its seed and the step, `row_uniforms`, so its tokens do not depend on the
        other rows) or else from the one `generator` shared by the batch. `on_step`, if given, is called
        after each decode step.

        A row that has ended leaves the batch (its cache rows are dropped) once an eighth of the rows
        in it have ended, so finished rows stop costing compute; block-sparse rollouts keep every row.
        """
        started = time.perf_counter()
        model = self.model
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        prompt_ids, prompt_mask = left_pad(prompts, sampling.pad_token_id, sampling.prompt_width)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        batch, width = prompt_ids.shape
        steps = sampling.max_new_tokens
        comp = self.compression if isinstance(self.compression, KVCompression) else None
        block = self.compression if isinstance(self.compression, BlockSparsity) else None
        page = block.page_size if block else 1
        full = self._full_capacity(width, steps)
        capacities = self.capacities(width, steps, len(_decoder_layers(model)))
        # Compressed buffers grow an interval at a time, so that memory follows a growing schedule; a budget
        # that can never bind grows as the dense cache does (and so costs the same memory when rows leave).
        growth = comp.interval if comp and min(capacities) < full else 64
        cache = build_cache(model, batch, capacities, bool(comp and comp.per_head), dtype, device,
                            full_capacity=full, growth=growth, page_size=page)
        slot_bytes = cache.bytes_per_slot()  # of the whole batch, before rows leave
        selector = BlockSelector(block, cache, steps, width, self.record_evictions) if block else None
        provider = _RolloutAttention(cache, comp.window if comp else 0, keep_queries=comp is not None,
                                     keep_mass=bool(comp and self.policy.needs_attention_mass), selector=selector)
        row_seeds = torch.tensor(seeds, dtype=torch.long, device=device) if seeds is not None else None
        if row_seeds is not None and len(row_seeds) != batch:
            raise ValueError(f"{len(row_seeds)} seeds for {batch} prompts")
        prompt_lengths = prompt_mask.sum(dim=1)
        response_ids = torch.full((batch, steps), sampling.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        live = torch.ones(batch, dtype=torch.bool, device=device)  # still generating
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        ended = torch.zeros(batch, dtype=torch.bool, device=device)
        held = torch.zeros(batch, dtype=torch.float32, device=device)  # real tokens cached when a row left
        rows = torch.arange(batch, device=device)  # the batch row of each cache row
        stats = KVStats()
        evictions: list[EvictionEvent] = []
        since_compression = 0
        if self.policy is not None:
            self.policy.begin_rollout()
        fed_tokens = prompt_lengths.clone()
        distributions: list = []

        cache_keyword = _cache_keyword(model)
        with masked_attention(model, provider):
            columns = torch.arange(width, device=device).expand(batch, -1)
            provider.begin_forward(columns, prompt_mask)
            positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
            logits = model(input_ids=prompt_ids, position_ids=positions, **{cache_keyword: cache},
                           use_cache=True, logits_to_keep=1).logits[:, -1]
            for step in range(steps):
                draws = row_uniforms(row_seeds[rows], step) if row_seeds is not None else None
                token, token_logprob, step_logp = _sample(logits, sampling.temperature, generator, draws)
                if self.record_distributions and step_logp.shape[-1] <= FULL_DISTRIBUTION_VOCAB:
                    distributions.append(step_logp.new_zeros(batch, step_logp.shape[-1]).index_copy_(0, rows,
                                                                                                   step_logp))
                fed_real = live[rows]
                token = torch.where(fed_real, token, sampling.pad_token_id)
                response_ids[rows, step] = token
                logprobs[rows, step] = torch.where(fed_real, token_logprob, 0.0)
                lengths[rows] += fed_real.long()
                if sampling.eos_token_id is not None:
                    hit_eos = fed_real & (token == sampling.eos_token_id)
                    ended[rows] |= hit_eos
                    live[rows] = fed_real & ~hit_eos
                if step == steps - 1:
                    break
                if sampling.eos_token_id is not None:
                    still = live[rows]
                    remaining = int(still.sum())  # the one host sync of a step, and only when rows can stop early
                    if remaining == 0:
                        break
                    if self.release_finished_rows and selector is None and \
                            len(rows) - remaining >= max(1, len(rows) // 8):
                        staying = still.nonzero().squeeze(1)
                        held[rows] = _held_tokens(cache, fed_tokens[rows])
                        rows, token, fed_real = rows[staying], token[staying], fed_real[staying]
                        self._drop_finished(cache, provider, staying)
                if comp and since_compression >= comp.interval:
                    # The schedule reads the cached length of the longest prompt's row (padded columns),
                    # the most any row of the batch has fed.
                    budgets = self._layer_budgets(comp.budgets.budget(width + step), len(cache.layers))
                    if self._compress(cache, provider, budgets, width + step, evictions, stats, rows, batch):
                        since_compression = 0
                provider.begin_forward((width + step) * torch.ones(len(rows), 1, dtype=torch.long, device=device),
                                       fed_real[:, None])
                if selector is not None:
                    selector.begin_step(step, width + step, width + step + 1)
                logits = model(input_ids=token[:, None], position_ids=(prompt_lengths[rows] + step)[:, None],
                               **{cache_keyword: cache}, use_cache=True).logits[:, -1]
                since_compression += 1
                fed_tokens[rows] += fed_real.long()
                if on_step is not None:
                    on_step(1)

        held[rows] = _held_tokens(cache, fed_tokens[rows])
        peaks = cache.peak_bytes()
        stats.kv_peak_bytes_by_layer_type = peaks
        stats.kv_peak_bytes = sum(peaks.values())
        span = int(lengths.max())
        stats.kv_dense_bytes = slot_bytes * (width + span)
        stats.kept_tokens, stats.evicted_tokens = held, fed_tokens.float() - held
        if selector is not None:
            stats.attended_frac = selector.attended_frac
        response_mask = (torch.arange(span, device=device)[None, :] < lengths[:, None]).float()
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=response_ids[:, :span], response_mask=response_mask,
            sampler_logprobs=logprobs[:, :span], prompt_lengths=prompt_lengths,
            response_lengths=lengths, ended=ended,
            rollout_seconds=time.perf_counter() - started, kv=stats,
            evictions=evictions, block_selections=selector.record if selector is not None else None,
            sampler_distribution=torch.stack(distributions[:span], dim=1) if distributions else None,
            replayable=self.compression is None or self.record_evictions,
        )

    def capacities(self, width: int, steps: int, num_layers: int) -> list[int]:
        """Slots each layer's buffer may reach for prompts of width `width` and `steps` new tokens: the
        whole sequence when dense (or block-sparse, in whole pages); max(prompt, the layer's largest
        budget) + one interval when compressed."""
        comp = self.compression if isinstance(self.compression, KVCompression) else None
        if comp is None:
            return [self._full_capacity(width, steps)] * num_layers
        budgets = self._layer_budgets(comp.budgets.max_budget, num_layers)
        return [min(max(width, budgets[i]) + comp.interval, width + steps) for i in range(num_layers)]

    def _full_capacity(self, width: int, steps: int) -> int:
        """The dense cache's slots (and sliding-window layers'): the whole sequence, in whole pages under
        block attention, which gathers whole pages of the buffers."""
        page = self.compression.page_size if isinstance(self.compression, BlockSparsity) else 1
        return -(-(width + steps) // page) * page

    def row_bytes(self, width: int, steps: int) -> int:
        """The KV bytes one row can reach (its buffers at capacity) for prompts of width `width` and
        `steps` new tokens."""
        parameter = next(self.model.parameters())
        capacities = self.capacities(width, steps, len(_decoder_layers(self.model)))
        full = self._full_capacity(width, steps)
        # An empty cache of one row: its layers know their kinds and capacities and allocate nothing yet.
        cache = build_cache(self.model, 1, capacities, False, parameter.dtype, parameter.device, full_capacity=full)
        return sum(layer.max_capacity * 2 * layer.kv_heads * layer.head_dim * parameter.element_size()
                   for layer in cache.layers)

    def _drop_finished(self, cache: BufferCache, provider: _RolloutAttention, staying: torch.Tensor) -> None:
        for layer in cache.layers:
            layer.select_rows(staying)
        provider.select_rows(staying)
        if self.policy is not None:
            self.policy.select_rows(staying)

    def _layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        return [self.policy.layer_budget(budget, i, num_layers) for i in range(num_layers)]

    def _compress(self, cache: BufferCache, provider: _RolloutAttention, budgets: list[int], next_column: int,
                  evictions: list[EvictionEvent], stats: KVStats, rows: torch.Tensor, batch: int) -> bool:
        """Compress every layer past its budget. `rows`: the batch row of each cache row (of `batch`); the
        record holds every batch row, rows that have left with column 0 (their later queries are padding)."""
        started = time.perf_counter()
        comp = self.compression
        compressed = False
        for layer_idx, layer in enumerate(cache.layers):
            budget = budgets[layer_idx]
            if layer.is_sliding or layer.length <= budget:
                continue
            length = layer.length
            inputs = ScoringInputs(
                keys=layer.keys[:, :, :length], queries=provider.queries[layer_idx],
                query_real=provider.window_real, real=layer.real[:, :, :length],
                columns=layer.columns[:, :, :length], attention_mass=provider.mass.get(layer_idx),
                layer_idx=layer_idx, num_layers=len(cache.layers),
            )
            slots = select_slots(self.policy.score(inputs), inputs.real, inputs.columns, budget, comp.window)
            self.policy.before_keep(inputs, slots)
            layer.keep(slots)
            provider.after_keep(layer_idx, slots)
            if self.record_evictions:
                kept = layer.columns[:, :, :budget]
                evictions.append(EvictionEvent(next_column, layer_idx,
                                               kept.new_zeros(batch, *kept.shape[1:]).index_copy_(0, rows, kept)))
            compressed = True
        if compressed:
            stats.compressions += 1
            stats.compress_seconds += time.perf_counter() - started
        return compressed


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
            draws: torch.Tensor | None = None):
    """Token `[N]`, its log-prob `[N]` and the whole log-distribution `[N, V]` it was drawn from.
    `draws`: one uniform per row `[N]` (float64), inverted through the row's CDF; else `generator`."""
    logits = logits.float()
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = logp.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if draws is not None:
            cdf = logp.double().exp().cumsum(dim=-1)
            # right=True: the first token whose CDF passes the draw, so tokens of probability 0 are never drawn.
            token = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
            token = token.clamp_(max=logp.shape[-1] - 1)
        else:
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return token, logp.gather(1, token[:, None]).squeeze(1), logp


# splitmix64's constants as signed 64-bit integers (torch has no unsigned 64-bit arithmetic).
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _logical_shift(x, 30)) * _MIX1
    x = (x ^ _logical_shift(x, 27)) * _MIX2
    return x ^ _logical_shift(x, 31)


def row_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform in (0, 1) per row `[N]` float64, a pure function of (row seed, decode step): counter
    based (splitmix64 of the pair, on int64 with wrap-around), so a row's draw depends on nothing else,
    neither the rows beside it nor the device."""
    mixed = _splitmix64(_splitmix64(seeds) + step)
    return (_logical_shift(mixed, 11).double() + 0.5) / float(1 << 53)


def _held_tokens(cache: BufferCache, fed_tokens: torch.Tensor) -> torch.Tensor:
    """Real tokens each cache row holds `[A]`, averaged over full-attention layers (all fed ones without any)."""
    held = [layer.real[:, :, : layer.length].sum(dim=-1).float().mean(dim=1)
            for layer in cache.layers if not layer.is_sliding]
    return torch.stack(held).mean(dim=0) if held else fed_tokens.float()


def _decoder_layers(model) -> list:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(base.layers)
