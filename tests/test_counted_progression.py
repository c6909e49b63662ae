"""The counted progression (issue 42's paper-regime task), checked against answers worked by hand and arithmetic
of our own, and through the config, as a user selects it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparserl.config.schema import load_config
from sparserl.errors import ConfigError
from sparserl.tasks.counted_progression import CountedProgressionTask, demonstration
from sparserl.tasks.registry import task_from_config


def test_counted_progression_answers_by_hand():
    # 43 + 7 = 50, + 7 = 57, + 7 = 64, + 7 = 71
    assert demonstration(43, 7, 4, count_every=2) == ("1: 43 + 7 = 50\n2/4: 50 + 7 = 57\n3: 57 + 7 = 64\n"
                                                      "4/4: 64 + 7 = 71\nThe result is 71.")
    assert demonstration(43, 7, 4, count_every=1) == ("1/4: 43 + 7 = 50\n2/4: 50 + 7 = 57\n3/4: 57 + 7 = 64\n"
                                                      "4/4: 64 + 7 = 71\nThe result is 71.")
    assert demonstration(43, 7, 4, count_every=0) == ("1: 43 + 7 = 50\n2: 50 + 7 = 57\n3: 57 + 7 = 64\n"
                                                      "4: 64 + 7 = 71\nThe result is 71.")
    assert demonstration(95, 9, 2, count_every=3) == "1: 95 + 9 = 104\n2: 104 + 9 = 113\nThe result is 113."


PROGRESSION_PROMPT = re.compile(r"^Start at (\d+) and add (\d+) to it (\d+) times, one numbered line per addition\.\n$")


@pytest.mark.parametrize("low, high, largest, k", [(12, 16, 9, 1), (16, 20, 9, 0), (2, 4, 2, 2), (5, 5, 19, 3)])
def test_counted_progression_prompts_labels_and_answers_agree(low, high, largest, k):
    task = CountedProgressionTask(progression_steps=high, min_progression_steps=low, max_increment=largest,
                                  count_every=k)
    for split in ("train", "test"):
        for example in task.examples(40, seed=4, split=split):  # (2..4, 2): 46 held-out prompts in all
            match = PROGRESSION_PROMPT.match(example.prompt)
            assert match, example.prompt
            start, step, count = map(int, match.groups())
            assert 10 <= start <= 99 and 2 <= step <= largest and low <= count <= high
            assert example.label == str(start + count * step)
            lines = example.demonstration.split("\n")
            assert len(lines) == count + 1 and lines[-1] == f"The result is {start + count * step}."
            for i, line in enumerate(lines[:-1], start=1):
                number = f"{i}/{count}" if k and i % k == 0 else str(i)
                assert line == f"{number}: {start + (i - 1) * step} + {step} = {start + i * step}"
            assert len(example.demonstration) < task.default_max_new_tokens
            assert task.reward([example.demonstration + "\n"], demonstration=[example.demonstration]) == [1.0]


def test_counted_progression_holds_out_distinct_prompts_it_never_trains_on():
    task = CountedProgressionTask(progression_steps=16, min_progression_steps=12)
    held_out = [e.prompt for e in task.examples(200, seed=0, split="test")]
    assert len(set(held_out)) == 200
    assert held_out[:40] == [e.prompt for e in task.examples(40, seed=0, split="test")]  # a longer list extends
    trained = {e.prompt for seed in range(5) for e in task.examples(2000, seed=seed)}
    assert not trained & set(held_out) and len(trained) > 2000  # the training draws cover most training prompts
    with pytest.raises(ConfigError, match="held-out prompts asked for"):
        task.examples(10_000, seed=0, split="test")


@pytest.mark.parametrize("options, message", [
    ({"progression_steps": 0}, "--progression-steps must be in 1..99, got 0"),
    ({"progression_steps": 10, "min_progression_steps": 11}, "--min-progression-steps must be in 1..progression_st"),
    ({"max_increment": 1}, "--max-increment must be in 2..99, got 1"),
    ({"count_every": 17}, r"--count-every must be in 0..min_progression_steps \(12\)"),
    # 12..16 additions: k = 14 would leave a 12- or 13-addition answer without its count restated
    ({"count_every": 14}, r"--count-every must be in 0..min_progression_steps \(12\), so that every answer "
                          r"restates its count; 0 = only in the prompt, got 14"),
])
def test_counted_progression_bad_options_name_the_flag(options, message):
    """The config (before any model loads) and the constructor refuse the same values with the same message."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"task": "counted_progression", "progression_steps": "16",
                               "min_progression_steps": "12", **{k: str(v) for k, v in options.items()}})
    with pytest.raises(ConfigError, match=message):
        CountedProgressionTask(**{"progression_steps": 16, "min_progression_steps": 12, **options})


