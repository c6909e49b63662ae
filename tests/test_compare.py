"""`sparserl compare` end to end on a tiny model: every mode, same seed, report, resume."""

from __future__ import annotations

import json

from sparserl.cli import main
from sparserl.report.plots import PLOTS


def _args(model_dir, out, modes):
    return ["compare", "--model", str(model_dir), "--out", str(out), "--modes", modes, "--steps", "2",
            "--seed", "1", "--prompts-per-step", "2", "--group-size", "4", "--difficulty", "4",
            "--eval-examples", "8", "--eval-every", "1", "--threads", "1", "--kv-budget", "10",
            "--kv-window", "3", "--kv-interval", "3", "--log-with", "none", "--minibatches", "1"]


def test_compare_runs_every_mode_and_writes_the_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    preset = tmp_path / "my-geo.yaml"  # a user's preset runs next to the built-in ones, under its own name
    preset.write_text("base: geo-rs\ncorrection: {seq_geo_bounds: [0.5, 2.0]}\n")
    assert main(_args(tiny_model_dir, out, f"dense,naive-sparse,sparse-rl,sparse-tis,{preset}")) == 0
    modes = "dense,naive-sparse,sparse-rl,sparse-tis,my-geo"
    printed = capsys.readouterr().out
    saved = (out / "my-geo" / "seed1" / "config.yaml").read_text()
    assert "seq_geo_bounds:\n  - 0.5\n  - 2.0" in saved and "veto_threshold: 0.0001" in saved
    assert "veto_threshold: null" in (out / "sparse-tis" / "seed1" / "config.yaml").read_text()
    for mode in modes.split(","):
        final = json.loads((out / mode / "seed1" / "final_eval.json").read_text())
        assert final["steps"] == 2
        assert 0 <= final["dense"]["accuracy"] <= 1 and "kv" in final["sparse"]
        assert f"| {mode} |" in printed
    for plot in PLOTS:
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "Held-out acc (sparse inf.)" in report and "Regime: KV budget 10" in printed
    # The same prompts reach every mode: step-1 rollouts of dense and naive-sparse share their prompts,
    # so with the same seed their first rewards can only differ through the compressed cache.
    first = {m: json.loads((out / m / "seed1" / "metrics.jsonl").read_text().splitlines()[1]) for m in modes.split(",")}
    assert first["naive-sparse"]["kv_compressions"] > 0 and first["dense"]["kv_compressions"] == 0


def test_compare_resumes_by_skipping_finished_runs_and_adds_seeds(tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "cmp"
    assert main(_args(tiny_model_dir, out, "dense")) == 0
    before = (out / "dense" / "seed1" / "final_eval.json").read_text()
    caplog.set_level("INFO")
    assert main(_args(tiny_model_dir, out, "dense,sparse-rl") + ["--seeds", "1,2"]) == 0
    assert "already done" in caplog.text
    assert (out / "dense" / "seed1" / "final_eval.json").read_text() == before
    for mode in ("dense", "sparse-rl"):
        assert (out / mode / "seed2" / "final_eval.json").exists()
    # Another seed draws other prompts: its first step differs from seed 1's.
    first = [json.loads((out / "dense" / f"seed{s}" / "metrics.jsonl").read_text().splitlines()[1]) for s in (1, 2)]
    assert first[0]["logppl_sampler"] != first[1]["logppl_sampler"]
    manifest = json.loads((out / "compare.json").read_text())
    assert manifest["modes"] == ["dense", "sparse-rl"] and manifest["seeds"] == [1, 2]


def test_compare_with_distill_sparse_trains_the_adapter_in_sparse_modes_only(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main([*_args(tiny_model_dir, out, "dense,sparse-tis"), "--distill-sparse", "true", "--distill-rank", "2"]) == 0
    assert "distill_sparse: false" in (out / "dense" / "seed1" / "config.yaml").read_text()
    assert "distill_sparse: true" in (out / "sparse-tis" / "seed1" / "config.yaml").read_text()
    assert (out / "sparse-tis" / "seed1" / "checkpoints" / "step_000002" / "sampler_adapter").is_dir()
    assert "sparse-tis + DistillSparse" in (out / "report.md").read_text()


def test_compare_extends_its_runs_to_more_steps_and_refuses_fewer(tiny_model_dir, tmp_path, capsys):
    """A comparison rerun with more steps resumes its finished runs and evaluates them again (the report's step
    count is then true); with fewer steps than a run has trained it is refused before any work."""
    out = tmp_path / "cmp"
    assert main(_args(tiny_model_dir, out, "dense")) == 0
    longer = _args(tiny_model_dir, out, "dense")
    longer[longer.index("--steps") + 1] = "3"
    assert main(longer) == 0
    run = out / "dense" / "seed1"
    assert json.loads((run / "final_eval.json").read_text())["steps"] == 3
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    capsys.readouterr()
    assert main(_args(tiny_model_dir, out, "dense")) == 2
    assert "trained more steps (dense/seed1: 3); give --steps 3 or more" in capsys.readouterr().err


def test_compare_refuses_two_modes_of_one_name(tiny_model_dir, tmp_path, capsys):
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: dense\nbase: sparse-rl\n")
    out = tmp_path / "cmp"
    assert main(_args(tiny_model_dir, out, f"dense,{preset}")) == 2
    assert "share the run name dense" in capsys.readouterr().err and not out.exists()
