"""The GRPO trainer end to end through the CLI: modes, resume equality (also after SIGKILL), skips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import kill_part_way_then_resume
from safetensors.torch import load_file

from sparserl.cli import main
from sparserl.config.presets import RECOMMENDED
from sparserl.config.schema import MODES
from sparserl.train.metrics import read_metrics

TIMING_KEYS = {"rollout_s", "recompute_s", "update_s", "step_s", "tokens_per_s", "kv_compress_time_frac"}


def _args(model_dir, out, steps, mode="dense", extra=()):
    return ["train", "--model", str(model_dir), "--out", str(out), "--steps", str(steps), "--mode", mode,
            "--seed", "3", "--prompts-per-step", "4", "--group-size", "4", "--difficulty", "4",
            "--eval-examples", "8", "--eval-every", "2", "--checkpoint-every", "2", "--threads", "1",
            "--kv-budget", "10", "--kv-window", "3", "--kv-interval", "3", "--log-with", "none", "--lr", "3e-3",
            # A random model earns no reward; the entropy bonus gives every step a real gradient.
            "--entropy-coef", "0.05",
            *extra]


def _without_timings(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    assert main(_args(tiny_model_dir, tmp_path / "straight", 4, "sparse-rl")) == 0
    assert main(_args(tiny_model_dir, tmp_path / "resumed", 2, "sparse-rl")) == 0
    assert main(_args(tiny_model_dir, tmp_path / "resumed", 4, "sparse-rl", ["--resume"])) == 0
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]
    assert _without_timings(straight) == _without_timings(resumed)
    # Training moved the weights, identically in both runs.
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_000004" / "policy" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "step_000004" / "policy" / "model.safetensors")
    c = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow  # 37 s; resume equality stays in the default suite (test_resume_gives_the_same_metrics_...)
def test_sigkill_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    steps = 24
    assert main(_args(tiny_model_dir, tmp_path / "straight", steps)) == 0
    killed = tmp_path / "killed"
    kill_part_way_then_resume(_args(tiny_model_dir, killed, steps), killed, steps, lines=8)
    assert _without_timings(read_metrics(tmp_path / "straight" / "metrics.jsonl")) == \
        _without_timings(read_metrics(killed / "metrics.jsonl"))
    leftovers = [p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert len(leftovers) <= 1  # at most the one a kill interrupted, and never read back


def test_naive_sparse_with_a_huge_budget_equals_dense(tiny_model_dir, tmp_path):
    assert main(_args(tiny_model_dir, tmp_path / "dense", 2, "dense")) == 0
    assert main(_args(tiny_model_dir, tmp_path / "sparse", 2, "naive-sparse", ["--kv-budget", "1000000"])) == 0
    dense = _without_timings(read_metrics(tmp_path / "dense" / "metrics.jsonl"))
    sparse = _without_timings(read_metrics(tmp_path / "sparse" / "metrics.jsonl"))
    assert "eval_accuracy_sparse" not in dense[0]  # only on request: it would depend on the budget
    # A sparse sampler that never evicts is the dense policy: α is 1 at every token.
    for record in sparse[1:]:
        assert record.pop("alpha_mean") == pytest.approx(1.0, abs=1e-5)
        assert record.pop("alpha_tail_tokens") > 0
        for key in [k for k in record if k.startswith("alpha_tail")]:
            assert record.pop(key) == pytest.approx(1.0, abs=1e-5)
    assert dense == sparse


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_from_the_cli(tiny_model_dir, tmp_path, mode):
    extra = []
    if mode == "sparrow":  # scheduled rollouts: 8 tokens kept up to length 16, then 12
        (tmp_path / "schedule.yaml").write_text("bin_size: 8\nbudgets: [8, 8, 12]\n")
        extra = ["--kv-schedule", str(tmp_path / "schedule.yaml")]
    assert main(_args(tiny_model_dir, tmp_path / mode, 1, mode, extra)) == 0
    record = read_metrics(tmp_path / mode / "metrics.jsonl")[-1]
    if mode == "sparrow":
        assert {k: v for k, v in record.items() if k.startswith("kv_budget_len_")} == {
            "kv_budget_len_0": 8.0, "kv_budget_len_8": 8.0, "kv_budget_len_16": 12.0}
    for key in ("step", "reward_mean", "reward_std", "accuracy", "response_len_mean", "loss", "pg_loss",
                "clip_frac", "kl", "grad_norm", "rollout_s", "recompute_s", "update_s", "tokens_per_s",
                "xi_mean", "xi_min", "xi_q05", "logppl_sampler", "logppl_old", "kl_sampler_old", "rejected_seq_frac",
                "band_mask_frac", "flagged_veto_frac", "is_batch_norm_factor", "kept_advantage_sum",
                "raw_seq_geo_q05", "raw_seq_k3_q95", "raw_seq_max_log_q95", "flagged_band_frac", "ess", "kv_peak_bytes",
                "kv_dense_bytes", "kv_kept_tokens_mean", "skipped_steps", "eval_accuracy_dense", "walk_exact",
                "eval_walk_exact_dense"):
        assert key in record, key
    assert ("alpha_mean" in record and 0 <= record.get("alpha_tail", 0) <= record["alpha_mean"] <= 1 + 1e-5) \
        == (mode != "dense")
    sparse = mode != "dense"
    assert 0 < record["kv_peak_bytes"] and (not sparse or record["kv_peak_bytes"] < record["kv_dense_bytes"])
    filters = {"sparse-rl": {"veto", "band"}, "sparse-rs": {"veto", "band"}, "geo-rs": {"veto", "geo"},
               "k3-rs": {"k3"}, "seq-mask-tis": {"geo"}, "prefix-veto-tis": {"prefix_veto"}}
    filters["sparrow"] = filters.get(RECOMMENDED, set())  # sparrow applies the recommended correction
    filters = filters.get(mode, set())
    # Each applied filter reports what it removes, and nothing else does.
    assert {k[len("applied_"):-len("_token_frac")] for k in record if k.startswith("applied_")
            and k.endswith("_token_frac")} == filters
    assert all(f"applied_{name}_seq_frac" in record for name in filters)
    if not filters:  # no rejection applied: trains on every token,
        assert record["kept_token_frac"] == 1.0  # while flagged_* still report what the filters would flag
        assert record["rejected_seq_frac"] == 0.0 and record["band_mask_frac"] == 0.0
    if mode == "sparse-rl":  # the applied filters are the flagged ones
        assert record["rejected_seq_frac"] == record["flagged_veto_frac"] == record["applied_veto_seq_frac"]
        assert record["band_mask_frac"] == record["flagged_band_frac"]
    assert (tmp_path / mode / "checkpoints" / "step_000001" / "policy" / "model.safetensors").exists()


def test_a_batch_with_every_token_rejected_skips_the_update(tiny_model_dir, tmp_path):
    out = tmp_path / "starved"
    # A band that excludes xi = 1 rejects every token, whatever the sampler did.
    with pytest.warns(UserWarning, match="skipping the update"):
        assert main(_args(tiny_model_dir, out, 2, "sparse-rl", ["--band", "2.0,3.0"])) == 0
    records = read_metrics(out / "metrics.jsonl")[1:]
    assert [r["skipped"] for r in records] == [1, 1]
    assert records[-1]["skipped_steps"] == 2
    assert all(r["kept_token_frac"] == 0 for r in records)
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    after = load_file(out / "checkpoints" / "step_000002" / "policy" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reference_model_only_when_kl_is_on(tiny_model_dir, tmp_path):
    from sparserl.config.schema import load_config
    from sparserl.train.trainer import GRPOTrainer

    common = dict(model=str(tiny_model_dir), log_with="none", eval_every=0, difficulty=4)
    without, with_kl = (GRPOTrainer(load_config(None, {**common, "kl_coef": kl, "out": str(tmp_path / out)}))
                        for kl, out in ((0.0, "a"), (0.01, "b")))
    assert without.parts.reference is None
    assert with_kl.parts.reference is not None


def test_fused_single_update_equals_a_separate_dense_recompute(tiny_model_dir, tmp_path):
    """With one optimizer step per batch, reusing the update's forward as π_old changes nothing."""
    from sparserl.config.schema import load_config
    from sparserl.train.trainer import GRPOTrainer

    common = dict(model=str(tiny_model_dir), log_with="none", eval_every=0, difficulty=4, seed=5,
                  prompts_per_step=4, group_size=4, minibatches=1, entropy_coef=0.05, kl_coef=0.0,
                  threads=1, lr=1e-2)
    fused = GRPOTrainer(load_config(None, {**common, "out": str(tmp_path / "a"), "micro_batch_size": 16}))
    split = GRPOTrainer(load_config(None, {**common, "out": str(tmp_path / "b"), "micro_batch_size": 8}))
    a, b = fused.train_step(1), split.train_step(1)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
    # Adam's first step is about ±lr per weight whatever the gradient's size, so compare gradients instead.
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["grad_norm"] > 0


