"""Sparse-RL corrections (SPEC §3): sparsity-aware rejection sampling and importance reweighting.

Given the log-probs of the sampled tokens under the dense old policy (π_old) and under the sparse
sampler (π_sparse), decide which tokens take part in the loss (`keep_mask`) and with what
importance weight (`weights`), and report the mismatch metrics of SPEC §3.6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

_LOG_CLAMP = 20.0
_QUANTILES = (0.01, 0.05, 0.50, 0.95, 0.99)


@dataclass
class CorrectionConfig:
    """Settings of the corrections; defaults are the Sparse-RL reference's.

    veto_threshold: reject a whole sequence if any response token has ξ < this (None: no veto).
    band: keep only tokens with low ≤ ξ ≤ high, both ends inclusive (None: no band).
    is_mode: how ξ becomes a weight — "truncate": min(ξ, cap); "clip": clamp(ξ, 1/cap, cap)
        (so it needs cap ≥ 1); "mask": ξ where ξ ≤ cap, else 0 (the token stays in keep_mask and
        only its weight is zeroed); "none": all ones.
    is_level: "token" (per-token ξ), "sequence" (product of ξ over the response) or "geometric"
        (geometric mean of ξ over the response); the mode is applied after the level.
    batch_normalize: divide the weights by their mean over all response tokens of the batch.
    """

    veto_threshold: float | None = 1e-4  # reject a whole sequence with any token of ξ below this (none: no veto)
    band: tuple[float, float] | None = (0.5, 1.5)  # keep only tokens with LOW <= ξ <= HIGH, as LOW,HIGH (none: no band)
    is_mode: Literal["truncate", "clip", "mask", "none"] = "truncate"  # how ξ becomes an importance weight
    is_cap: float = 1.5  # the weights' cap C
    is_level: Literal["token", "sequence", "geometric"] = "token"  # ratio per token, its product, or geometric mean
    batch_normalize: bool = True  # divide the weights by their batch mean

    def __post_init__(self) -> None:
        if self.veto_threshold is not None and not self.veto_threshold > 0:
            raise ValueError(f"veto_threshold must be > 0 or None, got {self.veto_threshold!r}")
        if self.band is not None:
            if len(self.band) != 2:
                raise ValueError(f"band must be a (low, high) pair or None, got {self.band!r}")
            low, high = self.band
            if not (low >= 0 and high > 0):
                raise ValueError(f"band must have low >= 0 and high > 0, got {self.band!r}")
            if low > high:
                raise ValueError(f"band low must be <= high, got {self.band!r}")
            self.band = (float(low), float(high))
        if self.is_mode not in ("truncate", "clip", "mask", "none"):
            raise ValueError(f"is_mode must be truncate|clip|mask|none, got {self.is_mode!r}")
        if not self.is_cap > 0 or math.isinf(self.is_cap):
            raise ValueError(f"is_cap must be a finite number > 0, got {self.is_cap!r}")
        if self.is_mode == "clip" and self.is_cap < 1:
            raise ValueError(f"is_cap must be >= 1 with is_mode='clip' (else [1/cap, cap] is empty), got {self.is_cap!r}")
        if self.is_level not in ("token", "sequence", "geometric"):
            raise ValueError(f"is_level must be token|sequence|geometric, got {self.is_level!r}")


@dataclass
class Corrections:
    """Result of `compute_corrections`.

    weights: [B, T] detached importance weights, 0 outside the response mask. Tokens rejected by
        the band or the veto keep their weight; the loss drops them through `keep_mask`.
    keep_mask: [B, T] float 0/1, response_mask × sequence not vetoed × in band.
    metrics: mismatch and rejection metrics as plain floats.
    seq_keep: [B] bool, False for vetoed sequences (True for rows with no response token).
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


