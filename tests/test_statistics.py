"""The statistics behind the verdicts, against closed forms, hand-worked examples, values computed independently
(mpmath's regularized incomplete beta at 40 digits, G*Power's exact noncentral-t sample sizes) and the audit's
figures for the counted-progression study (FINDINGS.md §2, issue 54)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparserl.report.paired import rule_sentence
from sparserl.report.statistics import (
    binomial_standard_error,
    paired_difference,
    paired_t,
    ratio_of_baseline,
    regularized_incomplete_beta,
    seeds_needed,
    sparse_rl_vs_naive_rule,
    student_t_cdf,
    student_t_quantile,
    verdict,
)

# Step 28 of the counted-progression study, held-out accuracy (points) per seed 0, 1, 2.
DENSE = [46.5, 58.5, 46.5]
NAIVE = [48.5, 54.0, 47.5]
GEO_RS = [35.5, 51.5, 47.0]
SPARSE_RL = [31.0, 12.5, 53.0]


def _df2_two_sided_p(t: float) -> float:
    """Student's t with 2 df in closed form: P(|T| > |t|) = 1 − |t| / √(2 + t²)."""
    return 1.0 - abs(t) / math.sqrt(2.0 + t * t)


@pytest.mark.parametrize("x, a, b, expected", [
    (0.3, 1.0, 1.0, 0.3),                       # uniform
    (0.3, 4.0, 1.0, 0.3 ** 4),                  # I_x(a, 1) = x^a
    (0.3, 1.0, 5.0, 1.0 - 0.7 ** 5),            # I_x(1, b) = 1 − (1 − x)^b
    (0.9, 2.5, 0.5, 0.48958974456442755456),    # mpmath; x above (a + 1) / (a + b + 2): the symmetric branch
    (0.2, 3.0, 7.5, 0.29190446089640454836),    # mpmath; the direct branch
])
def test_incomplete_beta(x, a, b, expected):
    assert regularized_incomplete_beta(x, a, b) == pytest.approx(expected, rel=1e-12)


