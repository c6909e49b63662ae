"""The two facts about log-ratios that the corrections and the loss share: how far a log-ratio is clamped before
it is exponentiated, and k3, the low-variance KL estimate e^d − 1 − d of a log-ratio d."""

from __future__ import annotations

import torch

# |log ratio| past this is clamped before exp: e^20 ≈ 5e8 is no real ratio, and e^88 overflows float32.
LOG_RATIO_CLAMP = 20.0


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """e^d − 1 − d per element of `log_ratio` d: non-negative, and an unbiased, low-variance estimate of
    KL(p‖q) when d = log q − log p at tokens sampled from p (Schulman's k3)."""
    return log_ratio.exp() - 1 - log_ratio
