"""Statistics over seeds behind every verdict the project states: paired differences (mode − baseline, one pair per
seed) with Student-t intervals and p-values, the ratio "of dense" with a delta-method interval, the binomial standard
error of one held-out figure, the seeds a gap needs, and the verdict words that only an interval excluding the
alternative may carry.

Pure functions in float64 with no dependency beyond the standard library: the Student-t distribution is computed
here (its CDF through the regularized incomplete beta function, its quantile by bisection on the CDF). Units are the
caller's: the report passes accuracies in points (100 × the fraction) wherever a threshold is in points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

HURT_POINTS = 5.0        # the nine-seed rule: "hurts" if the mean D <= −5 points with one-sided paired p < 0.05
HARM_BOUND_POINTS = 7.0  # ... "no detectable harm" if the 90% interval of D lies within ±7 points
RULE_P = 0.05
RULE_LEVEL = 0.90
RULE_SEEDS = 9  # the seeds the rule was set for: with fewer its reading is interim, not a verdict


# ---------------------------------------------------------------------------------- Student's t
def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging fast for x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return fraction


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 <= x <= 1 and a, b > 0 (the CDF of a Beta(a, b) variable at x)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"the incomplete beta function needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(x, a, b) / a
    return 1.0 - front * _beta_continued_fraction(1.0 - x, b, a) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"Student's t needs df > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(probability: float, df: float) -> float:
    """The t with P(T <= t) = `probability` (0 < probability < 1), by bisection on `student_t_cdf` to 1e-12."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"a quantile needs 0 < probability < 1, got {probability}")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < probability:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if student_t_cdf(middle, df) < probability else (low, middle)
    return 0.5 * (low + high)


# ---------------------------------------------------------------------------------- estimates over seeds
@dataclass(frozen=True)
class PairedDifference:
    """Paired differences over seeds and their paired t statistics (df = n − 1). With n < 2 there is no spread:
    `spread`, `low`, `high` and the p-values are None."""

    differences: tuple[float, ...]  # mode − baseline, one per seed
    estimate: float                 # their mean
    spread: float | None            # their sample standard deviation (n − 1 in the denominator)
    low: float | None               # the two-sided t-interval at `level`
    high: float | None
    level: float
    p_two_sided: float | None       # H0: the mean difference is 0
    p_below: float | None           # one-sided, against the alternative "the mean difference is below 0"
    p_above: float | None           # one-sided, against "above 0"

    @property
    def n(self) -> int:
        return len(self.differences)


@dataclass(frozen=True)
class RatioOfBaseline:
    """The mean of the mode over the mean of the baseline ("of dense") with a delta-method interval at `level`:
    the per-seed residuals e_i = mode_i − ratio · baseline_i have standard deviation s, and the ratio's standard
    error is s / (√n · mean(baseline)), taken with Student's t at df = n − 1. With n < 2: `spread`, `low` and
    `high` are None."""

    estimate: float
    spread: float | None  # s / mean(baseline): a per-seed spread in the ratio's units
    low: float | None
    high: float | None
    level: float
    n: int


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _sample_sd(values: Sequence[float]) -> float:
    centre = _mean(values)
    return math.sqrt(math.fsum((v - centre) ** 2 for v in values) / (len(values) - 1))


def _pairs(mode: Sequence[float], baseline: Sequence[float]) -> None:
    if len(mode) != len(baseline):
        raise ValueError(f"paired statistics need one baseline value per seed: {len(mode)} against {len(baseline)}")
    if not mode:
        raise ValueError("paired statistics need at least one seed with both values")


def paired_t(differences: Sequence[float], level: float = 0.95) -> PairedDifference:
    """Mean, two-sided t-interval at `level` and paired-t p-values of per-seed differences. A zero spread (every
    seed the same difference) gives the interval [mean, mean] and p = 0 (or 1 when the mean is 0 too)."""
    if not differences:
        raise ValueError("paired statistics need at least one seed with both values")
    values = tuple(float(d) for d in differences)
    centre = _mean(values)
    if len(values) < 2:
        return PairedDifference(values, centre, None, None, None, level, None, None, None)
    spread = _sample_sd(values)
    error = spread / math.sqrt(len(values))
    df = len(values) - 1
    half = student_t_quantile(0.5 + level / 2.0, df) * error
    if error == 0.0:
        t = 0.0 if centre == 0.0 else math.copysign(math.inf, centre)
    else:
        t = centre / error
    below = student_t_cdf(t, df)
    p_two_sided = 1.0 if t == 0.0 else min(1.0, 2.0 * min(below, 1.0 - below))
    return PairedDifference(values, centre, spread, centre - half, centre + half, level, p_two_sided, below,
                            1.0 - below)


