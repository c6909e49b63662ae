"""Calibration: the schedule rule by hand, and `calibrate` then `eval --kv-schedule` on the shipped model."""

from __future__ import annotations

import json

import pytest
import yaml

from sparserl.cli import main
from sparserl.rollout.schedule import BinnedBudget


def test_binned_schedule_by_hand():
    schedule = BinnedBudget(16, (24, 48, 96))
    assert [schedule.budget(n) for n in (0, 15, 16, 40, 500)] == [24, 24, 48, 96, 96]
    assert schedule.max_budget == 96
    with pytest.raises(ValueError, match="must not decrease"):
        BinnedBudget(16, (48, 24))


def test_calibrate_then_eval_with_the_schedule(tmp_path, capsys):
    out = tmp_path / "cal"
    assert main(["calibrate", "--out", str(out), "--tau", "0.86", "--budgets", "32,64,96,160", "--prompts", "8",
                 "--samples", "2", "--threads", "1"]) == 0
    for name in ("schedule.yaml", "tails.png", "calibration.md", "calibration.json"):
        assert (out / name).exists(), name
    schedule = yaml.safe_load((out / "schedule.yaml").read_text())
    assert schedule["tau"] == 0.86 and schedule["bin_size"] == 16
    assert schedule["budgets"] == sorted(schedule["budgets"])
    # On the calibration prompts the chosen schedule holds the tail in every bin it could rescue.
    calibration = json.loads((out / "calibration.json").read_text())
    assert all(tail >= 0.86 for start, tail in calibration["schedule_tails"].items()
               if int(start) not in calibration["unmet_bins"])
    result_file = tmp_path / "eval.json"
    assert main(["eval", "--out", str(result_file), "--kv-schedule", str(out / "schedule.yaml"), "--n", "40",
                 "--samples", "0", "--threads", "1", "--inference", "sparse"]) == 0
    sparse = json.loads(result_file.read_text())["sparse"]
    assert sparse["kv"]["schedule"] == schedule["budgets"]
    assert 0 <= sparse["alpha_tail"] <= sparse["alpha_mean"] <= 1 + 1e-5
    assert sparse["kv"]["kv_peak_bytes"] <= sparse["kv"]["kv_dense_bytes"]
