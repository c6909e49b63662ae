"""report.md's statistics over seeds: the paired comparisons (each mode against dense, each correction against no
correction) and the "Verdicts" section (each mode's final accuracy against its start, the paper's claims, issue 54's
rule on Sparse-RL against naive-sparse). Every verdict word comes from `statistics.verdict`, so none appears where
the interval covers its alternative; the figures it rests on are stated beside it.

`runs` is `tables.load`'s {label: [one run summary per seed]}, seeds in the same order in every mode.
"""

from __future__ import annotations

from ..config.presets import mode_with_role
from .common import setting
from .paired import GAP_POINTS, LEVEL, described, interval, paired_note, paired_table, points, rule_sentence
from .statistics import paired_difference, ratio_of_baseline, verdict

# Thresholds of the verdicts, stated in the report too.
COLLAPSE_FRAC = 0.5      # naive training collapses: final dense-inference accuracy < 50% of its step-0 value
DEGRADE_POINTS = GAP_POINTS  # a run falls when it ends more than 5 accuracy points below its start
TARGET_ACC_FRAC = 0.97   # paper: Sparse-RL keeps ~97% of dense accuracy
MIN_EVAL_EXAMPLES = 100  # below this many held-out examples (or MIN_STEPS steps) verdicts carry a caveat
MIN_STEPS = 20
INFERENCE = (("dense", "dense inference"), ("sparse", "sparse inference"))


def _paired(mode: list[dict], baseline: list[dict], key: str) -> tuple[list[float], list[float]]:
    """`key` of the seeds where both runs have it: (the mode's values, the baseline's), in seed order."""
    both = [(m[key], b[key]) for m, b in zip(mode, baseline) if m.get(key) is not None and b.get(key) is not None]
    return [m for m, _ in both], [b for _, b in both]


def same_sampler(mode: list[dict], baseline: list[dict]) -> bool:
    """Whether two modes' runs were evaluated under sparse inference through the same sampler (unknown: assumed)."""
    samplers = {s.get("sparse_sampler") for s in (*mode, *baseline)} - {None}
    return len(samplers) <= 1


def comparisons(runs: dict[str, list[dict]]) -> list[tuple[str, str, str]]:
    """(A, B) pairs of the paired tables: every mode that ran against dense, then every correction against the
    uncorrected mode (naive-sparse), as (name, A, B)."""
    baseline, uncorrected = mode_with_role("baseline"), mode_with_role("uncorrected")
    ran = [mode for mode, seeds in runs.items() if any(s["status"] != "not run" for s in seeds)]
    pairs = [(mode, baseline) for mode in ran if mode != baseline and baseline in ran]
    pairs += [(mode, uncorrected) for mode in ran if mode not in (baseline, uncorrected) and uncorrected in ran]
    return [(f"{a} − {b}", a, b) for a, b in pairs]


def paired_section(runs: dict[str, list[dict]], config: dict) -> list[str]:
    """report.md's lines for the paired comparisons, one table per inference; [] when nothing pairs."""
    named = comparisons(runs)
    tables = []
    for kind, inference in INFERENCE:
        # Sparse inference is each run's own sampler: two runs are compared there only through the same one.
        unlike = [name for name, a, b in named if kind == "sparse" and not same_sampler(runs[a], runs[b])]
        rows = [(name, *_paired(runs[a], runs[b], f"acc_{kind}")) for name, a, b in named if name not in unlike]
        rows = [row for row in rows if row[1]]
        if rows:
            tables += [f"Held-out accuracy, {inference}:", "", paired_table(rows), ""]
        if unlike:
            tables += [f"Not compared under {inference} (their sparse samplers differ): {', '.join(unlike)}.", ""]
    if not tables:
        return []
    return ["## Paired comparisons over seeds", "", paired_note(setting(config, "eval_examples", None)), "",
            *tables]


def _per_seed(pairs: list[tuple[float, float]], joiner: str) -> str:
    return "; ".join(f"{100 * a:.1f}%{joiner}{100 * b:.1f}%" for a, b in pairs)


def _start_final(per_seed: list[dict]) -> tuple[list[float], list[float]] | None:
    """Each seed's (step-0, final) dense-inference accuracy; None unless every seed has both."""
    pairs = [(s["acc0_dense"], s["acc_dense"]) for s in per_seed
             if s.get("acc0_dense") is not None and s.get("acc_dense") is not None]
    if not pairs or len(pairs) != len(per_seed):
        return None
    return [start for start, _ in pairs], [final for _, final in pairs]


def trajectory(mode: str, per_seed: list[dict]) -> str | None:
    """The mode's final dense-inference accuracy against its start, over seeds; None unless every seed has both."""
    found = _start_final(per_seed)
    if found is None:
        return None
    starts, finals = found
    change = paired_difference(points(finals), points(starts), LEVEL)
    word = verdict(change, -DEGRADE_POINTS, "holds", "falls")
    return (f"{mode}, final vs step-0 accuracy (dense inference): **{word}** — {described(change)} "
            f"({_per_seed(list(zip(starts, finals)), ' → ')})")


