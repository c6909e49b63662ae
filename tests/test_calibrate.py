"""Calibration: the schedule rule by hand, and `calibrate` then `eval --kv-schedule` on the shipped model."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml

from sparserl.cli import main
from sparserl.rollout.sparsity.budgets import BinnedBudget


def test_binned_schedule_by_hand():
    schedule = BinnedBudget(16, (24, 48, 96))
    assert [schedule.budget(n) for n in (0, 15, 16, 40, 500)] == [24, 24, 48, 96, 96]
    assert schedule.max_budget == 96
    with pytest.raises(ValueError, match="must not decrease"):
        BinnedBudget(16, (48, 24))


def test_calibrate_then_eval_with_the_schedule(tmp_path, capsys):
    out = tmp_path / "cal"
    assert main(["calibrate", "--out", str(out), "--alpha-tau", "0.86", "--calibration-budgets", "32,64,96,160",
                 "--calibration-prompts", "8", "--calibration-samples", "2", "--threads", "1"]) == 0
    for name in ("schedule.yaml", "tails.png", "calibration.md", "calibration.json"):
        assert (out / name).exists(), name
    schedule = yaml.safe_load((out / "schedule.yaml").read_text())
    assert schedule["tau"] == 0.86 and schedule["bin_size"] == 16
    assert schedule["budgets"] == sorted(schedule["budgets"])
    # On the calibration prompts the chosen schedule holds the tail in every bin it could rescue.
    calibration = json.loads((out / "calibration.json").read_text())
    assert len(calibration["unmet_bins"]) < len(calibration["schedule_tails"])  # some bins were rescued
    assert all(tail >= 0.86 for start, tail in calibration["schedule_tails"].items()
               if int(start) not in calibration["unmet_bins"])
    result_file = tmp_path / "eval.json"
    assert main(["eval", "--out", str(result_file), "--kv-schedule", str(out / "schedule.yaml"), "--n", "40",
                 "--samples", "0", "--threads", "1", "--inference", "sparse"]) == 0
    sparse = json.loads(result_file.read_text())["sparse"]
    assert sparse["kv"]["schedule"] == schedule["budgets"]
    assert 0 <= sparse["alpha_tail"] <= sparse["alpha_mean"] <= 1 + 1e-5
    assert sparse["kv"]["kv_peak_bytes"] <= sparse["kv"]["kv_dense_bytes"]


def test_adaptive_budget_rule_by_hand():
    from sparserl.rollout.sparsity.budgets import AdaptiveBudget

    schedule = AdaptiveBudget(initial=40, bin_size=16, tau=0.86, step=8, floor=9)
    # Bin 32 fails: every bin up to it grows (an early eviction broke it); new bins start at 40.
    schedule.update({0: 1.0, 16: 0.99, 32: 0.5})
    assert schedule.budgets == [48, 48, 48]
    # Bin 48 (new) fails: all four grow.
    schedule.update({16: 1.0, 48: 0.2})
    assert schedule.budgets == [56, 56, 56, 56]
    # Between τ and τ + margin: hold.
    schedule.update({16: 0.88, 48: 0.95})
    assert schedule.budgets == [56, 56, 56, 56]
    # Clearly above everywhere: give back a notch, never below the floor.
    schedule.update({16: 1.0, 48: 0.99})
    assert schedule.budgets == [48, 48, 48, 48] and schedule.snapshot().budget(10_000) == 48
    tiny = AdaptiveBudget(initial=12, bin_size=16, tau=0.5, step=8, floor=9)
    tiny.update({0: 1.0})
    assert tiny.budgets == [9]


def test_adaptive_training_logs_its_budgets_and_resumes_exactly(tiny_model_dir, tmp_path):
    from sparserl.train.metrics import read_metrics

    def args(out, steps, *extra):
        return ["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", str(steps), "--mode",
                "naive-sparse", "--kv-schedule", "adaptive", "--alpha-tau", "0.99", "--kv-budget", "10",
                "--kv-window", "3", "--kv-interval", "3", "--alpha-bin-size", "8", "--difficulty", "4",
                "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "2",
                "--threads", "1", "--log-with", "none", *extra]

    assert main(args(tmp_path / "straight", 4)) == 0
    assert main(args(tmp_path / "resumed", 2)) == 0
    assert main(args(tmp_path / "resumed", 4, "--resume")) == 0
    drop = ("rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac")
    straight, resumed = ([{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path / d / "metrics.jsonl")]
                         for d in ("straight", "resumed"))
    assert straight == resumed
    budgets = [{k: v for k, v in r.items() if k.startswith("kv_budget_len_")} for r in straight]
    assert budgets[0] == {"kv_budget_len_0": 10.0}
    assert any(b != budgets[0] for b in budgets[1:])  # the random tiny model misses τ = 0.99: budgets move


def test_recalibration_during_training_sets_the_schedule_and_resumes_exactly(tiny_model_dir, tmp_path):
    from sparserl.train.metrics import read_metrics

    def args(out, steps, tau, *extra):
        return ["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", str(steps), "--mode",
                "naive-sparse", "--recalibrate-every", "2", "--calibration-budgets", "6,10,40", "--alpha-tau", tau,
                "--calibration-prompts", "2", "--calibration-samples", "2", "--kv-budget", "10", "--kv-window", "3",
                "--kv-interval", "3", "--alpha-bin-size", "8", "--difficulty", "4", "--prompts-per-step", "4",
                "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "1", "--threads", "1",
                "--log-with", "none", *extra]

    # Any tail passes a vanishing τ: every bin gets the smallest budget, from step 1 on.
    assert main(args(tmp_path / "loose", 1, "1e-9")) == 0
    record = read_metrics(tmp_path / "loose" / "metrics.jsonl")[-1]
    assert record["recalibrated"] == 1
    budgets = {k: v for k, v in record.items() if k.startswith("kv_budget_len_")}
    assert budgets and set(budgets.values()) == {6.0}
    # Recalibrated at steps 1 and 3; a run resumed after step 3 keeps step 3's schedule for step 4.
    assert main(args(tmp_path / "straight", 4, "0.99")) == 0
    assert main(args(tmp_path / "resumed", 3, "0.99")) == 0
    assert main(args(tmp_path / "resumed", 4, "0.99", "--resume")) == 0
    drop = ("rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac", "recalibrate_s")
    straight, resumed = ([{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path / d / "metrics.jsonl")]
                         for d in ("straight", "resumed"))
    assert straight == resumed
    assert [r.get("recalibrated", 0) for r in straight] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="choose one"):
        from sparserl.config.schema import load_config
        load_config(overrides={"mode": "naive-sparse", "recalibrate_every": 2, "kv_schedule": "adaptive"})


def test_recalibration_measures_the_sampler_with_its_distill_sparse_adapter():
    """Training samples with DistillSparse's adapter on, so the calibration must too: at budgets that never
    bind, the plain policy's sparse sampler is the dense one (α = 1), and only the adapter moves the tails."""
    import torch
    from conftest import make_tiny_model

    from sparserl.config.schema import load_config
    from sparserl.rollout.adapter import AdapterConfig, SamplerAdapter
    from sparserl.tasks.registry import task_from_config
    from sparserl.train.calibration import calibrate_schedule

    model, tokenizer = make_tiny_model(seed=3)
    adapter = SamplerAdapter(model, AdapterConfig(rank=2))
    with torch.no_grad():
        for name, parameter in adapter.parameters.items():
            if "lora_B" in name:
                parameter.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    rollout = load_config(None, {"difficulty": 3}).rollout
    examples = task_from_config(load_config(None, {"difficulty": 3}).task, tokenizer).examples(4, seed=0)

    def calibrate(context):
        return calibrate_schedule(model.eval(), tokenizer, 12, rollout, examples, [4096], tau=0.86, bin_size=4,
                                  samples=2, seed=0, progress=False, sampler_context=context).fixed_tails[4096]

    plain = calibrate(contextlib.nullcontext)
    adapted = calibrate(adapter.active)
    assert plain and all(tail == pytest.approx(1.0, abs=1e-5) for tail in plain.values())
    assert min(adapted.values()) < 0.99