def test_dense_rollouts_below_temperature_one_are_on_policy(tiny_model_dir, tmp_path):
    """At T = 0.7 the sampler records log-probs of softmax(logits / 0.7); the dense recompute takes the
    same distribution, so ξ = 1 to rounding and no filter sees a mismatch that is only temperature."""
    assert main(_args(tiny_model_dir, tmp_path / "run", 1, extra=("--temperature", "0.7", "--eval-every", "0"))) == 0
    step = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert step["kl_sampler_old"] < 1e-6
    assert step["raw_seq_geo_q05"] == pytest.approx(1.0, abs=1e-5)
    assert step["raw_seq_geo_q95"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("draft", ["block", "window"])
def test_speculative_rollouts_train_sparse_rl_as_dense_would(tiny_model_dir, tmp_path, draft):
    """Speculative samples are the dense policy's and record its log-probs: under sparse-rl's filters
    ξ = 1, nothing is vetoed or masked, and the step logs what the speculation did."""
    extra = ("--speculative", "true", "--speculative-draft", draft, "--kv-budget", "12", "--temperature", "0.8",
             *(("--block-page-size", "2", "--block-dense-layers", "0") if draft == "block" else ()))
    assert main(_args(tiny_model_dir, tmp_path / draft, 1, "sparse-rl", extra)) == 0
    record = read_metrics(tmp_path / draft / "metrics.jsonl")[-1]
    assert record["kl_sampler_old"] < 1e-6 and abs(record["xi_min"] - 1) < 1e-4
    assert record["rejected_seq_frac"] == record["band_mask_frac"] == 0.0
    assert 0 < record["spec_acceptance_rate"] <= 1 and record["spec_tokens_per_verification"] >= 1
    assert "alpha_mean" not in record  # no lossy sampler to measure


def test_alpha_is_measured_at_step_one_and_every_n_steps_after(tiny_model_dir, tmp_path, capsys):
    assert main(_args(tiny_model_dir, tmp_path / "every2", 3, "geo-rs", ("--alpha-every", "2"))) == 0
    measured = [r["step"] for r in read_metrics(tmp_path / "every2" / "metrics.jsonl") if "alpha_mean" in r]
    assert measured == [1, 3]
    assert main(_args(tiny_model_dir, tmp_path / "never", 2, "geo-rs", ("--alpha-every", "0"))) == 0
    assert not any("alpha_mean" in r for r in read_metrics(tmp_path / "never" / "metrics.jsonl"))
    assert main(_args(tiny_model_dir, tmp_path / "bad", 1, "sparrow", ("--kv-schedule", "adaptive",
                                                                        "--alpha-every", "2"))) == 2
    assert "leave --alpha-every at 1" in capsys.readouterr().err


def test_kept_vs_vetoed_diagnostics_by_hand():
    from sparserl.train.step_batch import kept_vs_rejected

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    lengths = torch.tensor([10, 20, 30, 40])
    keep = torch.tensor([True, True, False, False])
    assert kept_vs_rejected(rewards, lengths, keep, "flagged_", "vetoed") == {
        "flagged_reward_kept_mean": 0.5, "flagged_response_len_kept_mean": 15.0,
        "flagged_reward_vetoed_mean": 0.5, "flagged_response_len_vetoed_mean": 35.0}
    assert kept_vs_rejected(rewards, lengths, torch.ones(4, dtype=torch.bool), "", "rejected") == {
        "reward_kept_mean": 0.5, "response_len_kept_mean": 25.0}


def test_kept_advantages_by_hand():
    from sparserl.train.step_batch import kept_advantages

    # Group advantages (+1, -1, +1, -1) sum to 0; the filters drop row 1 entirely and half of row 2.
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    keep = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]], dtype=torch.float32)
    out = kept_advantages(advantages, keep)
    assert out["kept_advantage_sum"] == 1.0  # +1 +1 -1: a net push up
    assert out["kept_advantage_mean"] == pytest.approx(1 / 3)
    assert out["kept_advantage_token_mean"] == pytest.approx((2 + 1 - 2) / 5)


