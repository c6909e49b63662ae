"""Rewards called TRL's way, weighted, in worker processes killed on timeout; TRL's own doc examples
run unchanged, and every expected score is worked out by hand."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest

from sparserl.cli import main
from sparserl.rewards.runner import RewardError, RewardRunner, load_reward_function
from sparserl.tasks.base import Example, reward_columns
from sparserl.tasks.math_jsonl import MathJsonlTask
from sparserl.train.metrics import read_metrics

DOC = Path(__file__).parent / "data" / "trl_doc_rewards.py"


@pytest.fixture(autouse=True)
def _keep_global_state(monkeypatch):
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)


def _runner(spec: str, weights: str = "", **options) -> RewardRunner:
    return RewardRunner.from_spec(spec, weights, task_reward=lambda completions, **kw: [1.0] * len(completions),
                                  **options)


def _call(runner, completions, ids=None, **columns):
    return runner(prompts=["p"] * len(completions), completions=completions,
                  completion_ids=ids or [[7] * len(c) for c in completions], **columns)


def test_trl_doc_examples_run_unchanged():
    runner = _runner(f"{DOC}:reward_len,{DOC}:reward_func,{DOC}:reward_boxed,task", "1,0.5,2,1")
    completions = ["x" * 20, r"\boxed{4}", "abc"]
    ids = [[1] * 5, [1, 2], [3, 3, 3, 3]]
    # reward_len: -|20 - chars| = 0, -11, -17; reward_func: token counts 5, 2, 4 (ids, not text);
    # reward_boxed against ground_truth "4": 0, 1, 0; task: 1 each.
    scores = _call(runner, completions, ids, ground_truth=["4", "4", "4"])
    assert scores == [0 + 0.5 * 5 + 0 + 1, -11 + 0.5 * 2 + 2 * 1 + 1, -17 + 0.5 * 4 + 0 + 1]
    counts = runner.pop_counts()
    assert counts["reward_reward_len_mean"] == pytest.approx(-28 / 3)
    assert counts["reward_reward_func_mean"] == pytest.approx(11 / 3)
    assert counts["reward_task_mean"] == 1.0
    assert counts["reward_failures"] == counts["reward_timeouts"] == 0


def test_a_hung_reward_is_killed_and_only_its_completion_scores_zero():
    runner = _runner(f"{DOC}:hangs", timeout_s=0.5)
    started = time.perf_counter()
    assert _call(runner, ["fine", "hang here", "fine too"]) == [1.0, 0.0, 1.0]
    assert time.perf_counter() - started < 10  # not the 600 s the function sleeps
    assert runner.pop_counts()["reward_timeouts"] == 1


def test_too_many_failures_stop_with_the_functions_error():
    runner = _runner(f"{DOC}:raises_on_some")
    assert _call(runner, ["bad one", "ok", "ok", "ok"]) == [0.0, 0.5, 0.5, 0.5]
    assert runner.pop_counts()["reward_failures"] == 1
    with pytest.raises(RewardError, match=r"raises_on_some failed on 3 .*of 4 completions.*cannot score this one"):
        _call(runner, ["bad", "bad", "bad", "ok"])


@pytest.mark.parametrize("spec, needle", [("nomodule_xyz:f", "cannot import nomodule_xyz"),
                                          (f"{DOC}:nope", "has no function 'nope'"), ("just_a_name", "MODULE:FUNCTION")])
def test_bad_reward_specs(spec, needle):
    with pytest.raises(RewardError, match=needle):
        load_reward_function(spec)


def test_dataset_fields_become_columns(tmp_path):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i), "ground_truth": str(i), "topic": "t"}) + "\n"
                            for i in range(10)))
    examples = MathJsonlTask(data).examples(2, seed=0)
    columns = reward_columns(examples, repeat=2)
    assert columns["ground_truth"] == [e.label for e in examples for _ in range(2)]
    assert columns["topic"] == ["t"] * 4 and "prompt" not in columns
    # A key only some examples have is not a column (it could not line up).
    mixed = [Example("a", "1", extra={"x": 1}), Example("b", "2", extra={})]
    assert "x" not in reward_columns(mixed)


def test_train_with_weighted_trl_rewards_logs_each_mean(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "1", "--difficulty", "4",
                 "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--threads", "1",
                 "--log-with", "none", "--reward-funcs", f"task,{DOC}:reward_func", "--reward-weights", "1,0.01"]) == 0
    record = read_metrics(out / "metrics.jsonl")[-1]
    # Means are linear: the weighted sum of the functions' means is the mean reward.
    assert record["reward_mean"] == pytest.approx(record["reward_task_mean"] + 0.01 * record["reward_reward_func_mean"])
    assert record["reward_reward_func_mean"] == pytest.approx(record["response_len_mean"])  # token counts


def test_a_reward_that_cannot_take_the_columns_stops_training(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "1", "--difficulty", "4",
                 "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0", "--threads", "1",
                 "--log-with", "none", "--reward-funcs", f"{DOC}:reward_boxed"]) == 2
    err = capsys.readouterr().err
    assert "reward_boxed failed on 4" in err and "ground_truth" in err
