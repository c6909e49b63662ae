"""Lossless self-speculative rollouts: the model's own block-sparse attention drafts, its dense attention verifies.

Each round, every row drafts γ tokens with sparse attention over its full cache (Sparrow's block-sparse
page selection, or a sink and recent window: `speculative_drafts.py`), drawing each from the draft's
processed distribution q. The draft's
cache slots are then rolled back and one dense forward of [last emitted token, d1..dγ] gives the
dense distributions p at the γ + 1 positions. Draft token d_j is accepted with probability
min(1, p(d_j) / q(d_j)); the first rejected one is replaced by a draw from the normalised residual
max(0, p − q); when all γ are accepted a bonus token is drawn from p at the next position. The
emitted tokens are an exact sample of the dense policy (Leviathan et al., 2023), and the log-probs
recorded are the dense policy's, so the batch is a dense rollout for the learner: ξ = 1 and every
correction passes everything. Greedy (temperature 0) accepts a draft token iff it is p's argmax.

Randomness: the draw at response position t (a draft token, a bonus token, or the dense draw of the
first token) uses the engine's `row_uniforms(seed, t)`; the acceptance test and the residual draw
at t use two more counter streams of the row's seed. A uniform used by a discarded draft token is
reused by the next round's draft at that position, which is still exact: nothing kept depended on
it. So with a draft that attends densely, every draft is accepted and a rollout is
`RolloutEngine(model).generate` token for token. With a sparse draft a row's tokens also depend on
the rows beside it (γ is capped by the batch's longest remaining row, an adaptive γ is shared and
follows measured step times, compactions follow the batch's buffer): each row is still an exact
dense sample, but unlike the engine's rows, the batch composition (rows in flight, shards) changes
which one, and an adaptive γ makes a run not reproducible bit for bit.

Layout: one cache buffer length for the batch. The verify forward appends γ + 1 slots per row; the
slots past what a row accepted are marked not real (holes the masks skip). When a round would
overflow the buffer, each row's real slots move to the front (`compact`). Columns and RoPE positions
are per row (prompt + tokens emitted), so rows that accepted different numbers of tokens batch
together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...model.attention import masked_attention
from ...model.clock import now
from ...model.forward import logit_scale
from ...model.shared_prompt import prompt_groups
from ...model.structure import cache_keyword, positions_from_mask
from ..acceptance import acceptance_rate
from ..batch import KVStats, RolloutBatch, SamplingConfig, left_pad
from ..cache import BufferCache, build_cache
from ..engine.engine import RolloutEngine, decoder_layers
from ..engine.token_draws import (
    draw_tokens,
    processed_logprobs,
    row_uniforms,
    stream_seeds,
)
from ..sparsity.block_sparse import BlockSparsity
from .drafts import WindowDraft, build_draft
from .stats import AdaptiveDraftLength, SpeculationStats

# Counter streams of a row's seed besides the draws' own: the acceptance tests and the residual draws.
_ACCEPT_STREAM, _RESIDUAL_STREAM = 0x5DEECE66D, 0x2545F4914F6CDD1D


class SpeculativeSampler:
    """Samples exactly from the dense policy of `model`, drafting with `draft`: block-sparse attention, a
    sink and recent window, or None (dense: every draft accepted, the tests' identity case); `drafts.py`.

    `draft_tokens`: γ, or "adaptive" (γ ≤ `max_draft_tokens` chosen each round from the running
    acceptance rate and step costs, `AdaptiveDraftLength`). A `rollout.sampler.Sampler`: rows that end
    leave the batch and none join (`refills_rows` is False: the scheduler gives it its prompts in waves).
    """

    refills_rows = False

    def __init__(self, model, draft: BlockSparsity | WindowDraft | None, draft_tokens: int | str = 4,
                 max_draft_tokens: int = 8):
        self.model = model
        self.draft = draft
        self.draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens if draft_tokens == "adaptive" else int(draft_tokens)
        self.adaptive = AdaptiveDraftLength(most=max_draft_tokens) if draft_tokens == "adaptive" else None
        self.totals = SpeculationStats()  # over every generate since the last take_stats

    def take_stats(self) -> SpeculationStats:
        """What the speculation did since the last call (a step's, or a shard's on a worker), then reset."""
        totals, self.totals = self.totals, SpeculationStats()
        return totals

    def row_bytes(self, width: int, steps: int) -> int:
        """The KV bytes one row can reach: the dense cache plus the slack that holds rejected slots."""
        return RolloutEngine(self.model).row_bytes(width, self._capacity(width, steps) - width)

    def _capacity(self, width: int, steps: int) -> int:
        """Buffer slots: the whole sequence plus a slack of an eighth (at least two rounds), so that
        compactions are rare; whole pages, which block attention gathers."""
        page = self.draft.page_size if isinstance(self.draft, BlockSparsity) else 1
        needed = width + steps + max(2 * (self.max_draft_tokens + 1), (width + steps) // 8)
        return -(-needed // page) * page

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *, seeds: list[int],
                 on_step=None, max_rows: int | None = None) -> SpeculativeBatch:
        """One response per prompt, row i drawn from `seeds[i]`; `on_step(k)` after each round that
        advanced the longest row by k tokens. Rows that end leave the batch as in the engine; `max_rows`
        must hold every prompt (none joins later)."""
        if max_rows is not None and max_rows < len(prompts):
            raise ValueError("speculative rollouts admit no row after the first: run them in waves")
        model = self.model
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        started = now(device)
        prompt_ids, prompt_mask = left_pad(prompts, sampling.pad_token_id, sampling.prompt_width)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        batch, width = prompt_ids.shape
        steps = sampling.max_new_tokens
        if len(seeds) != batch:
            raise ValueError(f"{len(seeds)} seeds for {batch} prompts")
        capacity = self._capacity(width, steps)
        page = self.draft.page_size if isinstance(self.draft, BlockSparsity) else 1
        # A group's rows share their prompt: it is prefilled once and its cache rows copied to each of them.
        group, first = prompt_groups(prompt_ids, prompt_mask)
        cache = build_cache(model, len(first), [capacity] * len(decoder_layers(model)), False, dtype, device,
                            full_capacity=capacity, page_size=page)
        provider = _SpeculativeAttention(cache, None)
        state = _Rows(batch, steps, sampling.pad_token_id, torch.tensor(seeds, dtype=torch.long, device=device),
                      prompt_mask.sum(dim=1), device, _logprob_dtype(dtype))
        stats = SpeculationStats()
        keyword = cache_keyword(model)

        def forward(tokens, columns, real, **kwargs):
            provider.begin_forward(columns, real)
            positions = state.prompt_lengths[state.rows, None] + columns - width
            return model(input_ids=tokens, position_ids=positions, **{keyword: cache}, use_cache=True,
                         **kwargs).logits

        with masked_attention(model, provider):
            provider.prefill = True
            provider.begin_forward(torch.arange(width, device=device).expand(len(first), -1), prompt_mask[first])
            logits = model(input_ids=prompt_ids[first], position_ids=positions_from_mask(prompt_mask[first]),
                           **{keyword: cache}, use_cache=True, logits_to_keep=1).logits
            provider.prefill = False
            if len(first) < batch:
                for layer in cache.layers:
                    layer.select_rows(group)
                logits = logits.index_select(0, group)
            draft = provider.draft = build_draft(self.draft, cache, steps, width)
            draft.recommit(cache)
            first, _, _ = draw_tokens(logits[:, -1], sampling.temperature, None, row_uniforms(state.seeds, 0))
            state.emit(first[:, None], torch.ones(batch, dtype=torch.long, device=device),
                       _dense_logprobs(logits, first[:, None], sampling.temperature, state.logprob_dtype),
                       sampling.eos_token_id)
            while state.any_live():
                self._round(state, cache, provider, draft, forward, sampling, width, capacity, stats)
                if on_step is not None:
                    on_step(stats.last_advance)
                if state.should_release():
                    staying = state.release()
                    for layer in cache.layers:
                        layer.select_rows(staying)
                    draft.recommit(cache)

        stats.attended_frac = draft.attended_frac
        self.totals.add(stats)
        span = int(state.lengths.max())
        kv = KVStats(kv_peak_bytes=sum(cache.peak_bytes().values()),
                     kv_dense_bytes=cache.slot_bytes() * batch * (width + span),
                     kv_peak_bytes_by_layer_type=cache.peak_bytes(),
                     kept_tokens=(state.prompt_lengths + state.lengths).float(),
                     evicted_tokens=torch.zeros(batch, device=device))
        response_mask = (torch.arange(span, device=device)[None, :] < state.lengths[:, None]).float()
        return SpeculativeBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=state.response_ids[:, :span],
            response_mask=response_mask, sampler_logprobs=state.logprobs[:, :span],
            prompt_lengths=state.prompt_lengths, response_lengths=state.lengths, ended=state.ended,
            rollout_seconds=now(device) - started, kv=kv, replayable=True, speculation=stats,
        )

    def _round(self, state: _Rows, cache: BufferCache, provider: _SpeculativeAttention, draft,
               forward, sampling: SamplingConfig, width: int, capacity: int, stats: SpeculationStats) -> None:
        """Draft γ tokens per row, verify them in one dense forward, emit the accepted ones and one more."""
        temperature = sampling.temperature
        emitted, live = state.lengths[state.rows], state.live[state.rows]
        seeds = state.seeds[state.rows]
        # Never draft past the longest row's remaining tokens: the round emits at most γ + 1.
        most = int((state.steps - emitted)[live].max())
        gamma = min(self.adaptive.choose() if self.adaptive else self.max_draft_tokens, most - 1)
        if cache.layers[0].length + gamma + 1 > capacity:
            compact(cache)
            draft.recommit(cache)
        pending = state.response_ids[state.rows, emitted - 1]
        fed = emitted[:, None] - 1  # response index of each row's first token fed this round [A, 1]
        longest_fed = int(fed.max())  # one host read per round, not one per draft step
        device = emitted.device

        started = now(device)
        drafts, draft_logps = [], []
        provider.drafting = True
        for j in range(gamma):
            draft.begin_step(width + longest_fed + j, cache.layers[0].length + 1)
            token = pending if j == 0 else drafts[-1]
            logits = forward(token[:, None], width + fed + j, live[:, None])[:, -1]
            token, _, logp = draw_tokens(logits, temperature, None, row_uniforms(seeds, emitted + j))
            drafts.append(token)
            draft_logps.append(logp)
        provider.drafting = False
        for layer in cache.layers:
            layer.length -= gamma  # the draft's slots: the verifier rewrites them densely
        draft_seconds = now(device) - started

        started = now(device)
        start = cache.layers[0].length
        offsets = torch.arange(gamma + 1, device=emitted.device)
        tokens = torch.stack([pending, *drafts], dim=1)  # [A, γ+1]
        logits = forward(tokens, width + fed + offsets, live[:, None].expand(-1, gamma + 1))
        dense_logp = processed_logprobs(logits.flatten(0, 1), temperature).view(*tokens.shape, -1)  # [A, γ+1, V]

        def dense_draw(position: torch.Tensor) -> torch.Tensor:
            """p's own draw at round position `position [A]` of each row: only the position a row stops at
            needs one, so the float64 inverse CDF runs once per row, not γ + 1 times."""
            at_position = logits[torch.arange(len(position), device=position.device), position]
            return draw_tokens(at_position, temperature, None, row_uniforms(seeds, emitted + position))[0]

        chosen, accepted = _accept(tokens[:, 1:], torch.stack(draft_logps, dim=1) if gamma else None, dense_logp,
                                   dense_draw, seeds, emitted, temperature)
        advance = torch.where(live, accepted + 1, 0)
        logprobs = _dense_logprobs(logits, chosen, temperature, state.logprob_dtype)
        advance = state.emit(chosen, advance, logprobs, sampling.eos_token_id)
        # Slots hold [pending, d1..dγ]: the pending token and the accepted drafts are this row's context now.
        real = offsets[None, :] < advance[:, None]
        for layer in cache.layers:
            layer.real[:, :, start:start + gamma + 1] = real[:, None, :]
        draft.commit(cache, start, real)
        verify_seconds = now(device) - started

        compared = (offsets[None, :gamma] <= accepted[:, None]) & live[:, None]
        alpha = acceptance_rate(torch.stack(draft_logps, dim=1), dense_logp[:, :gamma]) if gamma else \
            dense_logp.new_zeros(len(live), 0)
        cached = state.prompt_lengths[state.rows, None] + emitted[:, None] + offsets[None, :gamma]
        stats.add_round(gamma, int(live.sum()), int(advance.sum()), alpha[compared], cached[compared],
                        (offsets[None, :gamma] < accepted[:, None])[compared], draft_seconds, verify_seconds)
        if self.adaptive and gamma:
            self.adaptive.observe(gamma, float(alpha[compared].mean()), draft_seconds / gamma, verify_seconds)
        stats.last_advance = int(advance.max())


def _accept(drafts: torch.Tensor, draft_logp: torch.Tensor | None, dense_logp: torch.Tensor,
            dense_draw: Callable[[torch.Tensor], torch.Tensor], seeds: torch.Tensor, emitted: torch.Tensor,
            temperature: float):
    """The round's tokens `[A, γ+1]` (the first `accepted + 1` of each row count) and `accepted [A]`.

    drafts `[A, γ]`, draft_logp (q) `[A, γ, V]`, dense_logp (p) `[A, γ+1, V]`, `dense_draw(position [A])`
    p's own draw at that round position of each row (from the same uniforms as the drafts), emitted `[A]`
    tokens so far.
    """
    rows, gamma = drafts.shape[0], drafts.shape[1]
    positions = emitted[:, None] + torch.arange(gamma + 1, device=emitted.device)
    if gamma == 0:
        accepted = torch.zeros(rows, dtype=torch.long, device=drafts.device)
        return dense_draw(accepted)[:, None], accepted
    if temperature <= 0:
        agree = drafts == dense_logp[:, :gamma].argmax(dim=-1)  # p's greedy draws
    else:
        ratio = (dense_logp[:, :gamma].gather(2, drafts[..., None]) - draft_logp.gather(2, drafts[..., None])).exp()
        tests = row_uniforms(stream_seeds(seeds, _ACCEPT_STREAM)[:, None], positions[:, :gamma])
        agree = tests < ratio.squeeze(2).double()
    accepted = agree.long().cumprod(dim=1).sum(dim=1)
    # The token at the first rejection (or the bonus): p's draw when every draft passed (or greedy),
    # else a draw from the residual max(0, p − q), normalised.
    final = dense_draw(accepted)
    if temperature > 0:
        at = accepted.clamp(max=gamma - 1)[:, None, None].expand(-1, 1, dense_logp.shape[2])
        residual = (dense_logp.gather(1, at).exp() - draft_logp.gather(1, at).exp()).squeeze(1).clamp(min=0)
        # p = q to rounding leaves no residual: there a rejection is rounding noise, and p's draw stands.
        has_residual = residual.sum(dim=1) > 0
        residual_token, _, _ = draw_tokens(residual.log().where(has_residual[:, None], 0.0), 1.0, None,
                                       row_uniforms(stream_seeds(seeds, _RESIDUAL_STREAM),
                                                    positions.gather(1, accepted[:, None]).squeeze(1)))
        final = torch.where((accepted < gamma) & has_residual, residual_token, final)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, accepted[:, None], final[:, None])
    return tokens, accepted


def _logprob_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recorded log-probs keep a float64 model's precision (the engine draws in float32, `draw_tokens`)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """Log-probs `[A, Q]` of `tokens [A, Q]` under the processed dense distributions `logits [A, Q, V]`
    (temperature applied; greedy records the plain softmax, as the engine does)."""
    scaled = logits.to(dtype) / logit_scale(temperature)
    return scaled.gather(2, tokens[..., None]).squeeze(2) - scaled.logsumexp(dim=2)


def compact(cache: BufferCache) -> None:
    """Move each row's real slots to the front of every buffer, in order; a row with fewer real slots
    than the most is padded with not-real ones. All layers share the rows' realness, so one order."""
    layer = cache.layers[0]
    real = layer.real[:, 0, :layer.length]
    order = (~real).long().sort(dim=1, stable=True).indices  # real slots first, each group in slot order
    kept = order[:, :int(real.sum(dim=1).max())][:, None, :]
    for layer in cache.layers:
        layer.keep(kept)


class _SpeculativeAttention:
    """The mask provider: causal by column over real slots (holes skipped), block-sparse while drafting."""

    def __init__(self, cache: BufferCache, draft):
        self.cache = cache
        self.draft = draft
        self.drafting = False
        self.prefill = False
        self.query_columns: torch.Tensor | None = None  # [A, Q]

    def begin_forward(self, columns: torch.Tensor, real: torch.Tensor) -> None:
        self.query_columns = columns
        self.cache.set_incoming(columns, real)

    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        """Bool `[A, 1, Q, K]`. The prefill keeps the cache's own mask (a padding query sees itself);
        later a slot is visible if real and not after the query: holes, whatever column they held, never."""
        layer = self.cache.layers[layer_idx]
        if self.prefill:
            return layer.visible(self.query_columns)
        real = layer.real[:, :, :layer.length]
        if query_len == 1 and layer.sliding_window is None:
            return real[:, :, None, :]  # every cached slot precedes the one query
        columns = layer.columns[:, :, None, :layer.length]
        queries = self.query_columns[:, None, :, None]
        seen = real[:, :, None, :] & (columns <= queries)
        if layer.sliding_window is not None:
            seen &= columns > queries - layer.sliding_window
        return seen

    def observe(self, layer_idx, query, key, mask) -> None:
        pass

    def select_keys(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.draft.select(layer_idx, query, mask) if self.drafting else None


class _Rows:
    """The batch's sampling state: tokens, dense log-probs, lengths, and which rows are still in the cache."""

    def __init__(self, batch: int, steps: int, pad: int, seeds: torch.Tensor, prompt_lengths: torch.Tensor,
                 device: torch.device, logprob_dtype: torch.dtype):
        self.steps = steps
        self.seeds, self.prompt_lengths = seeds, prompt_lengths
        self.logprob_dtype = logprob_dtype
        self.response_ids = torch.full((batch, steps), pad, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch, steps), dtype=logprob_dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.live = torch.ones(batch, dtype=torch.bool, device=device)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.rows = torch.arange(batch, device=device)  # the batch row of each cache row

    def emit(self, tokens: torch.Tensor, advance: torch.Tensor, logprobs: torch.Tensor,
             eos: int | None) -> torch.Tensor:
        """Append the first `advance [A]` of `tokens [A, Q]` to the cache rows' responses, cut at
        max_new_tokens and after an EOS (which ends the row); returns the tokens kept per row."""
        rows = self.rows
        emitted = self.lengths[rows]
        offsets = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        advance = torch.minimum(advance, self.steps - emitted)
        if eos is not None:
            is_eos = (tokens == eos) & (offsets < advance[:, None])
            hit = is_eos.any(dim=1)
            advance = torch.where(hit, is_eos.long().argmax(dim=1) + 1, advance)
            self.ended[rows] |= hit
        keep = offsets < advance[:, None]
        columns = (emitted[:, None] + offsets)[keep]
        batch_rows = rows[:, None].expand_as(keep)[keep]
        self.response_ids[batch_rows, columns] = tokens[keep]
        self.logprobs[batch_rows, columns] = logprobs[keep].to(self.logprob_dtype)
        self.lengths[rows] = emitted + advance
        self.live[rows] &= ~self.ended[rows] & (self.lengths[rows] < self.steps)
        return advance

    def any_live(self) -> bool:
        return bool(self.live[self.rows].any())

    def should_release(self) -> bool:
        """As the engine: finished rows leave once they are an eighth of the rows in the cache."""
        done = int((~self.live[self.rows]).sum())
        return done >= max(1, len(self.rows) // 8) and done < len(self.rows)

    def release(self) -> torch.Tensor:
        staying = self.live[self.rows].nonzero().squeeze(1)
        self.rows = self.rows[staying]
        return staying


@dataclass
class SpeculativeBatch(RolloutBatch):
    """A `RolloutBatch` of exact dense samples (`sampler_logprobs` are the dense policy's), with what
    the speculation did (the scheduler's merge of several waves keeps only the plain batch; the
    sampler's `take_metrics` has every wave's)."""

    speculation: SpeculationStats = field(default_factory=SpeculationStats)
