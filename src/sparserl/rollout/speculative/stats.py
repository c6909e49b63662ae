"""What speculative rollouts did (acceptance, tokens per verification, draft and verify time), and the
adaptive draft length γ that reads it (`speculative.py` samples; this only counts and chooses)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..acceptance import alpha_metrics

PREFIX = "spec_"


@dataclass
class SpeculationStats:
    """Counts over rounds of speculation. A round of a live row proposes γ draft tokens, compares them
    with the dense policy up to the first rejection (`compared`, of which `accepted`), and emits
    accepted + 1 tokens (fewer where the row ends)."""

    rounds: int = 0
    gamma_sum: int = 0  # γ summed over rounds
    verifications: int = 0  # live rows verified, summed over rounds
    tokens: int = 0  # tokens emitted by the rounds (not the first, from the prefill)
    proposed: int = 0
    compared: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_steps: int = 0
    attended_frac: float = 1.0  # the draft's attended real keys / cached real keys
    # Per compared position: α = Σ min(p, q) (the expected acceptance), cached length, whether accepted.
    alpha: list[torch.Tensor] = field(default_factory=list)
    cached_lengths: list[torch.Tensor] = field(default_factory=list)
    was_accepted: list[torch.Tensor] = field(default_factory=list)
    last_advance: int = 0  # tokens the longest row gained in the last round

    def add_round(self, gamma: int, live_rows: int, tokens: int, alpha: torch.Tensor, cached_lengths: torch.Tensor,
                  was_accepted: torch.Tensor, draft_seconds: float, verify_seconds: float) -> None:
        """One round: α, cached lengths and acceptance `[M]` at its M compared positions."""
        self.rounds += 1
        self.gamma_sum += gamma
        self.verifications += live_rows
        self.tokens += tokens
        self.proposed += gamma * live_rows
        self.draft_steps += gamma
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        if gamma:
            accepted = int(was_accepted.sum())
            self.compared += len(was_accepted)
            self.accepted += accepted
            self.alpha.append(alpha.float().cpu())
            self.cached_lengths.append(cached_lengths.cpu())
            self.was_accepted.append(was_accepted.cpu())

    def add(self, other: SpeculationStats) -> None:
        """Fold in another rollout's counts (a later wave or shard)."""
        steps = self.draft_steps + other.draft_steps
        self.attended_frac = (self.attended_frac * self.draft_steps + other.attended_frac * other.draft_steps) / \
            max(steps, 1) if steps else 1.0
        for name in ("rounds", "gamma_sum", "verifications", "tokens", "proposed", "compared", "accepted",
                     "draft_seconds", "verify_seconds", "draft_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("alpha", "cached_lengths", "was_accepted"):
            getattr(self, name).extend(getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / compared draft tokens: the empirical per-token acceptance, α's estimate."""
        return self.accepted / max(self.compared, 1)

    def metrics(self, bin_size: int) -> dict[str, float]:
        """`spec_*`: acceptance rate (overall and `spec_acceptance_len_<start>` per cached-length bin),
        the α statistics of `alpha_metrics` at the compared positions, tokens per verification, mean γ,
        draft and verify seconds, the draft's attended fraction."""
        if not self.rounds:
            return {}
        out = {"acceptance_rate": self.acceptance_rate, "draft_accepted_frac": self.accepted / max(self.proposed, 1),
               "tokens_per_verification": self.tokens / max(self.verifications, 1),
               "gamma_mean": self.gamma_sum / self.rounds, "draft_s": self.draft_seconds,
               "verify_s": self.verify_seconds, "draft_attended_frac": self.attended_frac}
        if self.alpha:
            alpha, lengths, accepted = (torch.cat(x) for x in (self.alpha, self.cached_lengths, self.was_accepted))
            bins = lengths // bin_size
            for b in torch.unique(bins).tolist():
                out[f"acceptance_len_{b * bin_size}"] = float(accepted[bins == b].float().mean())
            out.update(alpha_metrics(alpha, lengths, bin_size))
        return {PREFIX + k: float(v) for k, v in out.items()}


class AdaptiveDraftLength:
    """γ for the next round: the γ in 1..`most` maximising expected tokens per second,
    (1 − α^(γ+1)) / (1 − α) / (γ t_draft + t_verify(γ)), for the running per-token acceptance α.

    α, the draft step's seconds and each tried γ's verify seconds are running means (weight
    `smoothing` on the newest). An untried γ's verify cost comes from a line through the tried ones
    (slope at least 0), or with only one tried, that cost plus a draft step per extra token: on a
    GPU a verification costs about a step whatever γ, on a CPU it grows with γ (docs/benchmarks.md).
    """

    def __init__(self, first: int = 4, most: int = 8, smoothing: float = 0.2):
        self.gamma = min(first, most)
        self.most = most
        self.smoothing = smoothing
        self.alpha: float | None = None
        self.draft_step: float | None = None
        self.verify: dict[int, float] = {}

    def observe(self, gamma: int, alpha: float, draft_step_seconds: float, verify_seconds: float) -> None:
        def mean(old, new):
            return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

        self.alpha = mean(self.alpha, alpha)
        self.draft_step = mean(self.draft_step, draft_step_seconds)
        self.verify[gamma] = mean(self.verify.get(gamma), verify_seconds)

    def verify_cost(self, gamma: int) -> float:
        if gamma in self.verify:
            return self.verify[gamma]
        tried = sorted(self.verify.items())
        # A verification costs at least a decode step, which costs at least a draft step.
        if len(tried) == 1:
            (known, cost), = tried
            return max(cost + (gamma - known) * self.draft_step, self.draft_step)
        gammas = torch.tensor([g for g, _ in tried], dtype=torch.float64)
        costs = torch.tensor([c for _, c in tried], dtype=torch.float64)
        slope = max(0.0, float(((gammas - gammas.mean()) * (costs - costs.mean())).sum()
                               / ((gammas - gammas.mean()) ** 2).sum()))
        return max(float(costs.mean()) + slope * (gamma - float(gammas.mean())), self.draft_step)

    def choose(self) -> int:
        if self.alpha is None:
            return self.gamma
        alpha = min(self.alpha, 1 - 1e-6)

        def rate(gamma: int) -> float:
            return (1 - alpha ** (gamma + 1)) / (1 - alpha) / (gamma * self.draft_step + self.verify_cost(gamma))

        self.gamma = max(range(1, self.most + 1), key=rate)
        return self.gamma
