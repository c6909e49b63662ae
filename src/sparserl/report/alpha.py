"""The report's acceptance-rate section: the α tail per cached-length bin, at the first and last step.

Sparse modes log, per step, `alpha_tail_len_<start>` (the 5th percentile of α over the response
tokens whose cached length falls in the bin starting at <start>), `alpha_tail` (the worst bin) and
`alpha_mean`; see `sparserl.rollout.acceptance.alpha_metrics`. `alpha_section` turns them into the table of
report.md, `first_last` and `bins_over_seeds` feed `alpha_tail.png` (`report_plots.py`). Runs that
logged no α (dense-only comparisons) give no section at all.
"""

from __future__ import annotations

from ..config.schema import RolloutConfig
from ..rollout.acceptance import bin_tails
from .common import cell, markdown, setting


def alpha_tau(config: dict) -> float:
    """Sparrow's τ of the comparison: its `alpha_tau`, the default for comparisons recorded before it existed."""
    found = setting(config, "alpha_tau", None)
    return RolloutConfig.alpha_tau if found is None else found


def first_last(steps: list[dict]) -> tuple[dict | None, dict | None]:
    """The first and the last step record of a run that logged α tails per bin (None, None if none did)."""
    logged = [r for r in steps if bin_tails(r)]
    return (logged[0], logged[-1]) if logged else (None, None)


def alpha_runs(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The modes (and their seeds) where some seed logged α tails per bin, in report order."""
    return {mode: seeds for mode, seeds in runs.items() if any(first_last(s["steps"])[0] for s in seeds)}


def bins_over_seeds(records: list[dict]) -> dict[int, list[float]]:
    """{bin start: the tail of each record that has that bin}, bins ascending. A bin is absent from a
    step's record when fewer than 20 of its tokens fell in it, so a bin may have fewer values than seeds."""
    per_bin: dict[int, list[float]] = {}
    for record in records:
        for start, tail in bin_tails(record).items():
            per_bin.setdefault(start, []).append(tail)
    return dict(sorted(per_bin.items()))


def step_span(records: list[dict]) -> str:
    """The step the records were logged at, or the range when seeds differ (an incomplete run)."""
    steps = sorted({r["step"] for r in records})
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"


def _tail_cell(values: list[float], seeds: int, tau: float) -> str:
    text = cell(values, ".3f")
    if values and sum(values) / len(values) < tau:
        text = f"**{text}**"
    return text + (f" ({len(values)} of {seeds} seeds)" if values and len(values) < seeds else "")


def alpha_section(runs: dict[str, list[dict]], config: dict) -> list[str]:
    """report.md's lines for the α tail per cached-length bin; [] when no run logged α."""
    logged = alpha_runs(runs)
    if not logged:
        return []
    tau = alpha_tau(config)
    size = setting(config, "alpha_bin_size", None)
    rows, starts = [], set()
    for mode, seeds in logged.items():
        for which, name in ((0, "first"), (1, "last")):
            records = [r for r in (first_last(s["steps"])[which] for s in seeds) if r]
            tails = bins_over_seeds(records)
            starts |= set(tails)
            rows.append((mode, f"{name} ({step_span(records)})", records, tails))
    ordered = sorted(starts)
    bin_name = (lambda b: f"{b}–{b + size - 1}") if isinstance(size, int) else str  # noqa: E731
    header = ["Mode", "Step", *(f"len {bin_name(b)}" for b in ordered), "worst bin (`alpha_tail`)", "α mean"]
    table = [[mode, step, *(_tail_cell(tails.get(b, []), len(records), tau) for b in ordered),
              _tail_cell([r["alpha_tail"] for r in records if "alpha_tail" in r], len(records), tau),
              cell([r["alpha_mean"] for r in records if "alpha_mean" in r], ".3f")]
             for mode, step, records, tails in rows]
    return [
        "## Acceptance rate α per cached-length bin (first and last step)", "",
        "α = Σ_v min(p_sparse(v), p_dense(v)) at each response token, 1 − the total-variation distance between "
        "the sparse sampler's and the dense policy's next-token distributions; the tail of a bin is the 5th "
        "percentile of α over the tokens sampled with that many tokens cached (bins by cached length, a bin with "
        f"fewer than 20 tokens in a step is not logged). **Bold**: mean below Sparrow's τ = {tau} (`alpha_tau`). "
        "Each value rests on one step's rollouts.", "",
        markdown(header, table), "",
    ]