def paired_difference(mode: Sequence[float], baseline: Sequence[float], level: float = 0.95) -> PairedDifference:
    """`paired_t` of mode_i − baseline_i, the two lists ordered by seed."""
    _pairs(mode, baseline)
    return paired_t([m - b for m, b in zip(mode, baseline)], level)


def ratio_of_baseline(mode: Sequence[float], baseline: Sequence[float], level: float = 0.95) -> RatioOfBaseline:
    """mean(mode) / mean(baseline) with the delta-method interval of `RatioOfBaseline`."""
    _pairs(mode, baseline)
    denominator = _mean(baseline)
    if denominator == 0.0:
        raise ValueError("a ratio of the baseline needs a baseline mean other than 0")
    ratio = _mean(mode) / denominator
    if len(mode) < 2:
        return RatioOfBaseline(ratio, None, None, None, level, len(mode))
    spread = _sample_sd([m - ratio * b for m, b in zip(mode, baseline)]) / abs(denominator)
    half = student_t_quantile(0.5 + level / 2.0, len(mode) - 1) * spread / math.sqrt(len(mode))
    return RatioOfBaseline(ratio, spread, ratio - half, ratio + half, level, len(mode))


def binomial_standard_error(accuracy: float, prompts: int) -> float:
    """The standard error √(p(1 − p) / n) of one accuracy p measured on n prompts (same unit as `accuracy`'s
    fraction: 0.5 on 200 prompts gives 0.0354)."""
    if not 0.0 <= accuracy <= 1.0 or prompts < 1:
        raise ValueError(f"a binomial standard error needs 0 <= accuracy <= 1 and prompts >= 1, got {accuracy}, "
                         f"{prompts}")
    return math.sqrt(accuracy * (1.0 - accuracy) / prompts)


def seeds_needed(spread: float | None, gap: float, power: float = 0.8, alpha: float = 0.05) -> int | None:
    """The fewest seeds n at which a paired t-test (two-sided, level `alpha`) detects a true mean difference of
    `gap` with probability `power`, when per-seed differences spread with standard deviation `spread`.

    The normal approximation with a t correction: the smallest n >= 2 with
    n >= ((t_{1 − alpha/2, n − 1} + t_{power, n − 1}) · spread / gap)², searched upward from the normal-quantile
    answer (which it never undercuts for power >= 0.5). None when the spread is unknown (one seed) or the gap is 0."""
    if not (0.5 <= power < 1.0 and 0.0 < alpha < 1.0):
        raise ValueError(f"seeds_needed takes 0.5 <= power < 1 and 0 < alpha < 1, got power {power}, alpha {alpha}")
    if spread is None or gap == 0.0:
        return None
    if spread == 0.0:
        return 2
    ratio = spread / abs(gap)
    normal = NormalDist()
    n = max(2, math.ceil(((normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)) * ratio) ** 2))
    while n < ((student_t_quantile(1 - alpha / 2, n - 1) + student_t_quantile(power, n - 1)) * ratio) ** 2:
        n += 1
    return n


# ---------------------------------------------------------------------------------- verdicts
def verdict(estimate: PairedDifference | RatioOfBaseline, alternative: float, above: str = "keeps up",
            below: str = "falls") -> str:
    """`above` when the interval lies wholly above `alternative`, `below` when wholly below it; otherwise
    "not distinguishable at N seeds (about M needed)", M from `seeds_needed` for the gap between the estimate and
    the alternative at the observed spread. With one seed (no interval) it says so, and never gives a word."""
    if estimate.low is None or estimate.high is None:
        return f"not distinguishable at {estimate.n} seed (one seed gives no interval)"
    if estimate.low > alternative:
        return above
    if estimate.high < alternative:
        return below
    needed = seeds_needed(estimate.spread, estimate.estimate - alternative)
    return f"not distinguishable at {estimate.n} seeds " + (
        f"(about {needed} needed)" if needed else "(the estimate lies on the alternative: no number of seeds)")


def sparse_rl_vs_naive_rule(differences: Sequence[float]) -> str:
    """Issue 54's rule on D = Sparse-RL − naive-sparse per seed, in points: "hurts" if the mean D <= −5 with a
    one-sided paired-t p < 0.05 (against "D below 0"); "no detectable harm" if the 90% t-interval of D lies within
    ±7 points; "inconclusive" otherwise, and always with fewer than two seeds (no spread, no interval)."""
    found = paired_t(differences, RULE_LEVEL)
    if found.p_below is None or found.low is None or found.high is None:
        return "inconclusive"
    if found.estimate <= -HURT_POINTS and found.p_below < RULE_P:
        return "hurts"
    if -HARM_BOUND_POINTS <= found.low and found.high <= HARM_BOUND_POINTS:
        return "no detectable harm"
    return "inconclusive"
