"""Rollout corrections: rejection filters and importance weights for sparse rollouts (Sparse-RL's,
and the sequence filters of verl and OpenRLHF).

Given the log-probs of the sampled tokens under the dense old policy (π_old) and under the sparse
sampler (π_sparse), with ξ = π_old / π_sparse per token, decide which tokens take part in the loss
(`keep_mask`) and with what importance weight (`weights`), and report the mismatch metrics.

Filters compose freely; each is off when its field is None:
- `veto_threshold` (Sparse-RL): a token with ξ below it rejects its whole sequence, or, with
  `veto_scope="prefix"`, only the tokens from it onward (the ones before were sampled from a
  context the dense policy shares);
- `band` (Sparse-RL's band, IcePop's two-sided token mask): tokens with ξ outside [low, high];
- `seq_geo_bounds` (verl's Geo-RS, `seq_mean_k1`): sequences whose geometric-mean ξ leaves [low, high];
- `seq_k3_max` (verl's `seq_mean_k3`): sequences whose mean ξ − 1 − log ξ exceeds the bound;
- `seq_log_ratio_max` (verl's symmetric veto): sequences with some |log ξ| above the bound.

Named combinations (the modes) are classmethods here and are registered in `sparserl.config.presets`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..config.corrections import CorrectionConfig
from .ratios import LOG_RATIO_CLAMP, k3

_QUANTILES = (0.01, 0.05, 0.50, 0.95, 0.99)
SEQUENCE_FILTERS = ("geo", "k3", "max_log")


@dataclass
class Corrections:
    """Result of `compute_corrections`.

    weights: [B, T] detached importance weights, 0 outside the response mask. Tokens rejected by a
        filter keep their weight; the loss drops them through `keep_mask`.
    keep_mask: [B, T] float 0/1, the response tokens that pass every filter.
    metrics: mismatch and rejection metrics as plain floats.
    seq_keep: [B] bool, False for sequences removed whole by a sequence-level filter or the
        sequence veto (True for rows with no response token; a prefix veto leaves it True).
    """

    weights: torch.Tensor
    keep_mask: torch.Tensor
    metrics: dict[str, float]
    seq_keep: torch.Tensor = field(default_factory=lambda: torch.ones(0, dtype=torch.bool))


def _quantile(sorted_x: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (torch.quantile's default) of a sorted 1-D tensor.

    Done by hand because torch.quantile refuses inputs above 2**24 elements.
    """
    pos = q * (sorted_x.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    a, b = sorted_x[lo].item(), sorted_x[hi].item()
    return a + (b - a) * (pos - lo)


@dataclass
class TokenRatios:
    """ξ = π_old / π_sparse of one batch in float64, [B, T] unless said, 0 (log) outside the response."""

    old: torch.Tensor  # log π_old of the sampled tokens
    sampler: torch.Tensor  # log π_sparse of the sampled tokens
    resp: torch.Tensor  # bool, the response tokens
    log_ratio: torch.Tensor  # log ξ, exactly 0 outside the response, so sums over T need no extra masking
    clamped: torch.Tensor  # log ξ clamped to ±20
    xi: torch.Tensor  # exp(clamped)
    n_tok: torch.Tensor  # [B] response tokens per row
    has_resp: torch.Tensor  # [B] bool


@dataclass
class Filtered:
    """What the filters leave: each filter's own removal ([B, T] bool, response tokens only), the
    sequences kept whole ([B] bool), the tokens kept ([B, T] bool) and the band test ([B, T] bool)."""

    removed: dict[str, torch.Tensor]
    seq_keep: torch.Tensor
    keep: torch.Tensor
    in_band: torch.Tensor


@torch.no_grad()
def compute_corrections(
    logp_old: torch.Tensor,
    logp_sampler: torch.Tensor,
    response_mask: torch.Tensor,
    config: CorrectionConfig,
    batch_total: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Corrections:
    """Rejection masks, importance weights and mismatch metrics for one batch.

    logp_old, logp_sampler: [B, T] log-probs of the sampled tokens under π_old and π_sparse.
    response_mask: [B, T] {0,1} float or bool; values outside it are ignored (may be inf/NaN).
    batch_total: where this batch is one process's part of a larger one, sums a float64 `[2]` tensor (the
        weights' sum and the response-token count) over every part, so that `batch_normalize` divides by the mean
        of the whole batch, as one process holding it all would (None: this batch is the whole batch).
    Computed in float64; weights come back in float32 (float64 if the inputs are float64).
    """
    if logp_old.dim() != 2 or logp_old.shape != logp_sampler.shape or logp_old.shape != response_mask.shape:
        raise ValueError(
            "logp_old, logp_sampler and response_mask must all be [B, T], got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sampler.shape)}, {tuple(response_mask.shape)}"
        )
    out_dtype = torch.promote_types(logp_old.dtype, torch.float32)
    ratios = token_ratios(logp_old, logp_sampler, response_mask)
    sequence_stats = _sequence_statistics(ratios.log_ratio, ratios.clamped, ratios.xi, ratios.n_tok)
    filtered = apply_filters(ratios, sequence_stats, config)
    weights, normaliser = importance_weights(ratios, config, batch_total)
    metrics = _metrics(logp_old=ratios.old, logp_sampler=ratios.sampler, clamped=ratios.clamped, xi=ratios.xi,
                       resp=ratios.resp, seq_keep=filtered.seq_keep, has_resp=ratios.has_resp,
                       in_band=filtered.in_band, keep=filtered.keep, w=weights)
    metrics.update(_filter_metrics(filtered.removed, ratios.resp, ratios.has_resp))
    metrics.update(_sequence_statistic_metrics(sequence_stats, ratios.has_resp))
    metrics["is_batch_norm_factor"] = normaliser
    return Corrections(weights=weights.to(out_dtype), keep_mask=filtered.keep.to(out_dtype), metrics=metrics,
                       seq_keep=filtered.seq_keep)


def token_ratios(logp_old: torch.Tensor, logp_sampler: torch.Tensor, response_mask: torch.Tensor) -> TokenRatios:
    """The per-token ratios every filter, weight and metric reads (shapes as in `compute_corrections`)."""
    resp = response_mask.detach() != 0
    old = torch.where(resp, logp_old.detach().double(), 0.0)
    smp = torch.where(resp, logp_sampler.detach().double(), 0.0)
    log_ratio = old - smp
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    n_tok = resp.double().sum(dim=1)
    return TokenRatios(old=old, sampler=smp, resp=resp, log_ratio=log_ratio, clamped=clamped, xi=clamped.exp(),
                       n_tok=n_tok, has_resp=n_tok > 0)


def apply_filters(ratios: TokenRatios, sequence_stats: dict[str, torch.Tensor], config: CorrectionConfig) -> Filtered:
    """Each filter the config turns on; padding has log ξ = 0, so it never trips one."""
    resp, has_resp = ratios.resp, ratios.has_resp
    removed: dict[str, torch.Tensor] = {}
    if config.veto_threshold is not None:
        below = ratios.log_ratio < math.log(config.veto_threshold)  # the unclamped ratio, as the reference does
        if config.veto_scope == "prefix":
            removed["prefix_veto"] = below.cumsum(dim=1) > 0
        else:
            removed["veto"] = below.any(dim=1, keepdim=True).expand_as(resp)
    sequence_bounds = {"geo": config.seq_geo_bounds,
                       "k3": (0.0, config.seq_k3_max) if config.seq_k3_max is not None else None,
                       "max_log": (0.0, config.seq_log_ratio_max) if config.seq_log_ratio_max is not None else None}
    for name, bounds in sequence_bounds.items():
        if bounds is not None:
            statistic = sequence_stats[name]
            outside = has_resp & ((statistic < bounds[0]) | (statistic > bounds[1]))
            removed[name] = outside[:, None].expand_as(resp)
    in_band = torch.ones_like(resp)
    if config.band is not None:
        in_band = (ratios.xi >= config.band[0]) & (ratios.xi <= config.band[1])
        removed["band"] = ~in_band
    removed = {name: mask & resp for name, mask in removed.items()}
    seq_keep = torch.ones_like(has_resp)
    for name in ("veto", *SEQUENCE_FILTERS):
        if name in removed:
            seq_keep &= ~removed[name].any(dim=1)
    keep = resp.clone()
    for mask in removed.values():
        keep &= ~mask
    return Filtered(removed=removed, seq_keep=seq_keep, keep=keep, in_band=in_band)


def importance_weights(ratios: TokenRatios, config: CorrectionConfig,
                       batch_total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
    """[B, T] float64 weights, 0 outside the response, and the batch normaliser applied (1.0 if none).

    The sequence and geometric levels sum over every response token, rejected ones included. `batch_total`: as in
    `compute_corrections`."""
    xi, clamped = ratios.xi, ratios.clamped
    if config.is_level == "token":
        ratio = xi
    elif config.is_level == "sequence":
        ratio = clamped.sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()[:, None].expand_as(xi)
    else:
        ratio = (clamped.sum(dim=1) / ratios.n_tok.clamp(min=1)).exp()[:, None].expand_as(xi)

    cap = config.is_cap
    if config.is_mode == "truncate":
        w = ratio.clamp(max=cap)
    elif config.is_mode == "clip":
        w = ratio.clamp(1.0 / cap, cap)
    elif config.is_mode == "mask":
        w = torch.where(ratio <= cap, ratio, 0.0)
    else:
        w = torch.ones_like(ratio)
    w = w * ratios.resp.double()

    # Mean over every response token, rejected ones included (reference behaviour).
    normaliser = 1.0
    if not config.batch_normalize:
        return w, normaliser
    totals = torch.stack([w.sum(), ratios.resp.double().sum()])
    if batch_total is not None:
        totals = batch_total(totals)
    weight_sum, n_resp = totals.tolist()
    if n_resp > 0 and weight_sum > 0:
        normaliser = weight_sum / n_resp
        w = w / normaliser
    return w, normaliser


def _sequence_statistics(log_ratio, clamped, xi, n_tok) -> dict[str, torch.Tensor]:
    """Per-sequence [B] statistics the sequence filters test: geometric-mean ξ, mean k3, max |log ξ|.

    The geometric mean and k3 use the ratio clamped to ±20 in log space (as the weights do); the max
    rule uses the raw ratio, like the veto. Rows without response tokens get 1, 0 and 0.
    """
    per_token = n_tok.clamp(min=1)
    return {"geo": (clamped.sum(dim=1) / per_token).exp(),
            "k3": k3(clamped).sum(dim=1) / per_token,
            "max_log": log_ratio.abs().amax(dim=1) if log_ratio.shape[1] else n_tok.clone()}


def _filter_metrics(removed: dict[str, torch.Tensor], resp: torch.Tensor, has_resp: torch.Tensor) -> dict[str, float]:
    """What each applied filter alone removes: `applied_<filter>_token_frac` of the response tokens and
    `applied_<filter>_seq_frac` of the sequences it touches (removes whole, or cuts, for the prefix veto)."""
    n_resp = max(int(resp.sum().item()), 1)
    n_seq = max(int(has_resp.sum().item()), 1)
    out = {}
    for name, mask in removed.items():
        out[f"applied_{name}_token_frac"] = int(mask.sum().item()) / n_resp
        out[f"applied_{name}_seq_frac"] = int(mask.any(dim=1).sum().item()) / n_seq
    return out


def _sequence_statistic_metrics(stats: dict[str, torch.Tensor], has_resp: torch.Tensor) -> dict[str, float]:
    """Raw (before any filter) quantiles of the per-sequence statistics, to choose thresholds from."""
    out = {}
    if not bool(has_resp.any()):
        return out
    for name, values in stats.items():
        ordered = values[has_resp].sort().values
        for q in (0.05, 0.50, 0.95):
            out[f"raw_seq_{name}_q{round(q * 100):02d}"] = _quantile(ordered, q)
    return out


def _metrics(*, logp_old, logp_sampler, clamped, xi, resp, seq_keep, has_resp, in_band, keep, w) -> dict[str, float]:
    """The mismatch metrics logged every step (ξ statistics, log-perplexities, KL, rejection rates,
    effective sample size); all [B, T] float64 / bool except seq_keep, has_resp [B] bool.

    Conventions when there is nothing to average: ξ statistics 1.0 (no mismatch), log-ppl and KL
    0.0, fractions 0.0, ess 1.0 when no token is kept (0.0 if kept tokens all weigh 0),
    weight_mean/weight_max 0.0. So no metric is ever NaN for finite response log-probs.
    """
    n_resp = int(resp.sum().item())
    m: dict[str, float] = {}
    if n_resp > 0:
        xs = xi[resp].sort().values
        m["xi_mean"] = xs.mean().item()
        m["xi_min"] = xs[0].item()
        m["xi_max"] = xs[-1].item()
        for q in _QUANTILES:
            m[f"xi_q{round(q * 100):02d}"] = _quantile(xs, q)
        m["logppl_sampler"] = -logp_sampler[resp].mean().item()
        m["logppl_old"] = -logp_old[resp].mean().item()
        m["kl_sampler_old"] = (logp_sampler - logp_old)[resp].mean().item()
        # k3 = ρ − 1 − log ρ with ρ = ξ: non-negative, lower variance than the plain log-ratio mean.
        m["kl_k3_sampler_old"] = k3(clamped)[resp].mean().item()
    else:
        m.update({k: 1.0 for k in ("xi_mean", "xi_min", "xi_max")})
        m.update({f"xi_q{round(q * 100):02d}": 1.0 for q in _QUANTILES})
        m.update({k: 0.0 for k in ("logppl_sampler", "logppl_old", "kl_sampler_old", "kl_k3_sampler_old")})

    # Count the rejected sequences (the reference counted the kept ones); empty rows can't be rejected.
    n_seq = int(has_resp.sum().item())
    n_rejected = int((has_resp & ~seq_keep).sum().item())
    m["rejected_sequences"] = float(n_rejected)
    m["rejected_seq_frac"] = n_rejected / n_seq if n_seq else 0.0
    alive = resp & seq_keep[:, None]
    n_alive = int(alive.sum().item())
    m["band_mask_frac"] = int((alive & ~in_band).sum().item()) / n_alive if n_alive else 0.0
    n_keep = int(keep.sum().item())
    m["kept_token_frac"] = n_keep / n_resp if n_resp else 0.0
    m["response_tokens"] = float(n_resp)
    m["kept_tokens"] = float(n_keep)

    wk = w[keep]
    if n_keep:
        s1, s2 = wk.sum().item(), (wk * wk).sum().item()
        m["ess"] = s1 * s1 / (n_keep * s2) if s2 > 0 else 0.0
        m["weight_mean"] = wk.mean().item()
        m["weight_max"] = wk.max().item()
    else:
        m.update(ess=1.0, weight_mean=0.0, weight_max=0.0)
    return m


def rejection_by_length(
    response_lengths: torch.Tensor, seq_keep: torch.Tensor, boundaries: Sequence[int]
) -> dict[str, float]:
    """Veto fraction per response-length bucket, to make a length-dependent filter visible.

    response_lengths: [B] ints; seq_keep: [B] bool (False = vetoed); boundaries: where one bucket
    ends and the next starts, positive and non-decreasing. The buckets [0, b0), [b0, b1), ...,
    [b_last, inf) hold every length once, keyed `veto_frac_len_{lo}_{hi}` (`..._inf` for the
    last). Empty buckets are omitted, so a repeated boundary (a response bound shorter than the
    number of buckets) just gives fewer keys; rows of length 0 are not counted (they can't be
    vetoed, as in `veto_frac`).
    """
    boundaries = [int(b) for b in boundaries]
    if any(b <= 0 for b in boundaries) or any(b < a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"length bucket boundaries must be positive and non-decreasing, got {boundaries!r}")
    lengths = response_lengths.detach().long().cpu()
    vetoed = ~seq_keep.detach().bool().cpu()
    out: dict[str, float] = {}
    for lo, hi in zip([0, *boundaries], [*boundaries, None]):
        sel = (lengths >= lo) & (lengths > 0)
        if hi is not None:
            sel &= lengths < hi
        n = int(sel.sum().item())
        if n:
            out[f"veto_frac_len_{lo}_{'inf' if hi is None else hi}"] = int((vetoed & sel).sum().item()) / n
    return out
