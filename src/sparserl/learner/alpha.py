"""How far the sparse sampler is from the dense policy, token by token: Sparrow's acceptance rate α
(`sparserl.rollout.acceptance`) at every response position of a rollout batch, by a dense recompute
or the exact replay of the sampler."""

from __future__ import annotations

import contextlib

import torch

from ..model.forward import head_logits, logit_scale, map_head_chunks, micro_batches, response_hidden
from ..rollout.acceptance import acceptance_rate, alpha_metrics
from ..rollout.sparsity.replay import sampler_replay


@torch.no_grad()
def rollout_acceptance(model, batch, temperature: float, micro_batch_size: int = 64,
                       sampler_context=contextlib.nullcontext, share_prompts: bool = False,
                       dense_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """α `[N, T]` at every response position of `batch` (a `RolloutBatch` sampled with
    `record_distributions`), against the dense `model` on the same prefixes; 0 outside the response.

    The dense distribution is processed as the sampler's was (temperature applied; greedy rollouts
    record the plain softmax). Where the sampler's distributions were not recorded (vocabularies
    over FULL_DISTRIBUTION_VOCAB), they are rebuilt by the exact replay of the sampler, under
    `sampler_context()` (DistillSparse's adapter), one position chunk at a time: α is exact, and
    peak memory is two chunks of logits, never `[N, T, V]`. `dense_hidden` `[N, T', H]` (T' ≥ T): the dense
    forward's final hidden states of these rows, already computed (π_old's), reused instead of a forward of
    its own; `share_prompts`: forwards that compute each group's prompt once.
    """
    if batch.sampler_distribution is None and not batch.replayable:
        raise ValueError("α needs the sampler's distributions or what replays them: generate the batch with "
                         "RolloutEngine(record_distributions=True)")
    scale = logit_scale(temperature)
    width, span = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    parts = []
    for rows in micro_batches(len(batch), micro_batch_size):
        ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
        hidden = dense_hidden[rows, :span] if dense_hidden is not None else \
            response_hidden(model, ids, mask, width, share_prompts)
        if batch.sampler_distribution is not None:
            alpha, = map_head_chunks(model, hidden, lambda dense, sampler: acceptance_rate(sampler, dense),
                                     batch.sampler_distribution[rows], temperature=scale)
        else:
            with sampler_context():
                sampler_hidden = response_hidden(model, ids, mask, width, share_prompts,
                                                 masks=sampler_replay(model, batch, rows))

            def replayed(dense, sampler_states):
                return acceptance_rate(torch.log_softmax(head_logits(model, sampler_states) / scale, dim=-1), dense)

            alpha, = map_head_chunks(model, hidden, replayed, sampler_hidden, temperature=scale)
        parts.append(alpha)
    return torch.cat(parts) * batch.response_mask


def alpha_points(alpha: torch.Tensor, response_mask: torch.Tensor,
                 prompt_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(α `[M]`, cached length `[M]`) of the M response tokens of a batch: each token's α with the
    length the cache had fed when it was sampled (prompt length + response position), the length
    a budget schedule reads."""
    keep = response_mask.bool()
    lengths = prompt_lengths[:, None].long() + torch.arange(alpha.shape[1], device=alpha.device)[None, :]
    return alpha[keep].float(), lengths[keep]


def rollout_alpha_metrics(model, batches: list, temperature: float, bin_size: int, quantile: float = 0.05,
                          micro_batch_size: int = 64, sampler_context=contextlib.nullcontext,
                          share_prompts: bool = False, dense_hidden: torch.Tensor | None = None) -> dict[str, float]:
    """`alpha_metrics` over every response token of `batches` (sampled with `record_distributions`).
    `dense_hidden` `[N, T, H]`: the dense hidden states of all their rows, in order (the step's π_old forward)."""
    points, first = [], 0
    for batch in batches:
        own = dense_hidden[first:first + len(batch)] if dense_hidden is not None else None
        first += len(batch)
        alpha = rollout_acceptance(model, batch, temperature, micro_batch_size, sampler_context, share_prompts, own)
        points.append(alpha_points(alpha, batch.response_mask, batch.prompt_lengths))
    return alpha_metrics(torch.cat([p[0] for p in points]), torch.cat([p[1] for p in points]), bin_size, quantile)
