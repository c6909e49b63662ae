"""Sparrow's acceptance rate α between a sampler's and the dense policy's next-token distributions,
and its lower tail per bin of cached length.

α = Σ_v min(p_sparse(v), p_dense(v)) is 1 − the total-variation distance, and the probability that
a draw from the sparse sampler is accepted by speculative-decoding rejection against the dense
policy: the learner measures the mismatch with it (`sparserl.learner.alpha`) and the speculative
sampler's acceptance test is it (`speculative.py`). Most tokens have α > 0.999; training stability
is decided by the lower tail, so `alpha_metrics` takes a low quantile of α per bin of cached length
(the length a budget schedule reads).
"""

from __future__ import annotations

import math

import torch


def acceptance_rate(logp_sparse: torch.Tensor, logp_dense: torch.Tensor) -> torch.Tensor:
    """α `[...]` of two next-token distributions given as log-probabilities `[..., V]`, both processed
    the way the sampler samples (temperature applied)."""
    if logp_sparse.shape != logp_dense.shape:
        raise ValueError(f"logp_sparse and logp_dense must have one shape, got {tuple(logp_sparse.shape)} "
                         f"and {tuple(logp_dense.shape)}")
    return torch.minimum(logp_sparse.float(), logp_dense.float()).exp().sum(dim=-1)


TAIL_PREFIX = "alpha_tail_len_"


def alpha_metrics(alpha: torch.Tensor, cached_lengths: torch.Tensor, bin_size: int,
                  quantile: float = 0.05) -> dict[str, float]:
    """`alpha_mean`, `alpha_tail` (the lowest per-bin `quantile`) and `alpha_tail_len_<start>` for
    each cached-length bin, from the points of `sparserl.learner.alpha.alpha_points` (any number of batches concatenated).

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


def bin_tails(metrics: dict[str, float]) -> dict[int, float]:
    """{bin start: tail} from the `alpha_tail_len_<start>` entries of `alpha_metrics`."""
    return {int(k[len(TAIL_PREFIX):]): v for k, v in metrics.items() if k.startswith(TAIL_PREFIX)}
