"""The one reward guard across a fork, and training on the data-backed tasks with evaluation on.

The defect these tests keep away: a guard that kept a thread pool in the parent (created by step
0's in-process evaluation) made every reward scored in a forked worker time out and score 0, with
no failure counted. Here the tasks' own graders run for real (math-verify, reasoning-gym's scoring
path); only the answer extraction is fixed, so that every completion of a random tiny model is a
known completion whose reward is 1.
"""

from __future__ import annotations

import json
import os

import pytest

from sparserl.cli import main
from sparserl.rewards.runner import RewardError, RewardFunction, RewardRunner
from sparserl.tasks.base import reward_columns
from sparserl.tasks.math_jsonl import MathJsonlTask
from sparserl.tasks.registry import build_task
from sparserl.train.metrics import read_metrics


@pytest.fixture
def half_file(tmp_path):
    """Math problems whose gold answer is always 1/2."""
    path = tmp_path / "half.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}/{2 * i}?", "label": "1/2"}) + "\n" for i in range(1, 21)))
    return path


@pytest.fixture
def answers_point_five(monkeypatch):
    """Every completion answers 0.5; math-verify must still judge 0.5 equal to 1/2."""
    monkeypatch.setattr("sparserl.tasks.grading.extract_math_answer", lambda text: "0.5")


@pytest.fixture
def gym_known_answers(monkeypatch):
    """Every completion is a known one: extraction finds a marker that the dataset scores 1."""
    task = build_task("gym:chain_sum", size=20)
    monkeypatch.setattr("reasoning_gym.utils.extract_answer", lambda text, **kw: "KNOWN")
    monkeypatch.setattr(type(task._dataset("train")), "score_answer",
                        lambda self, answer, entry: float(answer == "KNOWN"))
    return task


def _through_runner(task, completions, examples):
    runner = RewardRunner.for_task(task, timeout_s=20.0)
    scores = runner.score_examples(examples, completions, [[1]] * len(completions))
    return scores, runner.pop_counts()


def test_math_reward_in_a_worker_after_an_in_process_call(half_file, answers_point_five):
    task = MathJsonlTask(half_file)
    examples = task.examples(6, seed=0)
    completions = ["anything"] * 6
    assert task.reward(completions, **reward_columns(examples)) == [1.0] * 6  # in the parent first
    scores, counts = _through_runner(task, completions, examples)
    assert scores == [1.0] * 6
    assert counts["reward_failures"] == counts["reward_timeouts"] == counts["reward_task_batch_failures"] == 0


def test_gym_reward_in_a_worker_after_an_in_process_call(gym_known_answers):
    task = gym_known_answers
    examples = task.examples(4, seed=0)
    assert task.reward(["x"] * 4, **reward_columns(examples)) == [1.0] * 4
    scores, counts = _through_runner(task, ["x"] * 4, examples)
    assert scores == [1.0] * 4 and counts["reward_failures"] == counts["reward_timeouts"] == 0