def test_calibrate_says_what_its_schedule_saves_and_the_tau_where_saving_starts(tiny_model_dir, tmp_path, capsys):
    """A τ no evicting budget reaches picks the budget that holds every sequence whole: it saves nothing, which is
    said in one line with the τ at which budget 6 would pass (worked out here from the fixed budgets' tails); at
    that τ the schedule evicts and saves memory by peak."""
    settings = ["--model", str(tiny_model_dir), "--calibration-budgets", "6,4096", "--alpha-bin-size", "8",
                "--kv-window", "3", "--kv-interval", "3", "--difficulty", "4", "--calibration-prompts", "2",
                "--calibration-samples", "2", "--threads", "1"]
    assert main(["calibrate", "--out", str(tmp_path / "strict"), "--alpha-tau", "0.99999", *settings]) == 0
    strict = json.loads((tmp_path / "strict" / "calibration.json").read_text())
    assert set(strict["schedule"]) == {4096}
    assert strict["kv_saved"] == 0.0 and strict["kv_peak_bytes"]["schedule"] == strict["kv_peak_bytes"]["dense"]
    assert strict["kv_saved_greedy"] == 0.0
    # Budget 6 is below what a dense cache holds in every bin the rollouts reach (their prompts alone are longer).
    bins = [int(start) for start in strict["tails"]["6"]]
    assert min(bins) + 8 > 6 and strict["longest_sequence"] > 6
    starts = max(strict["tails"]["6"].values())
    assert strict["saving_starts_at_tau"] == pytest.approx(starts)
    said = f"{int(starts * 1000) / 1000:.3f}"
    warning = [line for line in capsys.readouterr().err.splitlines() if "saves no KV memory" in line]
    assert len(warning) == 1 and warning[0].startswith("calibrate: warning:")
    assert warning[0] == f"calibrate: warning: {strict['kv_warning']}"
    assert f"would start to evict at --alpha-tau {said} or lower" in warning[0]
    assert "saves no KV memory" in (tmp_path / "strict" / "calibration.md").read_text()

    assert main(["calibrate", "--out", str(tmp_path / "loose"), "--alpha-tau", said, *settings]) == 0
    loose = json.loads((tmp_path / "loose" / "calibration.json").read_text())
    assert 6 in loose["schedule"]
    assert loose["kv_peak_bytes"]["dense"] == strict["kv_peak_bytes"]["dense"]  # the same prompts, seed and samples
    assert loose["kv_peak_bytes"]["schedule"] < loose["kv_peak_bytes"]["dense"]
    peaks = loose["kv_peak_bytes"]
    assert loose["kv_saved"] == pytest.approx(1 - peaks["schedule"] / peaks["dense"])
    assert loose["kv_saved_greedy"] > 0  # every prompt is longer than 6 tokens: greedy answers evict too
    assert "saves no KV memory" not in capsys.readouterr().err


def test_where_saving_starts_by_hand():
    from sparserl.experiments.calibrate import saving_starts_at

    tails = {24: {0: 1.0, 16: 0.70, 32: 0.40}, 40: {0: 1.0, 16: 1.0, 32: 0.90}, 96: {0: 1.0, 16: 1.0, 32: 1.0}}
    # Sequences of at most 40 tokens: a dense cache holds 16, 32 and 40 tokens by the ends of the three bins, so
    # 24 evicts in bins 16 and 32 (0.70, 0.40), 40 and 96 nowhere; bin 0 evicts under no budget.
    assert saving_starts_at(tails, bin_size=16, longest=40) == pytest.approx(0.70)
    # Sequences of 60 tokens: bin 32 holds up to 48, so 40 evicts there too (0.90).
    assert saving_starts_at(tails, bin_size=16, longest=60) == pytest.approx(0.90)
    # Sequences of 20 tokens: no budget tried evicts.
    assert saving_starts_at(tails, bin_size=16, longest=20) is None