def test_all_rejected_for_k_steps_in_a_row_is_an_error(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "starved"
    with pytest.warns(UserWarning, match="outside the range"):
        code = main(_args(tiny_model_dir, out, 5, "sparse-rl", ["--band", "2.0,3.0", "--max-rejected-steps", "2"]))
    assert code != 0
    message = capsys.readouterr().err
    assert "rejected every response token for 2 steps in a row" in message and "--kv-budget" in message
    assert [r["skipped"] for r in read_metrics(out / "metrics.jsonl")[1:]] == [1]  # step 2 raised before logging


def test_rejected_rows_leave_the_baseline_when_asked(tiny_model_dir, tmp_path):
    # Step 1's rollouts are the same in every run (same seed and weights): read the median k3 of the
    # sequences, then filter at it, so that about half the sequences are removed whole.
    main(_args(tiny_model_dir, tmp_path / "probe", 1, "k3-rs"))
    median = read_metrics(tmp_path / "probe" / "metrics.jsonl")[-1]["raw_seq_k3_q50"]
    sums = {}
    for flag in ("true", "false"):
        out = tmp_path / flag
        main(_args(tiny_model_dir, out, 1, "k3-rs", ["--seq-k3-max", repr(median), "--rejected-in-baseline", flag]))
        record = read_metrics(out / "metrics.jsonl")[-1]
        assert 0 < record["rejected_seq_frac"] < 1
        sums[flag] = record["kept_advantage_sum"]
    # Baselines over the kept rows only: each group's kept advantages sum to zero.
    assert sums["false"] == pytest.approx(0.0, abs=1e-5)


def test_a_preset_from_yaml_with_flags_on_top(tiny_model_dir, tmp_path):
    from sparserl.config.schema import ConfigError, load_config

    preset = tmp_path / "wide-geo.yaml"
    preset.write_text("name: wide-geo\nbase: geo-rs\ncorrection: {seq_geo_bounds: [0.5, 2.0], is_mode: truncate}\n")
    config = load_config(overrides={"mode": str(preset), "veto_threshold": "none"})
    assert config.correction.seq_geo_bounds == (0.5, 2.0) and config.correction.is_mode == "truncate"
    assert config.correction.veto_threshold is None  # the flag wins over the preset's base
    assert main(_args(tiny_model_dir, tmp_path / "run", 1, str(preset))) == 0
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert "applied_geo_seq_frac" in record and "alpha_mean" in record  # sparse rollouts, from the base
    (tmp_path / "bad.yaml").write_text("base: geo-rs\ncorrection: {seq_geo: [0.5, 2.0]}\n")
    with pytest.raises(ConfigError, match="unknown: \\['seq_geo'\\]"):
        load_config(overrides={"mode": str(tmp_path / "bad.yaml")})
    with pytest.raises(ConfigError, match="mode 'geo_rs' is unknown"):
        load_config(overrides={"mode": "geo_rs"})


def test_block_sparse_training_with_distill_sparse_replays_the_pages(tiny_model_dir, tmp_path):
    """`--sparsity block`: the full cache is kept, fewer keys are attended, and DistillSparse's
    replay (which must reproduce the sampler through the recorded pages) trains."""
    out = tmp_path / "block"
    block = ["--sparsity", "block", "--block-page-size", "4", "--block-dense-layers", "0", "--kv-budget", "12",
             "--distill-sparse", "true", "--distill-rank", "2"]
    assert main(_args(tiny_model_dir, out, 2, "sparse-tis", block)) == 0
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert all(r["kv_attended_frac"] < 0.9 and r["kv_peak_bytes"] >= r["kv_dense_bytes"] and r["kv_compressions"] == 0 for r in steps)
    # The replay reproduces the block-sparse sampler, which reads fewer keys than the dense policy: they differ.
    assert all(r["distill_logp_gap"] > 0 and r["distill_grad_norm"] > 0 for r in steps)


def test_a_sudden_slow_step_is_said_in_one_line():
    from sparserl.train.trainer import slow_step_message

    assert slow_step_message([1.0, 1.1], 50.0, 3) is None  # too few steps to know the run's pace
    assert slow_step_message([1.0, 1.2, 0.9, 1.1], 4.1, 5) is None  # median 1.05: 4.1 s is within 4x (4.2 s)
    message = slow_step_message([1.0, 1.2, 0.9, 1.1], 13.0, 5)
    assert message is not None and "\n" not in message
    assert "13.0 s, 12.4x this run's median step (1.1 s)" in message and "--threads 1" in message


def test_accuracy_is_the_tasks_own_verdict_not_the_weighted_reward(tiny_model_dir, tmp_path):
    """A format bonus beside the task's reward lifts the reward, never the accuracy: a random model solves
    nothing, so every response's weighted reward is its bonus (1) and its accuracy 0. Without the task in the
    list, the task's reward is scored anyway (weight 0) for the accuracy."""
    bonus = tmp_path / "bonus.py"
    bonus.write_text("def always(completions, **_):\n    return [1.0] * len(completions)\n")
    for name, funcs, weights in (("both", f"task,{bonus}:always", "1,1"), ("bonus", f"{bonus}:always", "1")):
        out = tmp_path / name
        assert main(_args(tiny_model_dir, out, 1, extra=["--reward-funcs", funcs, "--reward-weights", weights,
                                                          "--eval-every", "0"])) == 0
        record = read_metrics(out / "metrics.jsonl")[-1]
        assert record["reward_task_mean"] == 0 and record["reward_always_mean"] == 1
        assert record["reward_mean"] == 1 and record["accuracy"] == 0


def test_a_batch_without_signal_does_not_move_the_weights():
    """With every advantage 0 the gradient is exactly 0, yet AdamW's step would still move each weight along its
    moments (checked below on a copy): the update skips it, so weights and optimizer state stay as they were."""
    import copy

    from conftest import make_tiny_model

    from sparserl.config.schema import load_config
    from sparserl.learner.update import ppo_update
    from sparserl.rollout.batch import SamplingConfig
    from sparserl.rollout.engine.engine import RolloutEngine

    model, tokenizer = make_tiny_model(seed=4)
    prompts = [tokenizer("^aBbCcA|a3").input_ids] * 4
    batch = RolloutEngine(model, None).generate(prompts, SamplingConfig(
        max_new_tokens=6, temperature=1.0, eos_token_id=None, pad_token_id=tokenizer.pad_token_id), seeds=[1, 2, 3, 4])
    train = load_config(overrides={"minibatches": "1", "kl_coef": "0", "entropy_coef": "0"}).train
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logp_old = batch.sampler_logprobs.clone()
    ones = torch.ones_like(logp_old)
    generator = torch.Generator().manual_seed(0)

    def update(advantages):
        return ppo_update(model, optimizer, batch, logp_old, None, advantages, ones, batch.response_mask.bool(),
                          generator, train, 1.0)

    assert update(torch.tensor([1.0, -1.0, 0.5, -0.5]))["optimizer_steps"] == 1
    before = copy.deepcopy(model.state_dict())
    drifting = copy.deepcopy(model)
    drift_optimizer = torch.optim.AdamW(drifting.parameters(), lr=1e-2)
    drift_optimizer.load_state_dict(optimizer.state_dict())
    for parameter in drifting.parameters():
        parameter.grad = torch.zeros_like(parameter)
    drift_optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in drifting.state_dict().items())  # what plain AdamW does
    state = copy.deepcopy(optimizer.state_dict())
    result = update(torch.zeros(4))
    assert result["optimizer_steps"] == 0 and result["grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state["state"][i]["exp_avg"], optimizer.state_dict()["state"][i]["exp_avg"])
               for i in state["state"])


