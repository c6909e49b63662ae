"""The lossless sampler's static steps (`engine/step.py`): a draft step (one token per row under the draft's sparse
attention, drawn from its distribution q) and a verification (one dense forward of [pending, d1..dγ] per row, the
acceptance tests, the emission, the holes). Both are functions of device tensors updated in place, which read nothing
back to the host, so the sampler (`sampler.py`) captures them as CUDA graphs (one per draft setting and per γ) or
compiles them; its rounds decide between them (γ, compactions, rows leaving) and count what they did. Every round's
steps read and write the same buffers while the rows stay, whatever its γ, so a captured step is replayed, not
captured again, when adaptive γ moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...model.forward import logit_scale
from ..acceptance import acceptance_rate
from ..cache import BufferCache
from ..engine.step import StepRunner
from ..engine.token_draws import draw_tokens, processed_logprobs, row_uniforms, stream_seeds
from .rows import DraftState, SpeculativeRows

# Counter streams of a row's seed besides the draws' own: the acceptance tests and the residual draws.
_ACCEPT_STREAM, _RESIDUAL_STREAM = 0x5DEECE66D, 0x2545F4914F6CDD1D


class Rollout:
    """One speculative rollout's parts, as its static steps read them. `runner`: the sampler's step runner, through
    which every step of this rollout also holds what all of them read beside their own tensors (`RolloutRunner`)."""

    def __init__(self, model, cache: BufferCache, provider, state: SpeculativeRows, sampling,
                 width: int, capacity: int, keyword: str, runner: StepRunner):
        self.model, self.cache, self.provider, self.state, self.sampling = model, cache, provider, state, sampling
        self.width, self.capacity, self.keyword = width, capacity, keyword
        self.runner = RolloutRunner(runner, self)
        self._drafting: DraftState | None = None
        self.verified: dict[str, torch.Tensor] = {}

    def begin_round(self, most: int) -> DraftState:
        """The draft state of a round of at most `most` drafts per row, its buffers (and the verification's outputs,
        `verified`) reused while the rows stay: a captured step holds them."""
        state = self.state
        rows = len(state.rows)
        emitted, live = state.lengths[state.rows], state.live[state.rows]
        drafting = self._drafting
        if drafting is None or len(drafting.feed) != rows:
            vocabulary = self.model.get_output_embeddings().weight.shape[0]
            device = emitted.device
            drafting = self._drafting = DraftState(
                feed=torch.zeros(rows, dtype=torch.long, device=device), columns=torch.zeros_like(emitted),
                positions=torch.zeros_like(emitted), real=torch.zeros_like(live), index=torch.zeros_like(emitted),
                tokens=torch.zeros(rows, max(most, 1), dtype=torch.long, device=device),
                logps=torch.zeros(rows, max(most, 1), vocabulary, dtype=torch.float32, device=device),
                step=torch.zeros((), dtype=torch.long, device=device))
            # The verification's outputs: tokens accepted [A], tokens emitted [A], α at each draft position [A, most].
            self.verified = {"accepted": torch.zeros(rows, dtype=torch.long, device=device),
                             "advance": torch.zeros(rows, dtype=torch.long, device=device),
                             "alpha": torch.zeros(rows, max(most, 1), dtype=torch.float32, device=device)}
        fed = emitted - 1  # the response index of each row's first token fed this round
        drafting.feed.copy_(state.response_ids[state.rows, fed])
        drafting.columns.copy_(self.width + fed)
        drafting.positions.copy_(state.prompt_lengths[state.rows] + fed)
        drafting.real.copy_(live)
        drafting.index.copy_(emitted)
        drafting.step.zero_()
        return drafting

    def read_tensors(self) -> list[torch.Tensor]:
        """What the steps of the rollout read beside their own tensors: the rows' seeds and prompt lengths `[B]`, the
        request each cache row holds `[A]` (a new tensor when rows leave), and the round's draft (`DraftState`, which
        the verification reads; new buffers when rows leave)."""
        drafting = self._drafting.tensors() if self._drafting is not None else []
        return [self.state.seeds, self.state.prompt_lengths, self.state.rows, *drafting]

    def step_key(self) -> tuple:
        """The Python values every step of the rollout reads: a capture freezes them in."""
        sampling, state = self.sampling, self.state
        return (self.width, self.keyword, sampling.temperature, sampling.eos_token_id, state.steps,
                state.logprob_dtype)


class RolloutRunner:
    """A `StepRunner` as one rollout's steps run through it: each call's buffers also hold the tensors every step of
    the rollout reads (`Rollout.read_tensors`: a graph captured over one rollout's seeds is never replayed over
    another's) and its key the Python values they read (`Rollout.step_key`)."""

    def __init__(self, runner: StepRunner, rollout: Rollout):
        self.runner, self.rollout = runner, rollout

    def run(self, step: Callable, args: tuple, buffers: list[torch.Tensor], state: list[torch.Tensor],
            key: tuple = (), varying: list = ()) -> None:
        reads = self.rollout.read_tensors()
        self.runner.run(step, args, [*buffers, *reads], state, (*key, *self.rollout.step_key()),
                        [*varying, *((tensor, (0,)) for tensor in reads if tensor.dim())])


def draft_step(rollout: Rollout, drafting: DraftState) -> None:
    """One draft token per row: the draft's sparse attention over the cache, a draw from its distribution q."""
    cache = rollout.cache
    cache.begin_static(drafting.columns[:, None], drafting.real[:, None])
    logits = rollout.model(input_ids=drafting.feed[:, None], position_ids=drafting.positions[:, None],
                           **{rollout.keyword: cache}, use_cache=True).logits[:, -1]
    cache.end_static()
    seeds = rollout.state.seeds[rollout.state.rows]
    token, _, logp = draw_tokens(logits, rollout.sampling.temperature, None, row_uniforms(seeds, drafting.index))
    drafting.tokens.index_copy_(1, drafting.step[None], token[:, None])
    drafting.logps.index_copy_(1, drafting.step[None], logp[:, None])
    drafting.feed.copy_(token)
    drafting.columns.add_(1)
    drafting.positions.add_(1)
    drafting.index.add_(1)
    drafting.step.add_(1)


def verify_step(rollout: Rollout, draft, drafting: DraftState, gamma: int) -> None:
    """One dense forward of [pending token, d1..dγ] per row, the acceptance tests and the emission, into
    `rollout.verified` (α in its first γ columns); the slots past what a row accepted become holes."""
    state, cache, sampling = rollout.state, rollout.cache, rollout.sampling
    temperature = sampling.temperature
    emitted, live = state.lengths[state.rows], state.live[state.rows]
    seeds = state.seeds[state.rows]
    offsets = torch.arange(gamma + 1, device=emitted.device)
    fed = emitted[:, None] - 1
    tokens = torch.cat([state.response_ids[state.rows, emitted - 1][:, None], drafting.tokens[:, :gamma]], dim=1)
    columns = rollout.width + fed + offsets
    slots = cache.layers[0].slot_counts[:, None] + offsets  # where the step writes: every layer holds one length
    cache.begin_static(columns, live[:, None].expand(-1, gamma + 1))
    logits = rollout.model(input_ids=tokens, position_ids=state.prompt_lengths[state.rows, None] + fed + offsets,
                           **{rollout.keyword: cache}, use_cache=True).logits
    cache.end_static()
    dense_logp = processed_logprobs(logits.flatten(0, 1), temperature).view(*tokens.shape, -1)  # [A, γ+1, V]

    def dense_draw(position: torch.Tensor) -> torch.Tensor:
        """p's own draw at round position `position [A]` of each row: only the position a row stops at
        needs one, so the float64 inverse CDF runs once per row, not γ + 1 times."""
        at_position = logits[torch.arange(len(position), device=position.device), position]
        return draw_tokens(at_position, temperature, None, row_uniforms(seeds, emitted + position))[0]

    draft_logp = drafting.logps[:, :gamma] if gamma else None
    chosen, accepted = accept(tokens[:, 1:], draft_logp, dense_logp, dense_draw, seeds, emitted, temperature)
    advance = torch.where(live, accepted + 1, 0)
    logprobs = dense_logprobs(logits, chosen, temperature, state.logprob_dtype)
    advance = state.emit(chosen, advance, logprobs, sampling.eos_token_id)
    # Slots hold [pending, d1..dγ]: the pending token and the accepted drafts are this row's context now.
    real = offsets[None, :] < advance[:, None]
    for layer in cache.layers:
        layer.real.scatter_(2, slots[:, None, :].expand(-1, layer.selection_heads, -1),
                            real[:, None, :].expand(-1, layer.selection_heads, -1))
    draft.commit_slots(cache, slots, real)
    outputs = rollout.verified
    outputs["accepted"].copy_(accepted)
    outputs["advance"].copy_(advance)
    if gamma:
        outputs["alpha"][:, :gamma].copy_(acceptance_rate(draft_logp, dense_logp[:, :gamma]))


def accept(drafts: torch.Tensor, draft_logp: torch.Tensor | None, dense_logp: torch.Tensor,
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


def dense_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """Log-probs `[A, Q]` of `tokens [A, Q]` under the processed dense distributions `logits [A, Q, V]`
    (temperature applied; greedy records the plain softmax, as the engine does)."""
    scaled = logits.to(dtype) / logit_scale(temperature)
    return scaled.gather(2, tokens[..., None]).squeeze(2) - scaled.logsumexp(dim=2)
