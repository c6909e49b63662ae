"""Sparse-RL corrections checked against hand-worked numbers and a plain-Python float64 reference."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from sparserl.config.corrections import CorrectionConfig
from sparserl.learner.corrections import (
    Corrections,
    compute_corrections,
    rejection_by_length,
)

MODES = ("truncate", "clip", "mask", "none")
LEVELS = ("token", "sequence", "geometric")


# ----------------------------------------------------------------------------- reference
def _ref_quantile(sorted_vals: list[float], q: float) -> float:
    pos = q * (len(sorted_vals) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def reference(old, smp, mask, cfg: CorrectionConfig):
    """Independent float64 implementation with plain loops over nested lists.

    Returns (weights, keep, seq_keep, metrics). Positions outside the mask are never read.
    """
    B = len(mask)
    T = len(mask[0]) if B else 0
    lr = [[(old[i][t] - smp[i][t]) if mask[i][t] else 0.0 for t in range(T)] for i in range(B)]
    cl = [[min(max(lr[i][t], -20.0), 20.0) for t in range(T)] for i in range(B)]
    xi = [[math.exp(cl[i][t]) for t in range(T)] for i in range(B)]

    removed = {}  # filter -> set of (i, t) response tokens it removes on its own
    if cfg.veto_threshold is not None:
        name = "prefix_veto" if cfg.veto_scope == "prefix" else "veto"
        removed[name] = set()
        for i in range(B):
            hits = [t for t in range(T) if mask[i][t] and lr[i][t] < math.log(cfg.veto_threshold)]
            if hits:
                start = hits[0] if name == "prefix_veto" else 0
                removed[name] |= {(i, t) for t in range(start, T) if mask[i][t]}
    seq_stats = {"geo": [], "k3": [], "max_log": []}
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        n = max(len(toks), 1)
        seq_stats["geo"].append(math.exp(sum(cl[i][t] for t in toks) / n))
        seq_stats["k3"].append(sum(xi[i][t] - 1 - cl[i][t] for t in toks) / n)
        seq_stats["max_log"].append(max((abs(lr[i][t]) for t in toks), default=0.0))
    bounds = {"geo": cfg.seq_geo_bounds,
              "k3": None if cfg.seq_k3_max is None else (0.0, cfg.seq_k3_max),
              "max_log": None if cfg.seq_log_ratio_max is None else (0.0, cfg.seq_log_ratio_max)}
    for name, b in bounds.items():
        if b is not None:
            removed[name] = {(i, t) for i in range(B) for t in range(T) if mask[i][t]
                             and not (b[0] <= seq_stats[name][i] <= b[1])}
    in_band = [[True] * T for _ in range(B)]
    if cfg.band is not None:
        for i in range(B):
            for t in range(T):
                in_band[i][t] = cfg.band[0] <= xi[i][t] <= cfg.band[1]
        removed["band"] = {(i, t) for i in range(B) for t in range(T) if mask[i][t] and not in_band[i][t]}
    whole = set().union(*(removed[k] for k in ("veto", "geo", "k3", "max_log") if k in removed))
    seq_keep = [not any((i, t) in whole for t in range(T)) for i in range(B)]
    gone = set().union(*removed.values()) if removed else set()
    keep = [[1.0 if mask[i][t] and (i, t) not in gone else 0.0 for t in range(T)] for i in range(B)]

    weights = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = sum(1 for t in range(T) if mask[i][t])
        s = 0.0
        for t in range(T):
            if mask[i][t]:
                s += cl[i][t]
        for t in range(T):
            if not mask[i][t]:
                continue
            if cfg.is_level == "token":
                r = xi[i][t]
            elif cfg.is_level == "sequence":
                r = math.exp(min(max(s, -20.0), 20.0))
            else:
                r = math.exp(s / n)
            c = cfg.is_cap
            if cfg.is_mode == "truncate":
                w = min(r, c)
            elif cfg.is_mode == "clip":
                w = min(max(r, 1.0 / c), c)
            elif cfg.is_mode == "mask":
                w = r if r <= c else 0.0
            else:
                w = 1.0
            weights[i][t] = w

    resp = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]
    m = {"is_batch_norm_factor": 1.0}
    if cfg.batch_normalize and resp:
        mean = sum(weights[i][t] for i, t in resp) / len(resp)
        if mean > 0:
            weights = [[w / mean for w in row] for row in weights]
            m["is_batch_norm_factor"] = mean

    with_resp = [i for i in range(B) if any(mask[i])]
    for name, tokens in removed.items():
        m[f"applied_{name}_token_frac"] = len(tokens) / max(len(resp), 1)
        m[f"applied_{name}_seq_frac"] = len({i for i, _ in tokens}) / max(len(with_resp), 1)
    for name, values in seq_stats.items():
        ordered = sorted(values[i] for i in with_resp)
        for q in (0.05, 0.5, 0.95):
            if ordered:
                m[f"raw_seq_{name}_q{round(q * 100):02d}"] = _ref_quantile(ordered, q)
    if resp:
        xs = sorted(xi[i][t] for i, t in resp)
        m["xi_mean"] = sum(xs) / len(xs)
        m["xi_min"], m["xi_max"] = xs[0], xs[-1]
        for q, k in ((0.01, "xi_q01"), (0.05, "xi_q05"), (0.5, "xi_q50"), (0.95, "xi_q95"), (0.99, "xi_q99")):
            m[k] = _ref_quantile(xs, q)
        m["logppl_sampler"] = -sum(smp[i][t] for i, t in resp) / len(resp)
        m["logppl_old"] = -sum(old[i][t] for i, t in resp) / len(resp)
        m["kl_sampler_old"] = sum(smp[i][t] - old[i][t] for i, t in resp) / len(resp)
        m["kl_k3_sampler_old"] = sum(xi[i][t] - 1 - math.log(xi[i][t]) for i, t in resp) / len(resp)
    rejected = [i for i in with_resp if not seq_keep[i]]
    m["rejected_sequences"] = float(len(rejected))
    m["rejected_seq_frac"] = len(rejected) / len(with_resp) if with_resp else 0.0
    alive = [(i, t) for i, t in resp if seq_keep[i]]
    m["band_mask_frac"] = sum(1 for i, t in alive if not in_band[i][t]) / len(alive) if alive else 0.0
    kept = [(i, t) for i, t in resp if keep[i][t]]
    m["kept_token_frac"] = len(kept) / len(resp) if resp else 0.0
    if kept:
        wk = [weights[i][t] for i, t in kept]
        s1, s2 = sum(wk), sum(w * w for w in wk)
        m["ess"] = s1 * s1 / (len(wk) * s2) if s2 > 0 else 0.0
        m["weight_mean"] = s1 / len(wk)
        m["weight_max"] = max(wk)
    return weights, keep, seq_keep, m


def _check_against_reference(old: torch.Tensor, smp: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig):
    out = compute_corrections(old, smp, mask, cfg)
    w, k, sk, m = reference(old.tolist(), smp.tolist(), [[bool(v) for v in row] for row in mask.tolist()], cfg)
    torch.testing.assert_close(out.weights, torch.tensor(w, dtype=torch.float64), rtol=1e-6, atol=1e-12,
                               check_dtype=False)
    assert out.keep_mask.tolist() == k
    assert out.seq_keep.tolist() == sk
    for key, val in m.items():
        assert math.isclose(out.metrics[key], val, rel_tol=1e-6, abs_tol=1e-9), (key, out.metrics[key], val)
    assert all(math.isfinite(v) for v in out.metrics.values())
    return out


def _random_batch(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4
    lr = torch.randn(B, T, generator=g) * 0.4
    spikes = torch.rand(B, T, generator=g)
    lr = torch.where(spikes < 0.04, torch.full_like(lr, -12.0), lr)  # veto-triggering tokens
    lr = torch.where(spikes > 0.96, torch.full_like(lr, 3.0), lr)
    smp = old - lr
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return old, smp, mask


def _extreme_batch():
    """float64 so that log-ratios hit exact edge values (logp_sampler = 0, logp_old = log-ratio)."""
    L5, L15, LV = math.log(0.5), math.log(1.5), math.log(1e-4)
    nan, inf = float("nan"), float("inf")
    lr = [
        [50.0, -50.0, 0.0, 0.1, 0.0],  # vetoed by -50; +50 clamped to 20
        [L5, L15, L5 - 1e-9, L15 + 1e-9, 0.0],  # band edges: inclusive, just outside masked
        [LV, 0.0, 0.2, nan, nan],  # exactly at the veto threshold: kept; NaN padding ignored
        [nan, inf, -inf, 0.0, 0.0],  # all-masked row
        [50.0, 50.0, 30.0, 0.0, -0.3],  # huge positive ratios: no veto, band masks them
        [LV - 1e-9, 0.0, 0.0, 0.0, 0.0],  # just below the threshold: vetoed
        [-5.0, -5.0, -5.0, -5.0, -5.0],  # no veto, but the summed log-ratio -25 clamps to -20
    ]
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    old = torch.tensor(lr, dtype=torch.float64)
    smp = torch.zeros_like(old)
    smp[mask == 0] = -inf  # padding garbage must not leak into anything
    return old, smp, mask


# ----------------------------------------------------------------------------- tests
def test_hand_worked_example():
    # ξ per token; logp_sampler = log 0.5, logp_old = log(0.5 ξ) so that log-ratio = log ξ.
    xi = [[1.0, 2.0, 0.8], [1.25, 1e-5, 1.0], [0.4, 1.0, 1.0]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    smp = torch.full((3, 3), math.log(0.5), dtype=torch.float64)
    old = torch.tensor([[math.log(0.5 * x) for x in row] for row in xi], dtype=torch.float64)
    out = compute_corrections(old, smp, mask, CorrectionConfig())
    # seq 1 has ξ = 1e-5 < 1e-4: vetoed. Band [0.5, 1.5] drops ξ = 2.0 (seq 0) and ξ = 0.4 (seq 2).
    assert out.keep_mask.tolist() == [[1, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert out.seq_keep.tolist() == [True, False, True]
    # truncate at 1.5: [1.0, 1.5, 0.8], [1.25, 1e-5], [0.4]; sum = 4.95001 over 6 response tokens,
    # mean = 0.825001666..., weights = truncated / mean, e.g. 1.0 / 0.8250016667 = 1.2121187634.
    expected = [[1.2121187633964376, 1.8181781450946564, 0.9696950107171501],
                [1.5151484542455471, 1.2121187633964377e-05, 0.0],
                [0.48484750535857507, 0.0, 0.0]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-15)
    m = out.metrics
    assert m["rejected_sequences"] == 1 and m["rejected_seq_frac"] == pytest.approx(1 / 3)
    assert m["band_mask_frac"] == pytest.approx(2 / 4)  # 2 of the 4 response tokens of seqs 0 and 2
    assert m["kept_token_frac"] == pytest.approx(2 / 6)
    assert m["ess"] == pytest.approx(1.8**2 / (2 * (1.0**2 + 0.8**2)))  # kept ξ 1.0, 0.8 = 0.98780
    assert m["xi_min"] == pytest.approx(1e-5) and m["xi_max"] == pytest.approx(2.0)
    assert m["xi_mean"] == pytest.approx((1.0 + 2.0 + 0.8 + 1.25 + 1e-5 + 0.4) / 6)
    assert m["logppl_sampler"] == pytest.approx(-math.log(0.5))


@pytest.mark.parametrize("mode,level,bn", list(itertools.product(MODES, LEVELS, (True, False))))
def test_matches_reference_random(mode, level, bn):
    cfg = CorrectionConfig(is_mode=mode, is_level=level, batch_normalize=bn)
    for seed in range(3):
        out = _check_against_reference(*_random_batch(seed), cfg)
        assert out.weights.dtype == torch.float32


@pytest.mark.parametrize("mode,level,bn", list(itertools.product(MODES, LEVELS, (True, False))))
def test_matches_reference_extreme(mode, level, bn):
    cfg = CorrectionConfig(is_mode=mode, is_level=level, batch_normalize=bn)
    out = _check_against_reference(*_extreme_batch(), cfg)
    assert torch.isfinite(out.weights).all()
    assert out.keep_mask[1].tolist() == [1, 1, 0, 0, 1]  # band edges inclusive
    assert out.seq_keep.tolist() == [False, True, True, True, True, False, True]


@pytest.mark.parametrize("cfg", [
    CorrectionConfig(veto_threshold=None, band=None),
    CorrectionConfig(veto_threshold=1e-2, band=(0.8, 1.2), is_cap=2.0, is_mode="clip"),
    CorrectionConfig(band=(0.0, 10.0), is_cap=0.9, is_mode="mask", is_level="geometric"),
])
def test_matches_reference_other_configs(cfg):
    _check_against_reference(*_random_batch(7), cfg)
    _check_against_reference(*_extreme_batch(), cfg)


def test_quantiles_match_torch_quantile():
    old, smp, mask = _random_batch(3, B=8, T=20)
    m = compute_corrections(old, smp, mask, CorrectionConfig()).metrics
    xi = (old.double() - smp.double()).clamp(-20, 20).exp()[mask.bool()]
    for q, k in ((0.01, "xi_q01"), (0.05, "xi_q05"), (0.5, "xi_q50"), (0.95, "xi_q95"), (0.99, "xi_q99")):
        assert m[k] == pytest.approx(torch.quantile(xi, q).item(), rel=1e-9)


def test_veto_counts_vetoed_not_kept():
    old = torch.zeros(5, 4)
    smp = torch.zeros(5, 4)
    smp[0, 1] = smp[2, 3] = smp[4, 0] = 15.0  # log-ratio -15 < log(1e-4) ≈ -9.21
    mask = torch.ones(5, 4)
    out = compute_corrections(old, smp, mask, CorrectionConfig())
    assert out.metrics["rejected_seq_frac"] == pytest.approx(0.6)
    assert out.metrics["rejected_sequences"] == 3
    assert out.seq_keep.tolist() == [False, True, False, True, False]
    # A row without response tokens can't be vetoed and does not enter the denominator.
    pad = lambda x: torch.cat([x, torch.zeros(1, 4)])  # noqa: E731
    out2 = compute_corrections(pad(old), pad(smp), pad(mask), CorrectionConfig())
    assert out2.metrics["rejected_seq_frac"] == pytest.approx(0.6) and out2.seq_keep[-1]


def test_everything_vetoed():
    old = torch.zeros(3, 4)
    smp = torch.full((3, 4), 30.0)
    mask = torch.ones(3, 4)
    out = compute_corrections(old, smp, mask, CorrectionConfig())
    assert out.keep_mask.sum() == 0
    assert not out.seq_keep.any()
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["rejected_seq_frac"] == 1.0 and out.metrics["ess"] == 1.0
    assert torch.isfinite(out.weights).all()


@pytest.mark.parametrize("shape", [(3, 5), (0, 5), (2, 0)])
@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "sequence"), ("none", "geometric")])
def test_zero_response_tokens(shape, mode, level):
    z = torch.zeros(shape)
    out = compute_corrections(z, z, z, CorrectionConfig(is_mode=mode, is_level=level))
    assert out.weights.shape == shape and out.keep_mask.shape == shape and out.seq_keep.shape == shape[:1]
    assert out.weights.sum() == 0 and out.keep_mask.sum() == 0
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["rejected_seq_frac"] == 0.0 and out.metrics["kept_token_frac"] == 0.0


def test_everything_band_rejected_and_mask_mode_zero_weights():
    # All ξ = e^3 > cap: mask mode zeroes every weight, the mean is 0, weights stay 0, no NaN.
    old, smp, mask = torch.zeros(2, 3), torch.full((2, 3), -3.0), torch.ones(2, 3)
    out = compute_corrections(old, smp, mask, CorrectionConfig(is_mode="mask"))
    assert out.weights.sum() == 0 and out.keep_mask.sum() == 0
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_none_mode_gives_ones_on_response():
    old, smp, mask = _random_batch(1)
    out = compute_corrections(old, smp, mask, CorrectionConfig(is_mode="none"))
    assert torch.equal(out.weights, mask)


def test_weights_detached_and_mask_types():
    old, smp, mask = _random_batch(2)
    old.requires_grad_(True)
    smp.requires_grad_(True)
    out = compute_corrections(old, smp, mask, CorrectionConfig())
    assert not out.weights.requires_grad and not out.keep_mask.requires_grad
    out_bool = compute_corrections(old, smp, mask.bool(), CorrectionConfig())
    assert torch.equal(out.weights, out_bool.weights) and torch.equal(out.keep_mask, out_bool.keep_mask)
    assert out.keep_mask.dtype == torch.float32
    assert isinstance(out, Corrections)


@pytest.mark.parametrize("kwargs,name", [
    (dict(band=(1.5, 0.5)), "band"),
    (dict(band=(-0.1, 1.5)), "band"),
    (dict(is_cap=0.0), "is_cap"),
    (dict(is_cap=-1.0), "is_cap"),
    (dict(is_mode="clip", is_cap=0.5), "is_cap"),
    (dict(is_mode="bogus"), "is_mode"),
    (dict(is_level="bogus"), "is_level"),
    (dict(veto_threshold=0.0), "veto_threshold"),
])
def test_config_validation_names_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CorrectionConfig(**kwargs)


def test_config_defaults():
    c = CorrectionConfig()
    assert (c.veto_threshold, c.band, c.is_mode, c.is_cap, c.is_level, c.batch_normalize) == (
        1e-4, (0.5, 1.5), "truncate", 1.5, "token", True)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        compute_corrections(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), CorrectionConfig())


def test_rejection_by_length():
    lengths = torch.tensor([10, 70, 100, 90, 600, 0, 30])
    seq_keep = torch.tensor([False, True, False, True, False, True, True])
    out = rejection_by_length(lengths, seq_keep, [64, 128, 256, 512])
    # [0,64): 10 vetoed, 30 kept (length 0 not counted) -> 1/2; [64,128): 1 of 3; [512,inf): 1 of 1.
    assert out == {"veto_frac_len_0_64": 0.5, "veto_frac_len_64_128": pytest.approx(1 / 3),
                   "veto_frac_len_512_inf": 1.0}
    with pytest.raises(ValueError, match="positive and non-decreasing"):
        rejection_by_length(lengths, seq_keep, [64, 32])
    with pytest.raises(ValueError, match="positive and non-decreasing"):
        rejection_by_length(lengths, seq_keep, [0, 64])


def test_the_shortest_quarter_of_responses_has_its_bucket():
    # The trainer's boundaries for a response bound of 84 tokens: the quarters 21, 42, 63.
    lengths = torch.tensor([1, 20, 20, 21, 41, 42, 50, 62, 63, 84, 0])
    seq_keep = torch.tensor([False, True, True, False, True, True, True, False, False, False, False])
    # 1-20: 1 of 3 vetoed; 21-41: 1 of 2; 42-62: 1 of 3; 63-84: 2 of 2; the empty row is not counted.
    assert rejection_by_length(lengths, seq_keep, [21, 42, 63]) == {
        "veto_frac_len_0_21": pytest.approx(1 / 3), "veto_frac_len_21_42": 0.5,
        "veto_frac_len_42_63": pytest.approx(1 / 3), "veto_frac_len_63_inf": 1.0}


def test_every_response_length_falls_in_exactly_one_bucket():
    from sparserl.train.step_batch import length_edges

    for bound in (1, 2, 3, 7, 84):
        boundaries = length_edges(bound)
        for length in range(1, bound + 1):
            # One vetoed row of this length: exactly one bucket, the one whose [lo, hi) holds it.
            out = rejection_by_length(torch.tensor([length]), torch.tensor([False]), boundaries)
            assert list(out.values()) == [1.0], (bound, length, out)
            lo, hi = next(iter(out)).split("_")[-2:]
            assert int(lo) <= length < (math.inf if hi == "inf" else int(hi)), (bound, length, out)
    assert len(rejection_by_length(torch.arange(1, 85), torch.ones(84, dtype=torch.bool),
                                   length_edges(84))) == 4


def test_random_fuzz_against_reference():
    rng = random.Random(0)
    for seed in range(5):
        cfg = CorrectionConfig(is_mode=rng.choice(MODES), is_level=rng.choice(LEVELS),
                               batch_normalize=rng.random() < 0.5)
        _check_against_reference(*_random_batch(100 + seed, B=rng.randint(1, 5), T=rng.randint(1, 12)), cfg)


FILTER_CONFIGS = [
    CorrectionConfig.geo_rs(), CorrectionConfig.k3_rs(), CorrectionConfig.seq_mask_tis(),
    CorrectionConfig.prefix_veto_tis(), CorrectionConfig.sparse_rs(), CorrectionConfig.sparse_tis(),
    CorrectionConfig(veto_threshold=None, band=None, seq_log_ratio_max=2.5, is_mode="none"),
    CorrectionConfig(veto_threshold=1e-3, veto_scope="prefix", band=(0.6, 1.8), seq_geo_bounds=(0.9, 1.1),
                     seq_k3_max=0.1, seq_log_ratio_max=4.0, is_level="geometric"),
    CorrectionConfig(band=None, seq_geo_bounds=(0.97, 1.03), is_mode="clip", is_cap=2.0),
]


@pytest.mark.parametrize("cfg", FILTER_CONFIGS, ids=lambda c: repr(c)[17:80])
def test_filters_match_brute_force(cfg):
    for seed in range(4):
        _check_against_reference(*_random_batch(200 + seed, B=8, T=11), cfg)
    _check_against_reference(*_extreme_batch(), cfg)


def test_prefix_veto_hand_worked():
    # log ξ per token; -12 < log 1e-4 ≈ -9.21 trips the veto.
    lr = [[0.1, -12.0, 0.2, 0.0],   # cut from token 1: tokens 0 kept, 1..3 masked
          [0.0, 0.0, 0.0, -12.0],   # only the last token masked
          [-12.0, 0.0, 0.0, 0.0],   # everything masked, like a sequence veto
          [0.0, 0.0, 0.0, 0.0]]
    old = torch.tensor(lr, dtype=torch.float64)
    out = compute_corrections(old, torch.zeros_like(old), torch.ones_like(old),
                              CorrectionConfig(veto_threshold=1e-4, veto_scope="prefix", band=None, is_mode="none",
                                               batch_normalize=False))
    assert out.keep_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert out.seq_keep.tolist() == [True, True, True, True]  # a prefix veto removes no sequence whole
    assert out.metrics["applied_prefix_veto_token_frac"] == pytest.approx(8 / 16)
    assert out.metrics["applied_prefix_veto_seq_frac"] == pytest.approx(3 / 4)
    sequence = compute_corrections(old, torch.zeros_like(old), torch.ones_like(old),
                                   CorrectionConfig(band=None, is_mode="none", batch_normalize=False))
    assert sequence.keep_mask.sum() == 4 and sequence.metrics["applied_veto_token_frac"] == pytest.approx(12 / 16)


def test_sequence_filters_hand_worked():
    # Two sequences of 2 tokens: log ξ (0.2, -0.2) has geometric mean 1 but k3 and max |log ξ| > 0;
    # (0.3, 0.3) has geometric mean e^0.3 = 1.35.
    old = torch.tensor([[0.2, -0.2], [0.3, 0.3]], dtype=torch.float64)
    smp, mask = torch.zeros_like(old), torch.ones_like(old)
    base = dict(veto_threshold=None, band=None, is_mode="none", batch_normalize=False)
    geo = compute_corrections(old, smp, mask, CorrectionConfig(**base, seq_geo_bounds=(0.9, 1.1)))
    assert geo.seq_keep.tolist() == [True, False]
    k3_first = (math.exp(0.2) - 1.2 + math.exp(-0.2) - 0.8) / 2  # 0.02013
    k3_second = math.exp(0.3) - 1.3  # 0.04986
    k3 = compute_corrections(old, smp, mask, CorrectionConfig(**base, seq_k3_max=0.03))
    assert k3.seq_keep.tolist() == [True, False] and k3_first < 0.03 < k3_second
    maxlog = compute_corrections(old, smp, mask, CorrectionConfig(**base, seq_log_ratio_max=0.25))
    assert maxlog.seq_keep.tolist() == [True, False]
    assert geo.metrics["raw_seq_k3_q05"] == pytest.approx(k3_first + 0.05 * (k3_second - k3_first))


def test_random_filter_fuzz_against_reference():
    rng = random.Random(1)
    maybe = lambda value: value if rng.random() < 0.5 else None  # noqa: E731
    for seed in range(12):
        low = rng.uniform(0.5, 1.0)
        cfg = CorrectionConfig(veto_threshold=maybe(10 ** rng.uniform(-6, -1)), veto_scope=rng.choice(("sequence", "prefix")),
                               band=maybe((low, rng.uniform(1.0, 2.0))), seq_geo_bounds=maybe((low, 1 / low)),
                               seq_k3_max=maybe(rng.uniform(0, 0.5)), seq_log_ratio_max=maybe(rng.uniform(0.5, 10)),
                               is_mode=rng.choice(MODES), is_level=rng.choice(LEVELS), batch_normalize=rng.random() < 0.5)
        _check_against_reference(*_random_batch(300 + seed, B=rng.randint(1, 7), T=rng.randint(1, 12)), cfg)


@pytest.mark.parametrize("level", LEVELS)
def test_batch_normalisation_over_several_processes_is_the_whole_batchs(level):
    """A batch split between two processes, each normalising with `batch_total` summing both parts' totals (what
    `accelerator.reduce` does): each part's weights are the whole batch's rows, as one process holding it all gets
    them; normalising each part alone is not (the check compares something)."""
    cfg = CorrectionConfig(is_level=level, batch_normalize=True)
    old, smp, mask = _random_batch(11, B=8)
    whole = compute_corrections(old, smp, mask, cfg)
    parts = [slice(0, 3), slice(3, 8)]
    unnormalised = CorrectionConfig(is_level=level, batch_normalize=False)
    totals = [torch.stack([compute_corrections(old[p], smp[p], mask[p], unnormalised).weights.double().sum(),
                           mask[p].double().sum()]) for p in parts]
    for index, part in enumerate(parts):
        other = totals[1 - index]
        shared = compute_corrections(old[part], smp[part], mask[part], cfg, batch_total=lambda t: t + other)
        torch.testing.assert_close(shared.weights, whole.weights[part], rtol=1e-6, atol=1e-12)
        alone = compute_corrections(old[part], smp[part], mask[part], cfg)
        assert not torch.allclose(alone.weights, whole.weights[part], rtol=1e-3)
