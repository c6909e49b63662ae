"""Paired comparisons over seeds as the reports print them: one markdown row per comparison (the per-seed
differences in points, their mean, t-interval and p, the ratio of the means with its interval, the seeds a 5-point
gap needs, and the verdict), the binomial standard error beside an accuracy, and issue 54's nine-seed rule as a
sentence. `compare`'s report.md (`verdicts.py`) and the study tables (docs/results/paper_regime/rl_table.py,
docs/results/study_table.py) print these, so every report states the same statistics the same way.

Accuracies come in as fractions (0.465) ordered by seed; everything shown is in points (46.5).
"""

from __future__ import annotations

from typing import Sequence

from .common import DASH, markdown
from .statistics import (
    HARM_BOUND_POINTS,
    HURT_POINTS,
    RULE_LEVEL,
    RULE_SEEDS,
    PairedDifference,
    RatioOfBaseline,
    binomial_standard_error,
    paired_difference,
    paired_t,
    ratio_of_baseline,
    seeds_needed,
    sparse_rl_vs_naive_rule,
    verdict,
)

LEVEL = 0.95
GAP_POINTS = 5.0  # the loss the verdicts test against, and the gap the "seeds needed" column is for
PAIRED_HEADER = ("comparison (A − B)", "seeds", "per-seed A − B (points)", "mean", f"{LEVEL:.0%} CI", "p",
                 f"A / B ({LEVEL:.0%} CI)", f"seeds to detect {GAP_POINTS:.0f} points",
                 f"verdict (alternative: A {GAP_POINTS:.0f} points below B)")


def points(fractions: Sequence[float]) -> list[float]:
    return [100.0 * value for value in fractions]


def standard_error(accuracy: float | None, prompts: int | None) -> str:
    """The suffix " ± 3.5": the binomial standard error, in points, of one accuracy measured on `prompts` prompts; "" when
    either is unknown."""
    if accuracy is None or not isinstance(prompts, int) or prompts < 1:
        return ""
    return f" ± {100 * binomial_standard_error(accuracy, prompts):.1f}"


def interval(estimate: PairedDifference | RatioOfBaseline, form: str) -> str:
    """The interval as "-9.2 to +8.2" in `form`, or the reason there is none."""
    if estimate.low is None or estimate.high is None:
        return "one seed: no interval"
    return f"{estimate.low:{form}} to {estimate.high:{form}}"


def p_value(p: float | None) -> str:
    """A p-value as the tables print it: two significant digits, "< 0.001" below that, a dash when absent."""
    if p is None:
        return DASH
    return "< 0.001" if p < 0.001 else f"{p:.2g}"


def described(difference: PairedDifference, unit: str = " points") -> str:
    """The difference as "mean -0.5 points, 95% CI -9.2 to +8.2, p 0.83 (paired t, 2 df)", or the single seed's
    value."""
    if difference.p_two_sided is None:
        return f"{difference.estimate:+.1f}{unit} on one seed: no interval"
    return (f"mean {difference.estimate:+.1f}{unit}, {difference.level:.0%} CI {interval(difference, '+.1f')}, "
            f"p {p_value(difference.p_two_sided)} (paired t, {difference.n - 1} df)")


def comparison_row(name: str, mode: Sequence[float], baseline: Sequence[float]) -> list[str]:
    """One row of `PAIRED_HEADER`: accuracies `mode` (A) and `baseline` (B) as fractions, one pair per seed."""
    difference = paired_difference(points(mode), points(baseline), LEVEL)
    has_baseline = sum(baseline) > 0
    ratio = ratio_of_baseline(mode, baseline, LEVEL) if has_baseline else None
    shares = DASH if ratio is None else f"{ratio.estimate:.0%}" + (
        f" ({ratio.low:.0%} to {ratio.high:.0%})" if ratio.low is not None else "")
    needed = seeds_needed(difference.spread, GAP_POINTS)
    return [name, str(difference.n), ", ".join(f"{d:+.1f}" for d in difference.differences),
            f"{difference.estimate:+.1f}", interval(difference, "+.1f"),
            p_value(difference.p_two_sided), shares,
            DASH if needed is None else str(needed), verdict(difference, -GAP_POINTS)]


def paired_table(comparisons: list[tuple[str, Sequence[float], Sequence[float]]]) -> str:
    """The markdown table of `comparison_row` over (name, A's accuracies, B's accuracies) triples."""
    return markdown(PAIRED_HEADER, [comparison_row(*comparison) for comparison in comparisons])


def paired_note(prompts: int | None) -> str:
    """What the paired table's columns are, for the paragraph above it."""
    noise = "" if not isinstance(prompts, int) or prompts < 1 else (
        f" One held-out figure on {prompts} prompts has a binomial standard error of up to "
        f"{100 * binomial_standard_error(0.5, prompts):.1f} points (at 50%); seed-to-seed spread adds to it.")
    return (f"Per seed, A's held-out accuracy minus B's on the same seed (the same held-out and training prompts), in "
            f"points; their mean, a {LEVEL:.0%} Student-t interval and the two-sided paired-t p (df = seeds − 1; one "
            f"seed gives no interval); A / B is the ratio of the means, with a delta-method {LEVEL:.0%} interval. "
            f"Seeds to detect {GAP_POINTS:.0f} points: at 80% power (two-sided 5%) from the observed spread of the "
            f"differences. Verdict: *keeps up* only when the interval lies above −{GAP_POINTS:.0f} points, *falls* "
            f"only when it lies below; otherwise not distinguishable at this many seeds (with the seeds the "
            f"observed gap to −{GAP_POINTS:.0f} would need)." + noise)


def rule_sentence(differences: Sequence[float]) -> str:
    """Issue 54's rule on D = Sparse-RL − naive-sparse (points, per seed) with the figures it rests on. Below the
    RULE_SEEDS seeds the rule was set for, the reading is labelled interim: stopping when it first reads "hurts"
    would make the rule's error rate a different one."""
    found = paired_t(differences, RULE_LEVEL)
    figures = "one seed: no interval" if found.p_below is None else (
        f"mean D {found.estimate:+.1f} points, {RULE_LEVEL:.0%} CI {interval(found, '+.1f')}, one-sided p "
        f"{p_value(found.p_below)}")
    reading = f"**{sparse_rl_vs_naive_rule(differences)}** on {found.n} seed(s)"
    if found.n < RULE_SEEDS:
        reading = (f"interim, {found.n} of the {RULE_SEEDS} seeds the rule is for (no verdict before "
                   f"{RULE_SEEDS}): it would read {reading}")
    return (f"{reading} ({figures}; hurts: mean D <= −{HURT_POINTS:.0f} with one-sided p < 0.05; no detectable "
            f"harm: the {RULE_LEVEL:.0%} CI within ±{HARM_BOUND_POINTS:.0f} points)")
