"""GRPO objective: group-normalised advantages and the decoupled three-policy PPO loss.

    r_t  = exp(log π_θ − log π_old)
    A_i  = (R_i − mean_group R) / (std_group R + 1e-6)
    ℓ_t  = max(−r_t A_i, −clip(r_t, 1−ε, 1+ε_high) A_i) · w_t
    loss = agg(m' ⊙ ℓ) + β · agg(m' ⊙ k3) − c_H · agg(m' ⊙ H)

`agg` is either the per-sequence mean of token means over every sequence of the minibatch
(`seq-mean-token-mean`, the reference; a fully rejected sequence adds 0 to the sum and 1 to the count)
or one mean over all kept tokens (`token-mean`, DAPO). Masked tokens leave numerator and
denominator alike. The loss of a minibatch is a plain sum of `coefficients * per-token terms`,
so it can be accumulated over micro-batches without changing its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .ratios import LOG_RATIO_CLAMP, k3

ADVANTAGE_EPS = 1e-6
K3_CLAMP = 10.0  # the KL term's per-token bound (the reference's)


def group_advantages(rewards: torch.Tensor, group_size: int, included: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages `[N]` for rewards `[N]` laid out as consecutive groups of `group_size`.

    Mean and (unbiased) std are taken over the group members with `included` True; a group with
    fewer than two included members gets zero advantages (nothing to compare against).
    """
    grouped = rewards.double().view(-1, group_size)
    weight = torch.ones_like(grouped) if included is None else included.double().view(-1, group_size)
    count = weight.sum(dim=1, keepdim=True)
    mean = (grouped * weight).sum(dim=1, keepdim=True) / count.clamp(min=1)
    var = ((grouped - mean) ** 2 * weight).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    advantages = (grouped - mean) / (var.sqrt() + ADVANTAGE_EPS)
    advantages = torch.where(count >= 2, advantages, torch.zeros_like(advantages))
    return advantages.view(-1).to(rewards.dtype)


def token_coefficients(keep_mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """`[B, T]` per-token factors such that `sum(coef * term)` is the aggregated loss of a minibatch."""
    keep = keep_mask.float()
    if loss_agg == "token-mean":
        return keep / keep.sum().clamp(min=1.0)
    if loss_agg == "seq-mean-token-mean":
        per_sequence = keep.sum(dim=1, keepdim=True).clamp(min=1.0)
        return keep / per_sequence / keep.shape[0]
    raise ConfigError(f"loss_agg must be seq-mean-token-mean or token-mean, got {loss_agg!r}")


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, differentiable
    pg_loss: float
    kl: float
    entropy: float
    clip_frac: float
    ratio_mean: float


def ppo_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
             coefficients: torch.Tensor, clip_eps: float, clip_eps_high: float,
             kl_coef: float = 0.0, logp_ref: torch.Tensor | None = None,
             entropy_coef: float = 0.0, entropy: torch.Tensor | None = None) -> LossTerms:
    """The clipped objective for one micro-batch; all tensors `[B, T]` except advantages `[B]`.

    `coefficients` come from `token_coefficients` over the whole minibatch and are zero on masked
    tokens, so masked tokens contribute nothing to any term.
    """
    log_ratio = (logp_new - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    adv = advantages[:, None]
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps_high) * adv
    per_token = torch.maximum(unclipped, clipped) * weights.detach()
    pg_loss = (coefficients * per_token).sum()
    loss = pg_loss
    kl_value = torch.zeros((), dtype=pg_loss.dtype)
    if kl_coef > 0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl_value = (coefficients * kl_k3(logp_new, logp_ref)).sum()
        loss = loss + kl_coef * kl_value
    entropy_value = torch.zeros((), dtype=pg_loss.dtype)
    if entropy is not None:
        entropy_value = (coefficients * entropy).sum()
        loss = loss - entropy_coef * entropy_value
    active = coefficients > 0
    with torch.no_grad():
        clip_frac = ((clipped > unclipped) & active).sum() / active.sum().clamp(min=1)
        ratio_mean = (ratio * active).sum() / active.sum().clamp(min=1)
    return LossTerms(loss, float(pg_loss.detach()), float(kl_value.detach()), float(entropy_value.detach()),
                     float(clip_frac), float(ratio_mean))


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Low-variance estimate of KL(π_θ‖π_ref) per token: k3 of d = log π_ref − log π_θ, clamped to ±K3_CLAMP."""
    return k3(logp_ref - logp).clamp(-K3_CLAMP, K3_CLAMP)