def test_t_cdf_against_closed_forms_and_mpmath():
    for t in (-30.0, -2.0, -0.3, 0.0, 0.7, 4.0, 50.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    assert student_t_cdf(1.0, 3) == pytest.approx(0.8044988905221146790, rel=1e-12)
    assert student_t_cdf(-2.5, 30) == pytest.approx(0.0090578245340333449, rel=1e-10)
    assert student_t_cdf(math.inf, 4) == 1.0 and student_t_cdf(-math.inf, 4) == 0.0


@pytest.mark.parametrize("probability, df, expected", [
    (0.975, 1, math.tan(math.pi * 0.475)),
    (0.975, 2, 0.95 / math.sqrt(2 * 0.975 * 0.025)),  # df 2: t = (2p − 1) / √(2p(1 − p))
    (0.95, 2, 0.9 / math.sqrt(2 * 0.95 * 0.05)),
    (0.975, 8, 2.3060041352041661143),  # mpmath
    (0.95, 8, 1.8595480375308978117),
    (0.975, 9, 2.2621571627982049992),
    (0.975, 30, 2.0422724563012378878),
    (0.025, 8, -2.3060041352041661143),
])
def test_t_quantiles(probability, df, expected):
    assert student_t_quantile(probability, df) == pytest.approx(expected, rel=1e-10)


def test_the_audits_paired_differences_against_dense():
    naive = paired_difference(NAIVE, DENSE)
    assert naive.differences == pytest.approx((2.0, -4.5, 1.0))
    # By hand: mean −0.5; deviations 2.5, −4, 1.5 → s² = 24.5 / 2, s = 3.5; t = −0.5 / (3.5 / √3).
    assert naive.estimate == pytest.approx(-0.5) and naive.spread == pytest.approx(3.5)
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * 3.5 / math.sqrt(3)
    assert (naive.low, naive.high) == pytest.approx((-0.5 - half, -0.5 + half))
    t = -0.5 / (3.5 / math.sqrt(3))
    assert naive.p_two_sided == pytest.approx(_df2_two_sided_p(t), rel=1e-10)
    assert naive.p_below == pytest.approx(_df2_two_sided_p(t) / 2) and naive.p_above == pytest.approx(
        1 - _df2_two_sided_p(t) / 2)
    # The audit's table: p 0.83, 0.23, 0.35; between modes 0.30 and 0.32.
    for mode, baseline, audit in ((NAIVE, DENSE, 0.83), (GEO_RS, DENSE, 0.23), (SPARSE_RL, DENSE, 0.35),
                                  (NAIVE, GEO_RS, 0.30), (NAIVE, SPARSE_RL, 0.32)):
        assert round(paired_difference(mode, baseline).p_two_sided, 2) == audit
    assert paired_difference(GEO_RS, DENSE).differences == pytest.approx((-11.0, -7.0, 0.5))


def test_the_audits_of_dense_intervals():
    # The audit: naive-sparse 99% of dense, approx. 95% CI 82-116%; geo-rs 88%, 60-117%.
    naive, geo = ratio_of_baseline(NAIVE, DENSE), ratio_of_baseline(GEO_RS, DENSE)
    assert naive.estimate == pytest.approx(150.0 / 151.5) and geo.estimate == pytest.approx(134.0 / 151.5)
    assert (round(100 * naive.low), round(100 * naive.high)) == (82, 116)
    assert (round(100 * geo.low), round(100 * geo.high)) == (60, 117)
    # Sparse-RL: 64% of dense; the audit's "wider than 0-190%" scaled the difference's interval by dense's mean
    # (1 + (−18.3 ± 65.5) / 50.5: −66% to 193%); the delta method's residuals spread a little less. By hand:
    # R = 96.5 / 151.5 = 0.637; residuals 31 − 46.5R = 1.38, 12.5 − 58.5R = −24.76, 53 − 46.5R = 23.38;
    # s = 24.10; R ± 4.3027 · 24.10 / (√3 · 50.5) = 0.637 ± 1.185: −55% to 182%.
    rl = ratio_of_baseline(SPARSE_RL, DENSE)
    assert round(100 * rl.estimate) == 64 and (round(100 * rl.low), round(100 * rl.high)) == (-55, 182)


def test_one_seed_gives_no_interval_and_no_verdict_word():
    one = paired_t([4.0])
    assert one.estimate == 4.0 and one.n == 1
    assert (one.spread, one.low, one.high, one.p_two_sided, one.p_below) == (None, None, None, None, None)
    ratio = ratio_of_baseline([0.5], [0.4])
    assert ratio.estimate == pytest.approx(1.25) and ratio.low is None and ratio.spread is None
    for estimate in (one, ratio):
        assert verdict(estimate, 0.0) == "not distinguishable at 1 seed (one seed gives no interval)"
    assert seeds_needed(None, 5.0) is None
    assert sparse_rl_vs_naive_rule([-30.0]) == "inconclusive"


def test_no_seed_and_unpaired_seeds_are_refused():
    with pytest.raises(ValueError, match="at least one seed"):
        paired_t([])
    with pytest.raises(ValueError, match="one baseline value per seed: 2 against 3"):
        paired_difference([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="baseline mean other than 0"):
        ratio_of_baseline([0.1, 0.2], [0.0, 0.0])


def test_identical_differences_have_a_point_interval():
    same = paired_t([2.0, 2.0, 2.0])
    assert (same.low, same.high, same.p_two_sided) == (2.0, 2.0, 0.0)
    assert paired_t([0.0, 0.0]).p_two_sided == 1.0
    assert seeds_needed(0.0, 5.0) == 2


def test_binomial_standard_error():
    assert binomial_standard_error(0.5, 200) == pytest.approx(math.sqrt(0.25 / 200))  # 3.5 points
    assert binomial_standard_error(0.465, 200) == pytest.approx(math.sqrt(0.465 * 0.535 / 200))
    assert binomial_standard_error(0.0, 40) == 0.0
    with pytest.raises(ValueError, match="0 <= accuracy <= 1"):
        binomial_standard_error(46.5, 200)


def test_seeds_needed_matches_the_exact_noncentral_t_answers():
    # The exact noncentral-t powers (mpmath quadrature), two-sided 5%: effect size 0.5 → 0.795 at 33 pairs, 0.808 at
    # 34; effect size 1 → 0.748 at 9, 0.803 at 10. So the fewest seeds for 80% are 34 and 10.
    assert seeds_needed(1.0, 0.5) == 34 and seeds_needed(3.5, 1.75) == 34
    assert seeds_needed(2.0, 2.0) == 10 and seeds_needed(2.0, -2.0) == 10
    assert seeds_needed(1.0, 0.0) is None
    with pytest.raises(ValueError, match="0.5 <= power < 1"):
        seeds_needed(1.0, 1.0, power=0.3)


def test_seeds_needed_gives_80_percent_power_by_simulation():
    """At d = 1 a two-sided t-test on 10 seeds rejects 80.3% of the time, on 8 seeds 68.1% (noncentral t by
    mpmath quadrature; the critical t from mpmath too): simulated here."""
    generator = np.random.default_rng(0)
    for seeds, critical, expected in ((10, 2.2621571627982049992, 0.8031), (8, 2.3646242515927847379, 0.6808)):
        draws = generator.normal(1.0, 1.0, size=(40000, seeds))
        t = draws.mean(axis=1) / (draws.std(axis=1, ddof=1) / math.sqrt(seeds))
        assert np.mean(np.abs(t) > critical) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("differences, alternative, expected", [
    ([1.0, 2.0, 1.5, 2.5], -5.0, "keeps up"),       # interval about [0.6, 2.9], above −5
    ([-9.0, -8.0, -10.0, -9.5], -5.0, "falls"),     # about [−10.2, −8.1], below −5
    ([2.0, -4.5, 1.0], -5.0, None),                 # −9.2 to +8.2 covers −5
    ([-5.0, -5.0], -5.0, None),                     # a point interval on the alternative
])
def test_a_verdict_word_only_where_the_interval_excludes_the_alternative(differences, alternative, expected):
    found = paired_t(differences)
    text = verdict(found, alternative)
    if expected is None:
        assert found.low <= alternative <= found.high
        assert text.startswith(f"not distinguishable at {len(differences)} seeds")
        assert "keeps up" not in text and "falls" not in text
    else:
        assert text == expected
        assert not found.low <= alternative <= found.high


def test_an_indistinct_verdict_names_the_seeds_the_observed_gap_needs():
    # geo-rs − dense: mean −5.83, s 5.84; against 0 the gap 5.83 at that spread needs ~10 seeds (effect size ≈ 1).
    text = verdict(paired_difference(GEO_RS, DENSE), 0.0, "ahead", "behind")
    assert text == "not distinguishable at 3 seeds (about 10 needed)"


@pytest.mark.parametrize("differences, outcome", [
    ([-10.0, -8.0, -12.0, -9.0, -11.0, -10.0, -9.0, -11.0, -10.0], "hurts"),
    ([-5.5, -5.4, -5.6, -5.5, -5.5, -5.4, -5.6, -5.5, -5.5], "hurts"),  # also within ±7: "hurts" is decided first
    ([1.0, -1.0, 2.0, 0.0, -2.0, 1.0, 0.0, -1.0, 0.0], "no detectable harm"),
    ([-17.5, -41.5, 5.5], "inconclusive"),  # the study's Sparse-RL − naive at step 28
    ([-6.0, 4.0, -20.0, 8.0, -12.0, 3.0, -9.0, -1.0, -15.0], "inconclusive"),  # mean −5.3, p 0.06
])
def test_the_nine_seed_rule(differences, outcome):
    found = paired_t(differences, 0.90)
    if outcome == "hurts":
        assert found.estimate <= -5 and found.p_below < 0.05
    if outcome == "no detectable harm":
        assert -7 <= found.low and found.high <= 7
    assert sparse_rl_vs_naive_rule(differences) == outcome


def test_the_rule_reads_as_a_verdict_only_at_nine_seeds():
    six = [-11.0, -29.5, 3.0, -2.0, -20.5, -25.5]  # the study's D at step 14, seeds 0-5
    # mean −85.5 / 6 = −14.25: "hurts" by the rule's figures, but six seeds are not the nine it was set for.
    assert rule_sentence(six).startswith(
        "interim, 6 of the 9 seeds the rule is for (no verdict before 9): it would read **hurts** on 6 seed(s) "
        "(mean D -14.2 points")
    nine = [-10.0, -8.0, -12.0, -9.0, -11.0, -10.0, -9.0, -11.0, -10.0]
    assert rule_sentence(nine).startswith("**hurts** on 9 seed(s) (mean D -10.0 points")


def test_the_rule_is_inconclusive_on_a_mean_loss_without_significance():
    differences = [-6.0, 4.0, -20.0, 8.0, -12.0, 3.0, -9.0, -1.0, -15.0]
    found = paired_t(differences, 0.90)
    # mean −48/9; s by hand from the sum of squares.
    mean = -48 / 9
    s = math.sqrt(sum((d - mean) ** 2 for d in differences) / 8)
    assert found.estimate == pytest.approx(mean) and found.spread == pytest.approx(s)
    assert found.p_below > 0.05 and found.low < -7
