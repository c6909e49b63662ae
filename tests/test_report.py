"""The compare report: plots exist, cells are hand-computed means and ranges over seeds with the binomial standard
error, paired comparisons are hand-computed, and a verdict word appears only where its interval excludes the
alternative."""

from __future__ import annotations

import json
import re

import pytest

from sparserl.report.common import cell
from sparserl.report.plots import PLOTS
from sparserl.report.tables import (
    paper_table,
    write_report,
)

MIB = 1024 ** 2


@pytest.fixture
def no_plots(monkeypatch):
    """For tests of the tables alone: matplotlib's six figures are most of a report's 3 s; the plot tests draw them."""
    from sparserl.report import plots

    monkeypatch.setattr(plots, "write_plots", lambda *args, **kwargs: [])


def _step(step: int, reward: float, kept: float, vetoed: float, veto_flagged: float, peak: float = 1.6,
          **extra) -> dict:
    record = {"step": step, "reward_mean": reward, "reward_std": 0.1, "accuracy": reward,
              "response_len_mean": 40.0 + step, "rollout_s": 2.0,
              "kv_peak_bytes": int(peak * MIB * step / 2), "kv_dense_bytes": 5 * MIB, "kv_kept_frac": kept,
              "xi_mean": 1.0, "xi_min": 0.01 * step, "xi_q01": 0.5, "kl_sampler_old": 0.02 * step,
              "rejected_seq_frac": vetoed / 8, "rejected_token_frac": vetoed / 16, "flagged_veto_frac": veto_flagged,
              "flagged_band_frac": 0.1, "ess": 0.9, "walk_exact": reward, "skipped": 0, "skipped_steps": 0,
              "flagged_veto_frac_len_0_16": 0.0, "flagged_veto_frac_len_16_inf": veto_flagged * 2,
              "rows_in_flight": 16 + 16 * step, "step_s": 1.0 + step}
    record.update(extra)
    return record