@torch.no_grad()
def compute_corrections(
    logp_old: torch.Tensor,
    logp_sampler: torch.Tensor,
    response_mask: torch.Tensor,
    config: CorrectionConfig,
) -> Corrections:
    """Rejection masks, importance weights and mismatch metrics for one batch.

    logp_old, logp_sampler: [B, T] log-probs of the sampled tokens under π_old and π_sparse.
    response_mask: [B, T] {0,1} float or bool; values outside it are ignored (may be inf/NaN).
    Computed in float64; weights come back in float32 (float64 if the inputs are float64).
    """
    if logp_old.dim() != 2 or logp_old.shape != logp_sampler.shape or logp_old.shape != response_mask.shape:
        raise ValueError(
            "logp_old, logp_sampler and response_mask must all be [B, T], got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sampler.shape)}, {tuple(response_mask.shape)}"
        )
    out_dtype = torch.promote_types(logp_old.dtype, torch.float32)
    resp = response_mask.detach() != 0
    resp_f = resp.double()
    old = torch.where(resp, logp_old.detach().double(), 0.0)
    smp = torch.where(resp, logp_sampler.detach().double(), 0.0)
    log_ratio = old - smp  # exactly 0 outside the response, so sums over T need no extra masking
    clamped = log_ratio.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    xi = clamped.exp()
    n_tok = resp_f.sum(dim=1)  # [B]
    has_resp = n_tok > 0

    # Veto on the unclamped ratio, as specified; padding has log_ratio 0 so it never vetoes.
    if config.veto_threshold is not None:
        seq_keep = ~(log_ratio < math.log(config.veto_threshold)).any(dim=1)
    else:
        seq_keep = torch.ones_like(has_resp)
    in_band = torch.ones_like(resp)
    if config.band is not None:
        low, high = config.band
        in_band = (xi >= low) & (xi <= high)
    keep = resp & seq_keep[:, None] & in_band

    # Levels: sequence/geometric sum over all response tokens (band-rejected ones included).
    if config.is_level == "token":
        ratio = xi
    elif config.is_level == "sequence":
        ratio = clamped.sum(dim=1).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()[:, None].expand_as(xi)
    else:
        ratio = (clamped.sum(dim=1) / n_tok.clamp(min=1)).exp()[:, None].expand_as(xi)

    cap = config.is_cap
    if config.is_mode == "truncate":
        w = ratio.clamp(max=cap)
    elif config.is_mode == "clip":
        w = ratio.clamp(1.0 / cap, cap)
    elif config.is_mode == "mask":
        w = torch.where(ratio <= cap, ratio, 0.0)
    else:
        w = torch.ones_like(ratio)
    w = w * resp_f

    # Mean over every response token, vetoed and band-rejected ones included (reference behaviour).
    n_resp = int(resp.sum().item())
    if config.batch_normalize and n_resp > 0:
        mean_w = w.sum() / n_resp
        if mean_w > 0:
            w = w / mean_w

    metrics = _metrics(logp_old=old, logp_sampler=smp, clamped=clamped, xi=xi, resp=resp,
                       seq_keep=seq_keep, has_resp=has_resp, in_band=in_band, keep=keep, w=w)
    return Corrections(weights=w.to(out_dtype), keep_mask=keep.to(out_dtype), metrics=metrics,
                       seq_keep=seq_keep)


def _metrics(*, logp_old, logp_sampler, clamped, xi, resp, seq_keep, has_resp, in_band, keep, w) -> dict[str, float]:
    """Metrics of SPEC §3.6; all [B, T] float64 / bool except seq_keep, has_resp [B] bool.

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
        m["kl_k3_sampler_old"] = (xi - 1.0 - clamped)[resp].mean().item()
    else:
        m.update({k: 1.0 for k in ("xi_mean", "xi_min", "xi_max")})
        m.update({f"xi_q{round(q * 100):02d}": 1.0 for q in _QUANTILES})
        m.update({k: 0.0 for k in ("logppl_sampler", "logppl_old", "kl_sampler_old", "kl_k3_sampler_old")})

    # Count the vetoed sequences (the reference counted the kept ones); empty rows can't be vetoed.
    n_seq = int(has_resp.sum().item())
    n_vetoed = int((has_resp & ~seq_keep).sum().item())
    m["vetoed_sequences"] = float(n_vetoed)
    m["veto_frac"] = n_vetoed / n_seq if n_seq else 0.0
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
    response_lengths: torch.Tensor, seq_keep: torch.Tensor, edges: Sequence[int]
) -> dict[str, float]:
    """Veto fraction per response-length bucket, to make a length-dependent filter visible.

    response_lengths: [B] ints; seq_keep: [B] bool (False = vetoed); edges: strictly increasing.
    Buckets are [edges[i], edges[i+1]) and a last [edges[-1], inf), keyed
    `veto_frac_len_{lo}_{hi}` (`..._inf` for the last). Empty buckets are omitted; rows of length
    0 are skipped (they can't be vetoed, as in `veto_frac`), as are lengths below edges[0].
    """
    edges = [int(e) for e in edges]
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges must be a non-empty strictly increasing sequence, got {edges!r}")
    lengths = response_lengths.detach().long().cpu()
    vetoed = ~seq_keep.detach().bool().cpu()
    out: dict[str, float] = {}
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        sel = (lengths >= lo) & (lengths > 0)
        if hi is not None:
            sel &= lengths < hi
        n = int(sel.sum().item())
        if n:
            out[f"veto_frac_len_{lo}_{'inf' if hi is None else hi}"] = int((vetoed & sel).sum().item()) / n
    return out
