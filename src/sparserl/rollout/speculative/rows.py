"""What a speculative rollout keeps between its static steps, as device tensors updated in place.

`SpeculativeRows`: the responses (tokens and the dense log-probs, per request), their lengths, which requests still
sample or ended, and which request each cache row holds; `emit` appends a round's tokens without reading anything
back to the host (a token past what a row keeps goes to a spare last column), so a verification step that ends in it
can be captured. `DraftState`: what a round's draft steps read and advance (the token each row feeds, its column and
position, the response index it draws at, and the drafted tokens and distributions).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


class SpeculativeRows:
    """The batch's sampling state (B requests, A cache rows, T = max new tokens)."""

    def __init__(self, batch: int, steps: int, pad: int, seeds: torch.Tensor, prompt_lengths: torch.Tensor,
                 device: torch.device, logprob_dtype: torch.dtype):
        self.steps = steps
        self.seeds, self.prompt_lengths = seeds, prompt_lengths
        self.logprob_dtype = logprob_dtype
        # A spare last column takes the writes of the tokens a row does not keep.
        self.response_ids = torch.full((batch, steps + 1), pad, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch, steps + 1), dtype=logprob_dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.live = torch.ones(batch, dtype=torch.bool, device=device)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.rows = torch.arange(batch, device=device)  # the request of each cache row

    def tensors(self) -> list[torch.Tensor]:
        """What a step reads and advances here."""
        return [self.response_ids, self.logprobs, self.lengths, self.live, self.ended, self.rows]

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
            self.ended.index_put_((rows,), self.ended[rows] | hit)
        keep = offsets < advance[:, None]
        columns = torch.where(keep, emitted[:, None] + offsets, self.steps)
        requests = rows[:, None].expand_as(keep)
        self.response_ids.index_put_((requests, columns), tokens)
        self.logprobs.index_put_((requests, columns), logprobs.to(self.logprob_dtype))
        self.lengths.index_put_((rows,), emitted + advance)
        self.live.index_put_((rows,), self.live[rows] & ~self.ended[rows] & (emitted + advance < self.steps))
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
class DraftState:
    """A round's draft steps, `[A]` unless said: the token each row feeds, its column and RoPE position, whether it is
    real (the row samples), the response index its draw is at; the draft so far (`tokens [A, γmax]`, the draft's
    processed log-distributions `logps [A, γmax, V]`) and `step`, the index of the next draft token (a scalar)."""

    feed: torch.Tensor
    columns: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    index: torch.Tensor
    tokens: torch.Tensor
    logps: torch.Tensor
    step: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]