def ratio_claim(claim: str, mode: list[float], baseline: list[float], threshold: float, above: str,
                below: str, joiner: str) -> str:
    """A claim about mode / baseline (the ratio of the means) against `threshold`, with its interval."""
    ratio = ratio_of_baseline(mode, baseline, LEVEL)
    return (f"{claim} — **{verdict(ratio, threshold, above, below)}** (ratio of the means {ratio.estimate:.1%}, "
            f"{LEVEL:.0%} CI {interval(ratio, '.1%')}; per seed {_per_seed(list(zip(mode, baseline)), joiner)})")


def paper_claims(runs: dict[str, list[dict]], seeds: list[int]) -> list[str]:
    """The paper's claims, each tested over the seeds where every run it needs has the figures."""
    baseline, published = mode_with_role("baseline"), mode_with_role("published")
    dense, rl = runs.get(baseline, []), runs.get(published, [])
    out = []
    rl_acc, dense_acc = _paired(rl, dense, "acc_dense")
    if rl_acc and len(rl_acc) == len(seeds) and all(dense_acc):
        out.append(ratio_claim(f"Paper claim: Sparse-RL keeps ≥ {TARGET_ACC_FRAC:.0%} of dense accuracy", rl_acc,
                               dense_acc, TARGET_ACC_FRAC, "met", "not met", " vs "))
        rl_sparse, dense_sparse = _paired(rl, dense, "acc_sparse")
        if len(rl_sparse) == len(rl_acc) and same_sampler(rl, dense):
            difference = paired_difference(points(rl_sparse), points(dense_sparse), LEVEL)
            found = verdict(difference, 0.0, "met", "not met")
            out.append("Paper claim: the Sparse-RL model loses less under sparse inference than the dense-trained "
                       f"one (sparse-inference accuracy ≥ dense-trained's) — **{found}** — "
                       f"{described(difference)} ({_per_seed(list(zip(rl_sparse, dense_sparse)), ' vs ')})")
    else:
        out.append(f"Paper claims: cannot be evaluated (a {baseline} or {published} run is missing for some seed).")
    uncorrected = mode_with_role("uncorrected")
    naive = runs.get(uncorrected, [])
    rl_acc, naive_acc = _paired(rl, naive, "acc_dense")
    if rl_acc and len(rl_acc) == len(seeds):
        out.append(f"Issue 54's rule on {published} − {uncorrected} (dense inference): "
                   + rule_sentence([100 * (r - n) for r, n in zip(rl_acc, naive_acc)]))
    found = _start_final(naive) if len(naive) == len(seeds) else None
    if found and all(found[0]):
        starts, finals = found
        out.append(ratio_claim(f"Paper claim: naive sparse training collapses (final < {COLLAPSE_FRAC:.0%} of its "
                               "step-0 accuracy)", finals, starts, COLLAPSE_FRAC, "not met", "met", " of "))
    return out


def caveat(runs: dict[str, list[dict]], config: dict) -> str | None:
    examples = setting(config, "eval_examples", None)
    steps = setting(config, "steps", None)
    small = []
    if isinstance(examples, int) and examples < MIN_EVAL_EXAMPLES:
        small.append(f"{examples} held-out examples (< {MIN_EVAL_EXAMPLES})")
    if isinstance(steps, int) and steps < MIN_STEPS:
        small.append(f"{steps} steps (< {MIN_STEPS})")
    seeds = len(next(iter(runs.values()), []))
    if seeds < 3:
        small.append(f"{seeds} seed(s) (< 3)")
    return ("Caveat: verdicts rest on " + ", ".join(small) + "; treat them as indications.") if small else None


def verdict_section(runs: dict[str, list[dict]], seeds: list[int], config: dict) -> list[str]:
    """report.md's "Verdicts" section: its thresholds, the caveat when the comparison is small, the sentences."""
    note = caveat(runs, config)
    sentences = [s for s in (trajectory(mode, per_seed) for mode, per_seed in runs.items()) if s]
    return [
        "## Verdicts", "",
        f"Each verdict rests on a {LEVEL:.0%} interval over seeds and is given only when the interval excludes its "
        f"alternative; otherwise it reads \"not distinguishable at N seeds\", with about the seeds the observed gap "
        f"would need (80% power, two-sided 5%). *holds* / *falls*: the mean change from step 0 (paired over seeds) "
        f"lies above / below −{DEGRADE_POINTS:.0f} points. Paper claims: the ratio of the means against "
        f"{TARGET_ACC_FRAC:.0%} (Sparse-RL of dense) and {COLLAPSE_FRAC:.0%} (naive-sparse's final of its start), "
        f"and the paired difference against 0 under sparse inference.", "",
        *([note, ""] if note else []), *[f"- {sentence}" for sentence in sentences + paper_claims(runs, seeds)],
    ]
