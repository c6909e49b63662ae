"""Every command that samples honours the limits on rows in flight (`--rollout-kv-memory`,
`--max-concurrent-rows`) as `train` does, and reports the KV figures of dense and sparse inference alike."""

from __future__ import annotations

import json

import pytest

from sparserl.cli import main

SMALL = ["--n", "6", "--threads", "1", "--difficulty", "3"]


@pytest.mark.parametrize("command", [
    ["eval", "--inference", "dense", "--samples", "0"],
    ["eval", "--inference", "sparse", "--samples", "0", "--kv-budget", "8", "--kv-window", "2"],
    ["sweep", "--budgets", "8", "--kv-window", "2", "--sample-prompts", "1", "--samples", "2"],
    ["audit", "--kv-budget", "8", "--kv-window", "2"],
])
def test_a_kv_memory_budget_below_one_row_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys, command):
    out = tmp_path / "out.json"
    model = [] if command[0] == "audit" else ["--model", str(tiny_model_dir)]  # audit reads the built-in walk
    assert main([command[0], "--out", str(out), *model, *SMALL, *command[1:], "--rollout-kv-memory", "1KiB"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "holds no row: one row of this cache needs" in error and not out.exists()


def test_calibrate_refuses_a_kv_memory_budget_below_one_row(tmp_path, capsys):
    argv = ["calibrate", "--out", str(tmp_path / "cal"), "--calibration-budgets", "32", "--calibration-prompts", "2",
            "--calibration-samples", "1", "--threads", "1", "--rollout-kv-memory", "1KiB"]
    assert main(argv) == 2
    assert "holds no row" in capsys.readouterr().err


def test_eval_decodes_at_most_the_rows_asked_for_and_reports_kv_for_both(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    argv = ["eval", "--out", str(out), "--model", str(tiny_model_dir), *SMALL, "--samples", "0", "--inference",
            "both", "--kv-budget", "8", "--kv-window", "2", "--max-concurrent-rows", "4"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    for mode in ("dense", "sparse"):
        kv = result[mode]["kv"]
        assert kv["rows_in_flight"] == 4 and kv["rollout_waves"] >= 2, mode  # 6 prompts, 4 at a time
        assert 0 < kv["kv_peak_bytes"] <= kv["kv_dense_bytes"]
    assert result["sparse"]["kv"]["kv_peak_bytes"] < result["dense"]["kv"]["kv_peak_bytes"]
    # KV saved: the measured peaks of the two on the same prompts, not the padded bound.
    assert result["kv_saved"] == pytest.approx(
        1 - result["sparse"]["kv"]["kv_peak_bytes"] / result["dense"]["kv"]["kv_peak_bytes"])


def test_eval_of_sparse_inference_alone_says_kv_saved_was_not_measured(tiny_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", "--out", str(out), "--model", str(tiny_model_dir), *SMALL, "--samples", "0", "--inference",
                 "sparse", "--kv-budget", "8", "--kv-window", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["kv_saved"] is None and "--inference both" in result["kv_saved_note"]


def test_eval_spends_a_kv_memory_budget_on_more_compressed_rows(tiny_model_dir, tmp_path):
    """In the bytes three dense rows reach, the compressed sampler holds more rows, and neither exceeds them."""
    probe = tmp_path / "probe.json"
    assert main(["eval", "--out", str(probe), "--model", str(tiny_model_dir), *SMALL, "--samples", "0",
                 "--max-concurrent-rows", "1", "--inference", "dense"]) == 0
    one_row = json.loads(probe.read_text())["dense"]["kv"]["kv_dense_bytes"]
    out = tmp_path / "eval.json"
    assert main(["eval", "--out", str(out), "--model", str(tiny_model_dir), *SMALL, "--samples", "0", "--inference",
                 "both", "--kv-budget", "8", "--kv-window", "2", "--rollout-kv-memory", str(3 * one_row)]) == 0
    result = json.loads(out.read_text())
    dense, sparse = result["dense"]["kv"], result["sparse"]["kv"]
    assert dense["rows_in_flight"] <= 3 and sparse["rows_in_flight"] > dense["rows_in_flight"]
    assert dense["kv_peak_bytes"] <= 3 * one_row and sparse["kv_peak_bytes"] <= 3 * one_row