def _dies_on_some(completions, **kwargs):
    if any("die" in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def _hangs_on_some(completions, **kwargs):
    if any("hang" in c for c in completions):
        import time

        time.sleep(600)
    return [1.0] * len(completions)


def test_every_lost_score_is_counted_per_function_and_in_all(caplog):
    runner = RewardRunner.from_spec("task", "", _dies_on_some, timeout_s=5.0, max_failure_frac=0.9)
    with caplog.at_level("WARNING", logger="sparserl.rewards.runner"):
        scores = runner(prompts=["p"] * 3, completions=["ok", "die", "ok"], completion_ids=[[1]] * 3)
    assert scores == [1.0, 0.0, 1.0]
    counts = runner.pop_counts()
    assert counts["reward_failures"] == counts["reward_task_failures"] == 1
    assert counts["reward_task_batch_failures"] == 1 and counts["reward_timeouts"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("the batch of 3 failed" in m and "died" in m for m in messages) == 1
    assert any("1 of 3 completions failed" in m for m in messages)
    assert runner.pop_counts()["reward_task_failures"] == 0  # popped

    hung = RewardRunner.from_spec("task", "", _hangs_on_some, timeout_s=0.5, max_failure_frac=0.9)
    assert hung(prompts=["p"] * 2, completions=["hang", "ok"], completion_ids=[[1]] * 2) == [0.0, 1.0]
    counts = hung.pop_counts()
    assert counts["reward_timeouts"] == counts["reward_task_timeouts"] == 1 and counts["reward_failures"] == 0


def _length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_last_scores_are_each_functions_own_scores_of_the_last_call():
    runner = RewardRunner([RewardFunction("task", _dies_on_some, 1.0), RewardFunction("length", _length, 0.5)],
                          timeout_s=5.0, max_failure_frac=0.9)
    assert runner.last_scores == {}
    total = runner(prompts=["p"] * 3, completions=["ok", "die", "okay"], completion_ids=[[1]] * 3)
    # task: 1, 0 (its worker died), 1; length: 2, 3, 4; the total weighs length by 0.5.
    assert runner.last_scores == {"task": [1.0, 0.0, 1.0], "length": [2.0, 3.0, 4.0]}
    assert total == [2.0, 1.5, 3.0]
    runner.last_scores["task"][0] = 9.0  # a copy: the record cannot be changed from outside
    assert runner.last_scores["task"] == [1.0, 0.0, 1.0]
    runner(prompts=["p"], completions=["x"], completion_ids=[[1]])
    assert runner.last_scores == {"task": [1.0], "length": [1.0]}  # the last call only


@pytest.mark.parametrize("weights, message", [
    ("1,abc", "'abc' is not a finite number"), ("nan,1", "'nan' is not a finite number"),
    ("1,-inf", "'-inf' is not a finite number"), ("1", "has 1 values for 2 reward functions"),
])
def test_reward_weights_are_one_finite_number_per_function(weights, message):
    with pytest.raises(RewardError, match=f"--reward-weights.*{message}"):
        RewardRunner.from_spec("task,os.path:getsize", weights, _length)


def test_reward_weights_may_be_any_finite_numbers():
    runner = RewardRunner.from_spec("task,os.path:getsize", " 1 , -0.5", _length)
    assert [(f.name, f.weight) for f in runner.functions] == [("task", 1.0), ("getsize", -0.5)]


def test_two_reward_functions_of_one_name_are_refused():
    with pytest.raises(RewardError, match="names two functions 'getsize'"):
        RewardRunner.from_spec("os.path:getsize,genericpath:getsize", "", _length)


def _train_args(model_dir, out, *task_args):
    return ["--model", str(model_dir), "--out", str(out), "--steps", "2", "--max-new-tokens", "6",
            "--prompts-per-step", "2", "--group-size", "3", "--eval-every", "1", "--eval-examples", "2",
            "--threads", "1", "--log-with", "none", "--minibatches", "1", "--reward-timeout", "20", *task_args]


def _assert_every_reward_earned(run):
    records = read_metrics(run / "metrics.jsonl")
    assert "eval_accuracy_dense" in records[0]  # step 0 evaluated in the parent first
    steps = [r for r in records if r.get("step", 0) > 0 and "reward_mean" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["reward_mean"] == 1.0
        assert record["reward_failures"] == record["reward_timeouts"] == 0
    assert all(r["eval_accuracy_dense"] == 1.0 for r in records if "eval_accuracy_dense" in r)


def test_math_jsonl_training_with_evaluation_earns_its_reward(tiny_model_dir, tmp_path, half_file, answers_point_five):
    out = tmp_path / "math"
    assert main(["train", *_train_args(tiny_model_dir, out, "--task", "math_jsonl", "--data-path", str(half_file))]) == 0
    _assert_every_reward_earned(out)


def test_reasoning_gym_training_with_evaluation_earns_its_reward(tiny_model_dir, tmp_path, gym_known_answers):
    out = tmp_path / "gym"
    assert main(["train", *_train_args(tiny_model_dir, out, "--task", "reasoning_gym",
                                       "--gym-dataset", "chain_sum")]) == 0
    _assert_every_reward_earned(out)


def test_compare_on_math_jsonl_earns_its_reward(tiny_model_dir, tmp_path, half_file, answers_point_five):
    out = tmp_path / "cmp"
    assert main(["compare", *_train_args(tiny_model_dir, out, "--task", "math_jsonl", "--data-path", str(half_file)),
                 "--modes", "dense,sparse-rl", "--seeds", "0", "--kv-budget", "8", "--kv-window", "2",
                 "--kv-interval", "2"]) == 0
    for mode in ("dense", "sparse-rl"):
        _assert_every_reward_earned(out / mode / "seed0")
