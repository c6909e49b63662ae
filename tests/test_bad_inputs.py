"""Out-of-range values of the commands' own flags, and a malformed schedule file, are refused at
once with one line that names the flag (or file) and the valid range; no model is loaded."""

from __future__ import annotations

import pytest

from sparserl.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--alpha-tau", "1.5"], "alpha_tau must be in (0, 1]"),
    (["calibrate", "--alpha-tau", "0"], "alpha_tau must be in (0, 1]"),
    (["calibrate", "--alpha-bin-size", "0"], "alpha_bin_size must be >= 1"),
    (["calibrate", "--calibration-prompts", "-1"], "--calibration-prompts -1 is out of range"),
    (["calibrate", "--calibration-samples", "0"], "--calibration-samples 0 is out of range"),
    (["calibrate", "--calibration-budgets", "32,-8"], "calibration_budgets must list budgets above kv_window"),
    (["eval", "--n", "0"], "--n 0 is out of range: the number of held-out prompts, at least 1"),
    (["eval", "--samples", "-1"], "--samples -1 is out of range"),
    (["sweep", "--n", "0"], "--n 0 is out of range"),
    (["sweep", "--sample-prompts", "0"], "--sample-prompts 0 is out of range"),
    (["sweep", "--samples", "0"], "--samples 0 is out of range"),
    (["sweep", "--budgets", "0"], "--budgets '0'"),
    (["audit", "--n", "-3"], "--n -3 is out of range"),
])
def test_an_out_of_range_flag_is_one_line_naming_it(argv, needle, tmp_path, capsys):
    out = tmp_path / ("dir" if argv[0] == "calibrate" else "out.json")
    assert main([argv[0], "--out", str(out), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists()


def test_a_malformed_schedule_file_is_one_line_with_the_file_and_line(tmp_path, capsys):
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("bin_size: 16\nbudgets: [24, 32\n  oops: :\n")
    assert main(["train", "--out", str(tmp_path / "run"), "--mode", "sparrow", "--kv-schedule", str(schedule),
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--kv-schedule {schedule}: invalid YAML at line 3" in err and "bin_size: N" in err


def test_a_bug_keeps_its_traceback_while_a_user_error_is_one_line(monkeypatch, tmp_path, capsys):
    """Only errors the user can fix become one line; a ValueError from a bug (inside torch, say) propagates."""
    from sparserl import cli
    from sparserl.errors import ConfigError

    def broken(args):
        raise ValueError("an internal invariant failed")

    def misconfigured(args):
        raise ConfigError("kv_budget must exceed kv_window")

    monkeypatch.setitem(cli.COMMANDS, "presets", cli.Command("list the modes", lambda sub: None, broken))
    with pytest.raises(ValueError, match="internal invariant"):
        main(["presets"])
    monkeypatch.setitem(cli.COMMANDS, "presets", cli.Command("list the modes", lambda sub: None, misconfigured))
    assert main(["presets"]) == 2
    assert capsys.readouterr().err.strip() == "sparserl: error: kv_budget must exceed kv_window"
