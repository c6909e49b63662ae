"""Acceptance rate and its tail against float64 brute force (loops over the vocabulary, numpy quantiles)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparserl.learner.alpha import alpha_points
from sparserl.rollout.acceptance import acceptance_rate, alpha_metrics


def _brute_alpha(p: np.ndarray, q: np.ndarray) -> float:
    """Σ min(p, q) over all tokens."""
    return sum(min(p[v], q[v]) for v in range(len(p)))


def _log_dists(shape, vocab, seed, sharp=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(sharp * torch.randn(*shape, vocab, generator=generator, dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("vocab, sharp", [(7, 1.0), (50, 3.0), (50, 30.0)])
def test_acceptance_rate_matches_brute_force(vocab, sharp):
    a, b = _log_dists((3, 4), vocab, 1, sharp), _log_dists((3, 4), vocab, 2, sharp)
    got = acceptance_rate(a.float(), b.float())
    assert got.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            expected = _brute_alpha(a[i, j].exp().numpy(), b[i, j].exp().numpy())
            assert got[i, j].item() == pytest.approx(expected, abs=2e-6)


def test_acceptance_rate_extremes():
    vocab = 10
    uniform = torch.full((vocab,), -math.log(vocab))
    assert acceptance_rate(uniform, uniform).item() == pytest.approx(1.0)
    # Disjoint point masses: nothing in common.
    one_hot = lambda i: torch.log(torch.nn.functional.one_hot(torch.tensor(i), vocab).double().clamp(min=1e-300)).float()  # noqa: E731
    assert acceptance_rate(one_hot(0), one_hot(3)).item() == pytest.approx(0.0, abs=1e-12)
    # -inf log-probs (masked tokens) are fine.
    masked = torch.tensor([0.0, float("-inf"), float("-inf")])
    assert acceptance_rate(masked, torch.log(torch.tensor([0.5, 0.5, 0.0]))).item() == pytest.approx(0.5)


def test_alpha_metrics_tail_matches_numpy():
    # Random α over 6 rows with prompts of different lengths; bins of 8 cached positions. The 5th
    # percentile of each bin with at least 20 tokens, from numpy over the brute-force bin membership.
    generator = torch.Generator().manual_seed(0)
    alpha = torch.rand(6, 30, generator=generator, dtype=torch.float64)
    prompts, responses = torch.tensor([3, 5, 5, 9, 2, 4]), torch.tensor([30, 25, 17, 30, 9, 0])
    mask = torch.arange(30)[None, :] < responses[:, None]
    out = alpha_metrics(*alpha_points(alpha, mask, prompts), bin_size=8, quantile=0.05)
    by_bin: dict[int, list[float]] = {}
    for i in range(6):
        for t in range(int(responses[i])):
            by_bin.setdefault((int(prompts[i]) + t) // 8 * 8, []).append(alpha[i, t].item())
    expected = {start: float(np.quantile(np.array(v), 0.05)) for start, v in by_bin.items() if len(v) >= 20}
    assert expected and len(expected) < len(by_bin)  # some bins are too sparse to have a tail
    got = {int(k.rsplit("_", 1)[1]): v for k, v in out.items() if k.startswith("alpha_tail_len_")}
    assert got.keys() == expected.keys()
    for start, value in expected.items():
        assert got[start] == pytest.approx(value, abs=1e-6)
    assert out["alpha_tail"] == pytest.approx(min(expected.values()), abs=1e-6)
    assert out["alpha_tail_tokens"] == sum(len(by_bin[s]) for s in expected)


def test_alpha_metrics_bin_by_cached_length_by_hand():
    # Two rows: prompt lengths 2 and 4, responses of 3 and 2 tokens. Cached lengths at sampling:
    # row 0 -> 2, 3, 4; row 1 -> 4, 5. With bins of 3: [0,3) holds 0.9; [3,6) holds 0.5, 0.2, 0.7, 0.4.
    alpha = torch.tensor([[0.9, 0.5, 0.2], [0.7, 0.4, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = alpha_metrics(*alpha_points(alpha, mask, torch.tensor([2, 4])), bin_size=3, quantile=0.0)
    assert out["alpha_tail_len_0"] == pytest.approx(0.9) and out["alpha_tail_len_3"] == pytest.approx(0.2)
    assert out["alpha_tail"] == pytest.approx(0.2)
    assert out["alpha_mean"] == pytest.approx((0.9 + 0.5 + 0.2 + 0.7 + 0.4) / 5)
