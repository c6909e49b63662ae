"""Acceptance rate and its tail against float64 brute force (loops over the vocabulary, numpy quantiles)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparserl.mismatch import acceptance_rate, alpha_metrics, alpha_points, tail_statistic


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


def test_tail_statistic_matches_numpy():
    generator = torch.Generator().manual_seed(0)
    alpha = torch.rand(5, 23, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([23, 17, 9, 1, 0])
    mask = torch.arange(23)[None, :] < lengths[:, None]
    got = tail_statistic(alpha, mask, bin_size=8, quantile=0.05)
    assert got.shape == (3,)
    for b in range(3):
        values = [alpha[i, t].item() for i in range(5) for t in range(8 * b, min(8 * b + 8, 23)) if mask[i, t]]
        assert got[b].item() == pytest.approx(float(np.quantile(np.array(values), 0.05)), abs=1e-6)


def test_tail_statistic_empty_bins_are_nan():
    alpha = torch.ones(2, 10)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, :3] = True
    got = tail_statistic(alpha, mask, bin_size=4, quantile=0.5)
    assert got[0].item() == 1.0 and math.isnan(got[1].item()) and math.isnan(got[2].item())
    with pytest.raises(ValueError):
        tail_statistic(alpha, mask[:, :5], bin_size=4)


def test_alpha_metrics_bin_by_cached_length_by_hand():
    # Two rows: prompt lengths 2 and 4, responses of 3 and 2 tokens. Cached lengths at sampling:
    # row 0 -> 2, 3, 4; row 1 -> 4, 5. With bins of 3: [0,3) holds 0.9; [3,6) holds 0.5, 0.2, 0.7, 0.4.
    alpha = torch.tensor([[0.9, 0.5, 0.2], [0.7, 0.4, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = alpha_metrics(*alpha_points(alpha, mask, torch.tensor([2, 4])), bin_size=3, quantile=0.0)
    assert out["alpha_tail_len_0"] == pytest.approx(0.9) and out["alpha_tail_len_3"] == pytest.approx(0.2)
    assert out["alpha_tail"] == pytest.approx(0.2)
    assert out["alpha_mean"] == pytest.approx((0.9 + 0.5 + 0.2 + 0.7 + 0.4) / 5)