def test_a_run_that_fails_to_build_starts_no_rollout_workers(tiny_model_dir, tmp_path, monkeypatch):
    """The rollout backend (a Ray cluster with --rollout-workers) starts last: a setting that fails while the run
    builds (here the metrics logger) leaves nothing running and the run directory unlocked."""
    from sparserl.config.schema import load_config
    from sparserl.train import trainer as trainer_module

    started = []
    monkeypatch.setattr(trainer_module, "make_rollouts", lambda *args: started.append(args))

    def broken_logger(*args, **kwargs):
        raise RuntimeError("tracker unreachable")

    monkeypatch.setattr(trainer_module, "MetricsLogger", broken_logger)
    config = load_config(None, {"model": str(tiny_model_dir), "out": str(tmp_path / "run"), "log_with": "none",
                                "difficulty": 4, "threads": 1})
    with pytest.raises(RuntimeError, match="tracker unreachable"):
        trainer_module.GRPOTrainer(config)
    assert started == []
    monkeypatch.undo()
    trainer_module.GRPOTrainer(config).close()  # the directory was released: a second trainer takes it


def test_closing_an_untrained_trainer_stops_its_rollout_workers(tiny_model_dir, tmp_path, monkeypatch):
    from sparserl.config.schema import load_config
    from sparserl.train import trainer as trainer_module

    closed = []

    class Backend:
        def close(self):
            closed.append(True)

    monkeypatch.setattr(trainer_module, "make_rollouts", lambda *args: Backend())
    config = load_config(None, {"model": str(tiny_model_dir), "out": str(tmp_path / "run"), "log_with": "none",
                                "difficulty": 4, "threads": 1})
    trainer = trainer_module.GRPOTrainer(config)
    trainer.close()
    trainer.close()  # idempotent
    assert closed == [True]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_pi_old_is_the_samplers_policy_on_a_model_with_dropout(tmp_path, minibatches):
    """With dropout in the model, every learner forward still runs as the sampler does (dropout off): the dense
    sampler's recorded log-probs are π_old's, ξ = 1, on the fused path (one optimizer step, π_old from the update's
    own forward) and on the separate recompute alike."""
    from conftest import make_tiny_model

    from sparserl.config.schema import load_config
    from sparserl.train.trainer import GRPOTrainer

    model, tokenizer = make_tiny_model(seed=2, attention_dropout=0.5)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = load_config(None, {"model": str(tmp_path / "model"), "out": str(tmp_path / "run"), "log_with": "none",
                                "eval_every": 0, "difficulty": 4, "prompts_per_step": 4, "group_size": 4,
                                "minibatches": minibatches, "kl_coef": 0.0, "threads": 1, "entropy_coef": 0.05})
    trainer = GRPOTrainer(config)
    record = trainer.train_step(1)
    trainer.close()
    assert record["kl_sampler_old"] < 1e-6 and record["xi_min"] == pytest.approx(1.0, abs=1e-4)