def test_the_shipped_config_builds_the_task_it_documents():
    """configs/smollm2-counted-progression.yaml: 12-16 steps, the count on every line, no chat template, SnapKV at 64."""
    config = load_config(str(Path(__file__).parents[1] / "configs/smollm2-counted-progression.yaml"))
    task = task_from_config(config.task)
    assert task == CountedProgressionTask(progression_steps=16, min_progression_steps=12, max_increment=9,
                                          count_every=1)
    assert (config.rollout.kv_policy, config.rollout.kv_budget, config.task.max_new_tokens) == ("snapkv", 64, 320)
    # 43 + 7 x 14: the second worked example of the docstring's shape, restated on every line
    example = "\n".join(f"{i}/14: {43 + 7 * (i - 1)} + 7 = {43 + 7 * i}" for i in range(1, 15)) + "\nThe result is 141."
    assert demonstration(43, 7, 14, count_every=1) == example


def test_counted_progression_walk_metrics_by_hand():
    task = CountedProgressionTask(progression_steps=4, min_progression_steps=4)
    demo = demonstration(43, 7, 4, count_every=1)
    stopped = "1/4: 43 + 7 = 50\n2/4: 50 + 7 = 57\nThe result is 57."  # lost the count: stopped at line 2
    ran_past = demo.replace("The result is 71.", "5/4: 71 + 7 = 78\nThe result is 78.")
    metrics = task.walk_metrics([demo, stopped, ran_past], [demo] * 3)
    assert metrics == {"walk_exact": 1 / 3, "answer_accuracy": 1 / 3, "first_error_hop": (2 + 4) / 2}


def test_line_prefix_credit_by_hand_and_through_the_reward_runner():
    from sparserl.rewards.runner import RewardRunner
    from sparserl.tasks.base import line_prefix_credit

    demo = demonstration(43, 7, 4, count_every=1)  # 5 lines; the answer's end is a 6th
    wrong_sum = demo.replace("57 + 7 = 64", "57 + 7 = 65")  # line 3 wrong: 2 right before it
    truncated = "1/4: 43 + 7 = 50\n2/4: 50 + 7 = 57\n3/4: 57 + 7 = 6"  # cut inside line 3
    ran_past = demo + "\n5/4: 71 + 7 = 78"  # every line right, then one more: only the end is wrong
    off_at_once = "Start at 43"
    completions = [f"  {demo}\n", wrong_sum, truncated, ran_past, off_at_once, ""]
    expected = [1.0, 2 / 6, 2 / 6, 5 / 6, 0.0, 0.0]
    assert line_prefix_credit(completions, demonstration=[demo] * 6) == pytest.approx(expected)

    task = CountedProgressionTask(progression_steps=4, min_progression_steps=4)
    runner = RewardRunner.from_spec("task,sparserl.tasks.base:line_prefix_credit", "1,0.5", task.reward)
    examples = task.examples(1, seed=0)
    answer = examples[0].demonstration
    first_line_wrong = "1/4: 0 + 0 = 0\n" + answer.split("\n", 1)[1]
    scores = runner.score_examples(examples * 2, [answer, first_line_wrong], [[1], [1]])
    assert scores == pytest.approx([1.0 + 0.5, 0.0])


def _pinned_digest(task) -> str:
    """A digest of 30 examples per split and seed (prompt, label, demonstration, extra), in a fixed order."""
    import hashlib
    import json

    rows = [[e.prompt, e.label, e.demonstration, e.extra] for split in ("train", "test") for seed in (0, 1)
            for e in task.examples(30, seed=seed, split=split)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def test_prompts_and_answers_are_those_recorded_before_the_line_task_base():
    """Recorded from the code before the counted progression and the running total shared a base (issue 56):
    the same seeds still give the same prompts, answers and response bounds."""
    task = CountedProgressionTask(progression_steps=5, min_progression_steps=3, max_increment=4, count_every=2)
    first, second = task.examples(2, seed=7, split="train")
    assert (first.prompt, first.label, first.extra) == (
        "Start at 38 and add 3 to it 4 times, one numbered line per addition.\n", "50",
        {"start": 38, "increment": 3, "count": 4})
    assert first.demonstration == ("1: 38 + 3 = 41\n2/4: 41 + 3 = 44\n3: 44 + 3 = 47\n4/4: 47 + 3 = 50\n"
                                   "The result is 50.")
    assert second.prompt == "Start at 56 and add 4 to it 5 times, one numbered line per addition.\n"
    held_out = task.examples(2, seed=7, split="test")
    assert [e.prompt for e in held_out] == ["Start at 89 and add 2 to it 3 times, one numbered line per addition.\n",
                                            "Start at 97 and add 3 to it 4 times, one numbered line per addition.\n"]
    assert task.default_max_new_tokens == 121
    default = CountedProgressionTask()
    assert (_pinned_digest(default), default.default_max_new_tokens) == ("cf463faa75842aaa", 446)
    sparse_counts = CountedProgressionTask(count_every=3, min_progression_steps=12, progression_steps=16)
    assert (_pinned_digest(sparse_counts), sparse_counts.default_max_new_tokens) == ("e24c3e3ed3fb45bb", 362)