def _write_run(root, mode, seed, start, final, kept=0.6, vetoed=0.0, veto_flagged=0.25, finished=True, peak=1.6):
    """Two training steps; step 0 evaluates the start model, step 2 the final one. The KV peak of step 2 is `peak`
    MiB, step 1's half of it (the run's peak is its largest)."""
    run = root / mode / f"seed{seed}"
    run.mkdir(parents=True)
    records = [{"step": 0, "eval_accuracy_dense": start, "eval_accuracy_sparse": start - 0.1},
               _step(1, 0.5, kept, vetoed, veto_flagged, peak),
               _step(2, 0.7, kept, vetoed, veto_flagged, peak, eval_accuracy_dense=final,
                     eval_accuracy_sparse=final - 0.2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (run / "final_eval.json").write_text(json.dumps({
            "mode": mode, "dense": {"accuracy": final, "walk_exact": final - 0.01},
            "sparse": {"accuracy": final - 0.2}, "train_seconds": 10.0, "rollout_seconds": 4.0 + seed, "steps": 2}))


def _compare_dir(tmp_path, rl_finals=(0.8, 0.8), naive_finals=(0.2, 0.3), dense_finals=(0.8, 0.8)):
    """dense, naive-sparse and sparse-rl over one seed per final accuracy given (sparse-rs named but not run); every
    run starts at 50% and ends at its final, 20 points lower under sparse inference."""
    seeds = list(range(len(rl_finals)))
    config = {"task": {"task": "pointer_walk", "difficulty": 26}, "train": {"steps": 2, "seed": 0},
              "rollout": {"kv_policy": "rkv", "kv_budget": 80, "kv_window": 8, "kv_interval": 8,
                          "prompts_per_step": 4, "group_size": 8}, "output": {"eval_examples": 200}}
    (tmp_path / "compare.json").write_text(json.dumps(
        {"modes": ["dense", "naive-sparse", "sparse-rl", "sparse-rs"], "seeds": seeds, "config": config}))
    # The dense runs peak at 4 MiB; the sparse runs at 1.6 MiB (seed 0) and 2.0 MiB (seed 1): 60% and 50% saved.
    for seed in seeds:
        _write_run(tmp_path, "dense", seed, 0.5, dense_finals[seed], kept=1.0, veto_flagged=0.0, peak=4.0)
        _write_run(tmp_path, "naive-sparse", seed, 0.5, naive_finals[seed], veto_flagged=0.2 + 0.1 * seed,
                   peak=1.6 + 0.4 * seed)
        _write_run(tmp_path, "sparse-rl", seed, 0.5, rl_finals[seed], kept=0.5 + 0.1 * seed, vetoed=2.0,
                   veto_flagged=0.2 + 0.1 * seed, peak=1.6 + 0.4 * seed)
    return tmp_path


def _rows(table: str) -> dict[str, list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("| ")][1:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return {r[0]: r[1:] for r in rows}


def test_cells_are_mean_and_range():
    assert cell([0.5, 0.7, 0.6]) == "60.0% (50.0–70.0)"
    assert cell([0.5]) == "50.0%"
    assert cell([None, None]) == "—"
    assert cell([0.1, None, 0.3], ".2f") == "0.20 (0.10–0.30)"
    assert cell([0.02, 0.04], "pts") == "+3.0 pts (+2.0–+4.0)"


def test_report_table_regime_and_verdicts(tmp_path):
    out = _compare_dir(tmp_path)
    report = write_report(out)
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", name
    text = report.read_text()
    assert "Problems reading the runs" not in text
    table = paper_table(out)
    # Regime: every sparse run's step-0 gap is 0.1; step-1 flagged veto 0.2 and 0.3 in both sparse modes.
    assert "gap dense − sparse +10.0 pts (+10.0–+10.0)" in table
    assert "step-0 veto rate (Sparse-RL filter) 25.0% (20.0–30.0)" in table
    # Against each seed's dense run, not the padded 5 MiB bound nor the kept tokens (0.5 and 0.6).
    assert "KV saved (peak bytes against the dense run of each seed, same prompts) 55.0% (50.0–60.0)" in table
    rows = _rows(table)
    # sparse-rl: peaks 1.6 and 2.0 MiB against 4.0; rollout s 4 and 5; vetoed 2 per step.
    # ± √(0.8 · 0.2 / 200) = 2.8 points; under sparse inference √(0.6 · 0.4 / 200) = 3.5.
    assert rows["sparse-rl"][0] == "80.0% (80.0–80.0) ± 2.8" and rows["sparse-rl"][1] == "60.0% (60.0–60.0) ± 3.5"
    assert rows["sparse-rl"][2] == "79.0% (79.0–79.0)"  # exact walks from final_eval
    assert rows["sparse-rl"][4] == "55.0% (50.0–60.0)"
    assert rows["sparse-rl"][5] == "1.80 (1.60–2.00) / 4.00 (4.00–4.00)"
    assert rows["dense"][4] == "—"
    assert rows["sparse-rl"][6] == "48 (48–48)"  # the most rows in flight: step 2's 16 + 32
    assert rows["sparse-rl"][7] == "4.5 (4.0–5.0)"
    assert rows["sparse-rl"][8] == "2.50 (2.50–2.50)"  # mean step time, (2 + 3) / 2 s
    assert rows["sparse-rl"][10] == "12.5% (12.5–12.5) / 25.0% (25.0–25.0)"  # 2 of 8 sequences, 1/16 tokens each
    assert rows["naive-sparse"][10] == "—"  # rejects nothing: no number to show
    assert rows["sparse-rs (not run)"] == ["—"] * 12
    paired = text.split("## Paired comparisons over seeds")[1].split("## Mismatch")[0]
    dense_inference = _rows(paired.split("dense inference:")[1].split("Held-out accuracy, sparse")[0])
    # naive-sparse − dense: −60, −50 points; mean −55, s = 7.07, t(0.975, 1) = 12.706: −55 ± 63.5;
    # t = −11, p = 1 − 2 atan(11) / π = 0.058.
    assert dense_inference["naive-sparse − dense"][:6] == ["2", "-60.0, -50.0", "-55.0", "-118.5 to +8.5", "0.058",
                                                            "31% (-48% to 111%)"]
    assert dense_inference["naive-sparse − dense"][7].startswith("not distinguishable at 2 seeds")
    # sparse-rl equals dense on both seeds: a point interval at 0, above −5.
    assert dense_inference["sparse-rl − dense"][3:] == ["+0.0 to +0.0", "1", "100% (100% to 100%)", "2", "keeps up"]
    assert "sparse-rl − naive-sparse" in dense_inference  # each correction against no correction
    assert "One held-out figure on 200 prompts has a binomial standard error of up to 3.5 points" in paired
    verdicts = text.split("## Verdicts")[1]
    # naive-sparse: 50 → 20 and 50 → 30, mean −25 ± 12.706 · 7.07 / √2 = ±63.5: covers −5.
    assert ("naive-sparse, final vs step-0 accuracy (dense inference): **not distinguishable at 2 seeds (about 4 "
            "needed)** — mean -25.0 points, 95% CI -88.5 to +38.5, p 0.13 (paired t, 1 df) (50.0% → 20.0%; "
            "50.0% → 30.0%)") in verdicts
    assert "sparse-rl, final vs step-0 accuracy (dense inference): **holds** — mean +30.0 points" in verdicts
    assert "keeps ≥ 97% of dense accuracy — **met** (ratio of the means 100.0%, 95% CI 100.0% to 100.0%" in verdicts
    assert ("Issue 54's rule on sparse-rl − naive-sparse (dense inference): interim, 2 of the 9 seeds the rule is for "
            "(no verdict before 9): it would read **inconclusive** on 2 seed(s)") in verdicts
    assert "Caveat: verdicts rest on 2 steps (< 20), 2 seed(s) (< 3)" in verdicts


@pytest.mark.usefixtures("no_plots")
def test_a_block_sparse_regime_names_its_pages_and_attended_fraction(tmp_path):
    out = _compare_dir(tmp_path)
    meta = json.loads((out / "compare.json").read_text())
    meta["config"]["rollout"].update(sparsity="block", block_page_size=16, block_dense_layers=1)
    (out / "compare.json").write_text(json.dumps(meta))
    for mode, attended in (("naive-sparse", 0.5), ("sparse-rl", 0.7)):
        for seed in (0, 1):
            metrics = out / mode / f"seed{seed}" / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            for record in records[1:]:
                record["kv_attended_frac"] = attended + 0.1 * seed
            metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = paper_table(out)
    # Per run: 0.5, 0.6, 0.7, 0.8 -> mean 0.65.
    assert ("Regime: block-sparse attention, 80 attended tokens per sparse layer (pages of 16, the first 1 "
            "layer(s) dense); attended share of the cached keys (sparse layers, mean over decode steps) 65.0% (50.0–80.0)") in table
    assert "rkv" not in table.splitlines()[0]


@pytest.mark.usefixtures("no_plots")
def test_paper_claims_decided_only_by_intervals_that_exclude_their_thresholds(tmp_path):
    out = _compare_dir(tmp_path, rl_finals=(0.60, 0.62, 0.61), naive_finals=(0.20, 0.22, 0.21),
                       dense_finals=(0.80, 0.80, 0.80))
    verdicts = write_report(out).read_text().split("## Verdicts")[1]
    # Sparse-RL / dense: 61 / 80 (0.76249… in float64: 76.2%); residuals −1, +1, 0 points → s = 1 / 80,
    # ± 4.303 · 0.0125 / √3 = 3.1%.
    assert ("keeps ≥ 97% of dense accuracy — **not met** (ratio of the means 76.2%, 95% CI 73.1% to 79.4%; per "
            "seed 60.0% vs 80.0%; 62.0% vs 80.0%; 61.0% vs 80.0%)") in verdicts
    # naive-sparse's final / start: 21 / 50 = 42%, ± 4.303 · (1 / 50) / √3 = 5.0%: below 50%.
    assert "naive sparse training collapses (final < 50% of its step-0 accuracy) — **met** (ratio of the means " \
           "42.0%, 95% CI 37.0% to 47.0%" in verdicts
    # D = Sparse-RL − naive = +40 points on every seed: not "hurts", and far outside ±7.
    assert "sparse-rl − naive-sparse (dense inference): interim, 3 of the 9 seeds the rule is for (no verdict " \
           "before 9): it would read **inconclusive** on 3 seed(s) (mean D +40.0 points" in verdicts
    # The same comparison on two seeds whose figures straddle 97%: no verdict word.
    (tmp_path / "two").mkdir()
    two = _compare_dir(tmp_path / "two", rl_finals=(0.6, 0.8))
    verdicts = write_report(two).read_text().split("## Verdicts")[1]
    assert "keeps ≥ 97% of dense accuracy — **not distinguishable at 2 seeds (about " in verdicts


@pytest.mark.usefixtures("no_plots")
def test_one_seed_says_it_gives_no_interval(tmp_path):
    out = _compare_dir(tmp_path, rl_finals=(0.6,), naive_finals=(0.2,), dense_finals=(0.8,))
    text = write_report(out).read_text()
    row = _rows(text.split("Held-out accuracy, dense inference:")[1].split("Held-out")[0])["sparse-rl − dense"]
    assert row == ["1", "-20.0", "-20.0", "one seed: no interval", "—", "75%", "—",
                   "not distinguishable at 1 seed (one seed gives no interval)"]
    assert "sparse-rl, final vs step-0 accuracy (dense inference): **not distinguishable at 1 seed (one seed gives " \
           "no interval)** — +10.0 points on one seed: no interval" in text


def _intervals_and_verdicts(text: str) -> list[tuple[float, float, float, str]]:
    """(low, high, the alternative, the verdict) of every paired-table row and every verdict sentence of report.md."""
    found = []
    for line in text.split("## Paired comparisons over seeds")[1].split("## Mismatch")[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and " − " in cells[0] and "(A − B)" not in cells[0]:
            low, high = (float(v) for v in cells[4].split(" to "))
            found.append((low, high, -5.0, cells[8]))
    alternatives = {"final vs step-0": -5.0, "keeps ≥ 97%": 97.0, "collapses": 50.0, "loses less": 0.0}
    for line in text.split("## Verdicts")[1].splitlines():
        match = re.search(r"\*\*(.+?)\*\*.*?95% CI (-?[\d.+]+)%? to (-?[\d.+]+)%?", line)
        alternative = next((v for k, v in alternatives.items() if k in line), None)
        if match and alternative is not None:
            found.append((float(match[2]), float(match[3]), alternative, match[1]))
    return found


@pytest.mark.parametrize("rl_finals, naive_finals", [
    ((0.8, 0.8, 0.8), (0.2, 0.3, 0.25)), ((0.70, 0.85, 0.78), (0.79, 0.83, 0.76)),
    ((0.45, 0.9, 0.6), (0.5, 0.52, 0.48)), ((0.76, 0.77, 0.78), (0.74, 0.81, 0.8)),
])
@pytest.mark.usefixtures("no_plots")
def test_no_verdict_word_where_the_interval_covers_the_alternative(tmp_path, rl_finals, naive_finals):
    out = _compare_dir(tmp_path, rl_finals=rl_finals, naive_finals=naive_finals, dense_finals=(0.8, 0.78, 0.81))
    found = _intervals_and_verdicts(write_report(out).read_text())
    assert len(found) >= 10  # 6 table rows, 3 trajectories, 2 paper claims
    assert any(low < alternative < high for low, high, alternative, _ in found)  # both cases are met
    assert any(not low <= alternative <= high for low, high, alternative, _ in found)
    for low, high, alternative, word in found:
        if low + 0.05 < alternative < high - 0.05:  # covered, beyond the rounding of the printed interval
            assert word.startswith("not distinguishable"), (low, high, alternative, word)
        elif not low - 0.05 <= alternative <= high + 0.05:
            assert word in ("keeps up", "falls", "holds", "met", "not met"), (low, high, alternative, word)


def test_incomplete_and_missing_runs(tmp_path):
    out = _compare_dir(tmp_path)
    (out / "sparse-rl" / "seed1" / "final_eval.json").unlink()
    (out / "naive-sparse" / "seed0" / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy_dense": 0.5}\n{"step": 1, "rew')
    with pytest.warns(UserWarning, match=r"naive-sparse/seed0/metrics.jsonl: line 2 was cut off"):
        text = write_report(out).read_text()
        rows = _rows(paper_table(out))
    # Incomplete: held-out accuracy falls back to the latest in-training evaluation (step 2 here).
    assert rows["sparse-rl (1 incomplete)"][0] == "80.0% (80.0–80.0) ± 2.8"
    assert "naive-sparse" in text and all((out / p).exists() for p in PLOTS)


def test_a_scheduled_mode_gets_its_budget_plot(tmp_path):
    from sparserl.report.plots import SCHEDULE_PLOT

    out = _compare_dir(tmp_path)
    assert SCHEDULE_PLOT not in write_report(out).read_text() and not (out / SCHEDULE_PLOT).exists()
    meta = json.loads((out / "compare.json").read_text())
    (out / "compare.json").write_text(json.dumps({**meta, "modes": meta["modes"] + ["sparrow"]}))
    for seed in (0, 1):
        run = out / "sparrow" / f"seed{seed}"
        run.mkdir(parents=True)
        steps = [_step(s, 0.5, 0.6, 0.0, 0.1, kv_budget_len_0=40.0 + 8 * s, kv_budget_len_16=56.0) for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert f"![{SCHEDULE_PLOT}]({SCHEDULE_PLOT})" in write_report(out).read_text()
    assert (out / SCHEDULE_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _alpha_step(step: int, tails: dict[int, float], mean: float) -> dict:
    """A step record with α tails per cached-length bin; `alpha_tail` is their minimum, as logged."""
    return _step(step, 0.5, 0.6, 0.0, 0.1, alpha_mean=mean, alpha_tail=min(tails.values()),
                 **{f"alpha_tail_len_{start}": tail for start, tail in tails.items()})


def _alpha_compare_dir(tmp_path):
    """dense (no α), sparse-rl over two seeds, and sparse-tis trained with DistillSparse (one seed);
    τ = 0.9, bins of 16 cached tokens."""
    config = {"task": {"task": "pointer_walk", "difficulty": 26}, "train": {"steps": 2, "seed": 0},
              "rollout": {"kv_policy": "rkv", "kv_budget": 56, "alpha_tau": 0.9, "alpha_bin_size": 16}}
    (tmp_path / "compare.json").write_text(json.dumps(
        {"modes": ["dense", "sparse-rl", "sparse-tis"], "seeds": [0, 1], "config": config}))
    _write_run(tmp_path, "dense", 0, 0.5, 0.8, kept=1.0, veto_flagged=0.0)
    runs = {("sparse-rl", 0): ({32: 1.0, 48: 0.95, 64: 0.5}, {32: 1.0, 48: 0.85, 64: 0.7}),
            ("sparse-rl", 1): ({32: 0.98, 48: 0.91, 64: 0.3}, {32: 0.96, 48: 0.93}),
            ("sparse-tis", 0): ({32: 1.0, 48: 0.95, 64: 0.5}, {32: 1.0, 48: 0.97, 64: 0.92})}
    for (mode, seed), (first, last) in runs.items():
        run = tmp_path / mode / f"seed{seed}"
        run.mkdir(parents=True)
        records = [{"step": 0, "eval_accuracy_dense": 0.5}, _alpha_step(1, first, 0.96), _alpha_step(2, last, 0.98)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "config.yaml").write_text(f"train:\n  mode: {mode}\n  distill_sparse: {str(mode == 'sparse-tis').lower()}\n")
    return tmp_path


def test_alpha_tail_table_by_bin_with_bins_below_tau(tmp_path):
    from sparserl.report.plots import ALPHA_PLOT

    out = _alpha_compare_dir(tmp_path)
    text = write_report(out).read_text()
    section = text.split("## Acceptance rate α per cached-length bin")[1].split("## Plots")[0]
    assert "τ = 0.9 (`alpha_tau`)" in section
    header = next(line for line in section.splitlines() if line.startswith("| Mode"))
    assert header == "| Mode | Step | len 32–47 | len 48–63 | len 64–79 | worst bin (`alpha_tail`) | α mean |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| Mode")]
    # sparse-rl, step 1: bin 32 (1.0 + 0.98) / 2, bin 48 (0.95 + 0.91) / 2 >= τ, bin 64 (0.5 + 0.3) / 2 < τ;
    # the worst bin is 64 in both seeds. Step 2: bin 48 (0.85 + 0.93) / 2 = 0.89 < τ; bin 64 only in seed 0;
    # worst bins 0.7 (seed 0, bin 64) and 0.93 (seed 1, bin 48).
    assert rows[0] == ["sparse-rl", "first (1)", "0.990 (0.980–1.000)", "0.930 (0.910–0.950)",
                       "**0.400 (0.300–0.500)**", "**0.400 (0.300–0.500)**", "0.960 (0.960–0.960)"]
    assert rows[1] == ["sparse-rl", "last (2)", "0.980 (0.960–1.000)", "**0.890 (0.850–0.930)**",
                       "**0.700** (1 of 2 seeds)", "**0.815 (0.700–0.930)**", "0.980 (0.980–0.980)"]
    # DistillSparse is in the label, and only seed 0 ran: single values, every bin >= τ at the last step.
    assert rows[2] == ["sparse-tis + DistillSparse", "first (1)", "1.000", "0.950", "**0.500**", "**0.500**", "0.960"]
    assert rows[3] == ["sparse-tis + DistillSparse", "last (2)", "1.000", "0.970", "0.920", "0.920", "0.980"]
    assert len(rows) == 4  # dense logged no α: no row
    assert "| sparse-tis + DistillSparse (1 incomplete) (1 of 2 seeds) |" in text  # so does the main table
    assert f"![{ALPHA_PLOT}]({ALPHA_PLOT})" in text
    assert (out / ALPHA_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_without_alpha_has_no_alpha_section(tmp_path):
    from sparserl.report.plots import ALPHA_PLOT

    out = _compare_dir(tmp_path)
    meta = json.loads((out / "compare.json").read_text())
    (out / "compare.json").write_text(json.dumps({**meta, "modes": ["dense"]}))
    text = write_report(out).read_text()
    assert "Acceptance rate α" not in text and ALPHA_PLOT not in text and not (out / ALPHA_PLOT).exists()
    assert "| dense |" in text


@pytest.mark.usefixtures("no_plots")
def test_a_bad_metrics_line_before_the_last_stops_the_report_naming_file_and_line(tmp_path):
    out = _compare_dir(tmp_path)
    metrics = out / "sparse-rl" / "seed1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][: len(lines[1]) // 2], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"sparse-rl/seed1/metrics.jsonl: line 2 is not valid JSON"):
        write_report(out)


@pytest.mark.parametrize("content, problem", [
    ('{"mode": "sparse-rl", "dense": {"accur', "not valid JSON (Unterminated string"),  # cut off
    ("", "not valid JSON (Expecting value"),
    ("[0.8]", "holds a JSON list, not an object"),
    ('{"dense": {"accuracy": "80%"}}', "dense.accuracy is '80%', not a number"),
    ('{"dense": 0.8}', "dense is 0.8, not a JSON object"),
])
@pytest.mark.usefixtures("no_plots")
def test_an_unreadable_final_eval_is_said_and_the_run_reported_as_incomplete(tmp_path, content, problem):
    out = _compare_dir(tmp_path)
    final_eval = out / "sparse-rl" / "seed1" / "final_eval.json"
    final_eval.write_text(content)
    text, table = write_report(out).read_text(), paper_table(out)
    for shown in (text, table):  # report.md, and what `sparserl compare` prints
        problems = shown.split("Problems reading the runs:\n\n")[1].split("\n\n")[0].splitlines()
        assert len(problems) == 1 and problems[0].startswith(f"- sparse-rl, seed 1: {final_eval}: {problem}")
        assert "reported as incomplete" in problems[0] and "delete the file and rerun `sparserl compare`" in problems[0]
    row = _rows(table)["sparse-rl (1 incomplete)"]
    # Seed 1 falls back to its step-2 evaluation (0.8) and logs no exact walks, so that cell is seed 0's
    # final_eval alone (0.79); its rollout time is the sum of its steps' rollout_s, 2 + 2 = 4 s.
    assert row[0] == "80.0% (80.0–80.0) ± 2.8" and row[2] == "79.0%" and row[7] == "4.0 (4.0–4.0)"


def test_a_directory_without_compare_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"holds no compare.json; pass the --out directory of a `sparserl compare`"):
        write_report(tmp_path)


@pytest.mark.usefixtures("no_plots")
def test_the_veto_by_length_table_labels_each_bucket_by_its_lengths(tmp_path):
    out = _compare_dir(tmp_path)
    section = write_report(out).read_text().split("## Sequences flagged by the veto, by response length")[1]
    table = section.split("##")[0]
    # The fixture logs buckets [0, 16) and [16, inf): lengths 0-15 and 16 and up.
    assert "| Mode | len 0–15 | len ≥ 16 |" in table
    # sparse-rl flags 0.2 and 0.3 of all sequences per seed, twice that in the long bucket: 0.4 and 0.6.
    assert _rows(table)["sparse-rl"] == ["0.000 (0.000–0.000)", "0.500 (0.400–0.600)"]


@pytest.mark.usefixtures("no_plots")
def test_without_a_dense_run_kv_saved_is_said_to_be_unmeasured(tmp_path):
    out = _compare_dir(tmp_path)
    meta = json.loads((out / "compare.json").read_text())
    meta["modes"] = ["naive-sparse", "sparse-rl"]
    (out / "compare.json").write_text(json.dumps(meta))
    table = paper_table(out)
    assert "not measured (no dense run in this comparison)" in table
    assert _rows(table)["sparse-rl"][4] == "—"


@pytest.mark.usefixtures("no_plots")
def test_a_mode_with_its_own_sampler_is_named_in_the_regime_and_not_paired_under_sparse_inference(tmp_path):
    """nemo-fp8 samples (and is evaluated under sparse inference) through a full fp8 cache, the others through R-KV
    80: its dense-inference accuracy pairs with dense's, its sparse-inference accuracy with no one's."""
    out = _compare_dir(tmp_path)
    manifest = json.loads((out / "compare.json").read_text())
    manifest["modes"].append("nemo-fp8")
    (out / "compare.json").write_text(json.dumps(manifest))
    for seed in manifest["seeds"]:
        _write_run(out, "nemo-fp8", seed, 0.5, 0.8, kept=1.0, veto_flagged=0.0, peak=1.0)
        for mode in ("dense", "naive-sparse", "sparse-rl", "nemo-fp8"):
            rollout = {"sparsity": "none", "kv_dtype": "fp8"} if mode == "nemo-fp8" else \
                {"sparsity": "eviction", "kv_policy": "rkv", "kv_budget": 80, "kv_dtype": "auto"}
            (out / mode / f"seed{seed}" / "config.yaml").write_text(json.dumps({"rollout": rollout}))
    text = write_report(out).read_text()
    assert "Regime: KV budget 80 (rkv, window 8, interval 8) (nemo-fp8: full cache, fp8);" in text
    dense_part, sparse_part = text.split("Held-out accuracy, sparse inference:")
    assert "| nemo-fp8 − dense |" in dense_part
    assert "| nemo-fp8 − dense |" not in sparse_part and "| sparse-rl − dense |" in sparse_part
    assert "Not compared under sparse inference (their sparse samplers differ): nemo-fp8 − dense, " \
           "nemo-fp8 − naive-sparse." in sparse_part
