"""How far the sparse sampler is from the dense policy, token by token (Sparrow's acceptance rate).

`acceptance_rate` compares whole next-token distributions: α = Σ_v min(p_sparse(v), p_dense(v)),
which is 1 − the total-variation distance and the probability that a draw from the sparse sampler
would be accepted by speculative-decoding-style rejection against the dense policy. Most tokens
have α > 0.999; training stability is decided by the lower tail, so `alpha_metrics` takes a low
quantile of α per bin of cached length (the length a budget schedule reads).
"""

from __future__ import annotations

import contextlib
import math

import torch


def acceptance_rate(logp_sparse: torch.Tensor, logp_dense: torch.Tensor) -> torch.Tensor:
    """α `[...]` of two next-token distributions given as log-probabilities `[..., V]`, both processed
    the way the sampler samples (temperature applied)."""
    if logp_sparse.shape != logp_dense.shape:
        raise ValueError(f"logp_sparse and logp_dense must have one shape, got {tuple(logp_sparse.shape)} "
                         f"and {tuple(logp_dense.shape)}")
    return torch.minimum(logp_sparse.float(), logp_dense.float()).exp().sum(dim=-1)


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
    from ..model.forward import head_logits, map_head_chunks, micro_batches, response_hidden
    from ..rollout.replay import replay_attention

    if batch.sampler_distribution is None and not batch.replayable:
        raise ValueError("α needs the sampler's distributions or what replays them: generate the batch with "
                         "RolloutEngine(record_distributions=True)")
    scale = temperature if temperature > 0 else 1.0
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


def alpha_metrics(alpha: torch.Tensor, cached_lengths: torch.Tensor, bin_size: int,
                  quantile: float = 0.05) -> dict[str, float]:
    """`alpha_mean`, `alpha_tail` (the lowest per-bin `quantile`) and `alpha_tail_len_<start>` for
    each cached-length bin, from the points of `alpha_points` (any number of batches concatenated).

    A bin needs at least 1 / quantile tokens (20 for the 5th percentile) for its quantile to be
    more than its single worst token; sparser bins are left out, and `alpha_tail_tokens` says how
    many tokens the tail rests on.
    """
    if alpha.numel() == 0:
        return {}
    least = math.ceil(1 / quantile) if quantile > 0 else 1
    bins = cached_lengths // bin_size
    per_bin, counted = {}, 0
    for b in torch.unique(bins).tolist():
        values = alpha[bins == b]
        if values.numel() >= least:
            per_bin[f"{TAIL_PREFIX}{int(b) * bin_size}"] = float(torch.quantile(values, quantile))
            counted += values.numel()
    out = {"alpha_mean": float(alpha.mean()), "alpha_tail_tokens": float(counted), **per_bin}
    if per_bin:
        out["alpha_tail"] = min(per_bin.values())
    return out


TAIL_PREFIX = "alpha_tail_len_"


def rollout_alpha_metrics(model, batches: list, temperature: float, bin_size: int, quantile: float = 0.05,
                          micro_batch_size: int = 64, sampler_context=contextlib.nullcontext) -> dict[str, float]:
    """`alpha_metrics` over every response token of `batches` (sampled with `record_distributions`)."""
    points = [alpha_points(rollout_acceptance(model, b, temperature, micro_batch_size, sampler_context),
                           b.response_mask, b.prompt_lengths) for b in batches]
    return alpha_metrics(torch.cat([p[0] for p in points]), torch.cat([p[1] for p in points]), bin_size, quantile)


def bin_tails(metrics: dict[str, float]) -> dict[int, float]:
    """{bin start: tail} from the `alpha_tail_len_<start>` entries of `alpha_metrics`."""
    return {int(k[len(TAIL_PREFIX):]): v for k, v in metrics.items() if k.startswith(TAIL_PREFIX)}
