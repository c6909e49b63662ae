"""How far the sparse sampler is from the dense policy, token by token: Sparrow's acceptance rate α
(`sparserl.rollout.acceptance`) at every response position of a rollout batch, by a dense recompute
or the exact replay of the sampler."""

from __future__ import annotations

import contextlib

import torch

from ..rollout.acceptance import acceptance_rate, alpha_metrics


@torch.no_grad()
def rollout_acceptance(model, batch, temperature: float, micro_batch_size: int = 64,
                       sampler_context=contextlib.nullcontext) -> torch.Tensor:
    """α `[N, T]` at every response position of `batch` (a `RolloutBatch` sampled with
    `record_distributions`), against the dense `model` on the same prefixes; 0 outside the response.

    The dense distribution is processed as the sampler's was (temperature applied; greedy rollouts
    record the plain softmax). Where the sampler's distributions were not recorded (vocabularies
    over FULL_DISTRIBUTION_VOCAB), they are rebuilt by the exact replay of the sampler, under
    `sampler_context()` (DistillSparse's adapter), one position chunk at a time: α is exact, and
    peak memory is two chunks of logits, never `[N, T, V]`.
    """
    from ..model.forward import (
        head_logits,
        logit_scale,
        map_head_chunks,
        micro_batches,
        response_hidden,
    )
    from ..rollout.sparsity.replay import replay_attention

    if batch.sampler_distribution is None and not batch.replayable:
        raise ValueError("α needs the sampler's distributions or what replays them: generate the batch with "
                         "RolloutEngine(record_distributions=True)")
    scale = logit_scale(temperature)
    width = batch.prompt_ids.shape[1]
    parts = []
    for rows in micro_batches(len(batch), micro_batch_size):
        ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
        hidden = response_hidden(model, ids, mask, width)
        if batch.sampler_distribution is not None:
            alpha, = map_head_chunks(model, hidden, lambda dense, sampler: acceptance_rate(sampler, dense),
                                     batch.sampler_distribution[rows], temperature=scale)
        else:
            with sampler_context(), replay_attention(model, batch, rows):
                sampler_hidden = response_hidden(model, ids, mask, width)

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
                          micro_batch_size: int = 64, sampler_context=contextlib.nullcontext) -> dict[str, float]:
    """`alpha_metrics` over every response token of `batches` (sampled with `record_distributions`)."""
    points = [alpha_points(rollout_acceptance(model, b, temperature, micro_batch_size, sampler_context),
                           b.response_mask, b.prompt_lengths) for b in batches]
    return alpha_metrics(torch.cat([p[0] for p in points]), torch.cat([p[1] for p in points]), bin_size, quantile)
