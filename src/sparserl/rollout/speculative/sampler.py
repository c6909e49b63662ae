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

from dataclasses import dataclass, field

import torch

from ...model.attention import masked_attention
from ...model.clock import now
from ...model.shared_prompt import prompt_groups
from ...model.structure import cache_keyword, positions_from_mask
from ..batch import KVStats, RolloutBatch, SamplingConfig, left_pad
from ..cache import BufferCache, build_cache
from ..engine.engine import RolloutEngine, decoder_layers
from ..engine.step import StepRunner
from ..engine.token_draws import draw_tokens, row_uniforms
from ..sparsity.block_sparse import BlockSparsity
from .drafts import WindowDraft, build_draft
from .rows import SpeculativeRows
from .stats import AdaptiveDraftLength, SpeculationStats
from .steps import Rollout, dense_logprobs, draft_step, verify_step


class SpeculativeSampler:
    """Samples exactly from the dense policy of `model`, drafting with `draft`: block-sparse attention, a
    sink and recent window, or None (dense: every draft accepted, the tests' identity case); `drafts.py`.

    `draft_tokens`: γ, or "adaptive" (γ ≤ `max_draft_tokens` chosen each round from the running
    acceptance rate and step costs, `AdaptiveDraftLength`). A `rollout.sampler.Sampler`: rows that end
    leave the batch and none join (`refills_rows` is False: the scheduler gives it its prompts in waves).
    Its draft steps and its verification are static steps (`engine/step.py`): captured as CUDA graphs on a GPU (one
    per draft setting and per γ), compiled on a CPU with `compile_decode=true`.
    """

    refills_rows = False

    def __init__(self, model, draft: BlockSparsity | WindowDraft | None, draft_tokens: int | str = 4,
                 max_draft_tokens: int = 8, runners: dict[str, StepRunner] | None = None):
        """`runners`: the step runners by `compile_decode`, shared with the samplers before and after this one (the
        dispatch's `SamplerCache`), so that compilations last the run."""
        self.model = model
        self.draft = draft
        self.draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens if draft_tokens == "adaptive" else int(draft_tokens)
        self.adaptive = AdaptiveDraftLength(most=max_draft_tokens) if draft_tokens == "adaptive" else None
        self.totals = SpeculationStats()  # over every generate since the last take_stats
        self.runners = runners if runners is not None else {}

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
        state = SpeculativeRows(batch, steps, sampling.pad_token_id, torch.tensor(seeds, dtype=torch.long,
                                                                                   device=device),
                                prompt_mask.sum(dim=1), device, _logprob_dtype(dtype))
        stats = SpeculationStats()
        runner = self.runners.setdefault(sampling.compile_decode, StepRunner.for_model(sampling.compile_decode, model))
        rollout = Rollout(model, cache, provider, state, sampling, width, capacity, cache_keyword(model), runner)
        with masked_attention(model, provider), runner.one_rollout(model) as step_counts:
            cache.set_incoming(torch.arange(width, device=device).expand(len(first), -1), prompt_mask[first])
            logits = model(input_ids=prompt_ids[first], position_ids=positions_from_mask(prompt_mask[first]),
                           **{rollout.keyword: cache}, use_cache=True, logits_to_keep=1).logits
            if len(first) < batch:
                for layer in cache.layers:
                    layer.select_rows(group)
                logits = logits.index_select(0, group)
            draft = provider.draft = build_draft(self.draft, cache, steps, width)
            draft.recommit(cache)
            first, _, _ = draw_tokens(logits[:, -1], sampling.temperature, None, row_uniforms(state.seeds, 0))
            state.emit(first[:, None], torch.ones(batch, dtype=torch.long, device=device),
                       dense_logprobs(logits, first[:, None], sampling.temperature, state.logprob_dtype),
                       sampling.eos_token_id)
            while state.any_live():
                self._round(rollout, draft, stats)
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
        kv.add_step_counts(step_counts)
        response_mask = (torch.arange(span, device=device)[None, :] < state.lengths[:, None]).float()
        return SpeculativeBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=state.response_ids[:, :span],
            response_mask=response_mask, sampler_logprobs=state.logprobs[:, :span],
            prompt_lengths=state.prompt_lengths, response_lengths=state.lengths, ended=state.ended,
            rollout_seconds=now(device) - started, kv=kv, replayable=True, speculation=stats,
        )

    def _round(self, rollout: Rollout, draft, stats: SpeculationStats) -> None:
        """Draft γ tokens per row, verify them in one dense forward, emit the accepted ones and one more: between the
        static steps, the round's decisions (γ, a compaction) and its counts, which read the device."""
        state, cache = rollout.state, rollout.cache
        emitted, live = state.lengths[state.rows], state.live[state.rows]
        # Never draft past the longest row's remaining tokens: the round emits at most γ + 1.
        most = int((state.steps - emitted)[live].max())
        gamma = min(self.adaptive.choose() if self.adaptive else self.max_draft_tokens, most - 1)
        if cache.layers[0].length + gamma + 1 > rollout.capacity:
            compact(cache)
            draft.recommit(cache)
        cache.reserve(gamma + 1)  # the round's slots: the drafts, then the verification over them and one more
        drafting = rollout.begin_round(self.max_draft_tokens)
        longest_fed = int(emitted.max()) - 1  # one host read per round, not one per draft step
        device = emitted.device
        # Rows leave the batch: the dims of rows (and the cache's capacity) stay symbolic in a compilation.
        varying = cache.varying_dims() + [(t, (0,)) for t in drafting.tensors() if t.dim()]

        started = now(device)
        rollout.provider.drafting = True
        for j in range(gamma):
            draft.begin_step(rollout.width + longest_fed + j, cache.layers[0].length + 1)
            rollout.runner.run(draft_step, (rollout, drafting), cache.step_buffers(),
                               [*cache.step_state(), *drafting.tensors(), *draft.static_tensors()],
                               draft.static_key(), varying)
            cache.advance(1)
        rollout.provider.drafting = False
        for layer in cache.layers:  # the draft's slots: the verifier rewrites them densely
            layer.length -= gamma
            layer.slot_counts -= gamma
        draft_seconds = now(device) - started

        started = now(device)
        outputs = rollout.verified
        rollout.runner.run(verify_step, (rollout, draft, drafting, gamma), cache.step_buffers(),
                           [*cache.step_state(), *state.tensors(), *outputs.values(), *draft.static_tensors()],
                           (gamma,), varying + [(t, (0,)) for t in outputs.values()])
        cache.advance(gamma + 1)
        verify_seconds = now(device) - started

        accepted, advance = outputs["accepted"], outputs["advance"]
        offsets = torch.arange(gamma + 1, device=device)
        compared = (offsets[None, :gamma] <= accepted[:, None]) & live[:, None]
        alpha = outputs["alpha"][:, :gamma]
        cached = state.prompt_lengths[state.rows, None] + emitted[:, None] + offsets[None, :gamma]
        stats.add_round(gamma, int(live.sum()), int(advance.sum()), alpha[compared], cached[compared],
                        (offsets[None, :gamma] < accepted[:, None])[compared], draft_seconds, verify_seconds)
        if self.adaptive and gamma:
            self.adaptive.observe(gamma, float(alpha[compared].mean()), draft_seconds / gamma, verify_seconds)
        stats.last_advance = int(advance.max())


def _logprob_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recorded log-probs keep a float64 model's precision (the engine draws in float32, `draw_tokens`)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """The mask provider: the cache's masks (a slot is visible if real and not after the query: holes never), narrowed
    by the draft while drafting."""

    def __init__(self, cache: BufferCache, draft):
        self.cache = cache
        self.draft = draft
        self.drafting = False

    def attention_mask(self, layer_idx: int, query_len: int, key_len: int) -> torch.Tensor:
        """Bool `[A, Hs, Q, K]`: the prefill's (a padding query sees itself), then the static steps'."""
        return self.cache.layers[layer_idx].attention_mask()

    def observe(self, layer_idx, query, key, mask) -> None:
        pass

    def select_keys(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return self.draft.select(layer_idx, query, mask) if self.drafting else None


@dataclass
class SpeculativeBatch(RolloutBatch):
    """A `RolloutBatch` of exact dense samples (`sampler_logprobs` are the dense policy's), with what
    the speculation did (the scheduler's merge of several waves keeps only the plain batch; the
    sampler's `take_metrics` has every wave's)."""

    speculation: SpeculationStats = field(default_factory=SpeculationStats)
