"""`sparserl sweep` and `sparserl audit` on the shipped built-in model (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest

from sparserl.cli import main
from sparserl.experiments.sweep import RegimeRule, choose_regimes


def _row(budget, gap, veto, peak):
    return {"budget": budget, "gap": gap, "veto_frac": veto, "saved_frac": 1 - peak}


def test_regimes_by_hand():
    rows = [_row(24, 0.40, 0.99, 0.45), _row(48, 0.20, 0.60, 0.49), _row(56, 0.12, 0.50, 0.50),
            _row(64, 0.08, 0.40, 0.56), _row(72, 0.03, 0.20, 0.61), _row(80, 0.02, 0.10, 0.69),
            _row(96, 0.0, 0.0, 0.76)]
    # paper: the smallest budget with gap <= 5 points AND veto <= 15% (72 fails the veto);
    # stress: the largest budget saving >= 50% of peak KV while losing >= 10 points.
    assert choose_regimes(rows, RegimeRule()) == {"paper_regime_budget": 80, "stress_regime_budget": 56}
    assert choose_regimes(rows[:2], RegimeRule()) == {"paper_regime_budget": None, "stress_regime_budget": 48}


COMMON = ["--n", "24", "--threads", "1", "--difficulty", "12"]


def test_sweep_marks_a_huge_budget_as_dense(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--out", str(out), "--budgets", "16,4096", "--sample-prompts", "2", "--samples", "4",
                 *COMMON]) == 0
    result = json.loads(out.read_text())
    small, huge = result["rows"]
    # A budget past every sequence's length is the dense sampler: same greedy answers, nothing vetoed.
    assert huge["gap"] == 0 and huge["veto_frac"] == 0 and huge["band_frac"] == 0 and huge["kv_kept_frac"] == 1
    # KV saved against the dense greedy rollouts of the same prompts, by their measured peaks: none at a budget that
    # never binds (the same buffers), some at 16.
    dense_peak = result["dense"]["kv_peak_bytes"]
    assert huge["kv_saved"] == 0.0 and small["kv_saved"] > 0 and small["kv_kept_frac"] < 1
    assert small["kv_saved"] == pytest.approx(1 - small["kv_peak_bytes"] / dense_peak)
    assert result["paper_regime_budget"] == 4096
    assert (tmp_path / "sweep.md").read_text().count("\n| ") == 4  # header, the dense baseline, two budgets
    assert "Paper regime: B = 4096" in capsys.readouterr().out


def test_block_sparse_sweep_counts_attention_reads_as_saved(tmp_path):
    # Block attention keeps every token: peak KV bytes stay those of dense, and what a budget saves is
    # the share of cached keys the sparse layers do not read. A budget under every prompt reads few.
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--out", str(out), "--sparsity", "block", "--block-dense-layers", "0", "--budgets",
                 "48,4096", "--sample-prompts", "2", "--samples", "4", *COMMON]) == 0
    result = json.loads(out.read_text())
    small, huge = result["rows"]
    assert result["sparsity"] == {"sparsity": "block", "page_size": 16, "dense_layers": 0}
    assert small["kv_saved"] <= 0 and huge["kv_saved"] <= 0  # every token kept, in whole pages
    assert huge["kv_attended_frac"] == 1 and huge["saved_frac"] == 0 and huge["gap"] == 0
    assert small["saved_frac"] == pytest.approx(1 - small["kv_attended_frac"]) and small["kv_attended_frac"] < 1
    table = (tmp_path / "sweep.md").read_text()
    assert "block-sparse attention, pages of 16, the first 0 layer(s) dense" in table and "attended share" in table


@pytest.mark.parametrize("budget", [12, 4096])
def test_audit_blames_evicted_links(tmp_path, budget):
    out = tmp_path / "audit.json"
    assert main(["audit", "--out", str(out), "--kv-budget", str(budget), "--kv-window", "4", *COMMON]) == 0
    result = json.loads(out.read_text())
    firsts = result["first_errors"]
    if budget == 4096:
        # Nothing is ever evicted: no deviation can be blamed on a missing link.
        assert all(f["evicted_layers"] in (0, None) for f in firsts)
        assert result["correct_values_needed_evicted_any_layer"] == 0
    else:
        # At 12 slots for prompts of 23-28 tokens most links are gone: the walk breaks on a value whose
        # link was evicted, in a context where the dense model would have written the right one.
        values = [f for f in firsts if f["role"] == "value"]
        assert len(values) >= len(firsts) // 2 > 0
        assert sum(f["evicted_layers"] > 0 for f in values) >= 0.9 * len(values)
        assert sum(f["dense_argmax_right"] for f in values) >= 0.9 * len(values)
    assert (tmp_path / "audit.md").exists()


def test_audit_reads_block_sparse_rollouts(tmp_path):
    """With block-sparse attention, a link is 'evicted' for a query whose attended pages miss it."""
    out = tmp_path / "audit.json"
    assert main(["audit", "--out", str(out), "--sparsity", "block", "--kv-budget", "48", "--block-dense-layers", "0",
                 *COMMON]) == 0
    firsts = json.loads(out.read_text())["first_errors"]
    values = [f for f in firsts if f["role"] == "value"]
    assert values and any(f["evicted_layers"] > 0 for f in values)
