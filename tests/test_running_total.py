"""The running-total task, checked by reading its prompts and answers ourselves, and `sparserl sft` on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sparserl.config.schema import SFTConfig, load_config
from sparserl.errors import ConfigError, UserError
from sparserl.tasks.base import reward_columns
from sparserl.tasks.running_total import RunningTotalTask

from conftest import make_tiny_model

PROMPT_RE = re.compile(r"^Add these numbers one at a time, from left to right, writing the running total after each\.\n"
                       r"Numbers: (\d+(?:, \d+)*)$")


def my_numbers(prompt: str) -> list[int]:
    match = PROMPT_RE.match(prompt)
    assert match, f"prompt does not have the documented shape: {prompt!r}"
    return [int(n) for n in match.group(1).split(", ")]


def _load_checker():
    """The study's own checker (docs/results/running_total/check_outputs.py): the task's rules by arithmetic."""
    import importlib.util

    path = Path(__file__).parents[1] / "docs/results/running_total/check_outputs.py"
    spec = importlib.util.spec_from_file_location("check_outputs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKER = _load_checker()


def my_check(numbers: list[int], answer: str) -> bool:
    return CHECKER.check_answer(numbers, answer)[0]


@pytest.mark.parametrize("answer, first_wrong", [
    ("7\n7 + 3 = 10\n10 + 9 = 19\nThe total is 19.", 4),
    ("7\n7 + 3 = 10\n10 + 9 = 19\nThe total is 19.\n", 4),
    ("8\n8 + 3 = 11\n11 + 9 = 20\nThe total is 20.", 0),
    ("7\n7 + 3 = 11\n11 + 9 = 20\nThe total is 20.", 1),
    ("7\n7 + 3 = 10\n10 + 8 = 18\nThe total is 18.", 2),  # read the wrong number from the prompt
    ("7\n7 + 3 = 10\nThe total is 10.", 2),
    ("7\n7 + 3 = 10\n10 + 9 = 19\n19 + 1 = 20\nThe total is 20.", 3),  # added a number the prompt lacks
    ("7\n7 + 3 = 10\n10 + 9 = 19\nThe total is 19. Done!", 3),
    ("", 0),
])
def test_the_study_checker_by_hand(answer, first_wrong):
    assert CHECKER.check_answer([7, 3, 9], answer) == (first_wrong == 4, first_wrong)
    assert CHECKER.numbers_of("<|im_start|>user\nAdd ...\nNumbers: 7, 3, 9<|im_end|>") == [7, 3, 9]


def test_the_docstrings_example_by_hand():
    from sparserl.tasks.running_total import demonstration

    assert demonstration([7, 3, 9, 2]) == "7\n7 + 3 = 10\n10 + 9 = 19\n19 + 2 = 21\nThe total is 21."


@pytest.mark.parametrize("low, high, largest", [(16, 20, 9), (2, 2, 1), (3, 8, 99), (64, 64, 9)])
def test_prompts_demonstrations_and_labels_agree_with_arithmetic(low, high, largest):
    task = RunningTotalTask(operands=high, min_operands=low, max_operand=largest)
    examples = task.examples(200, seed=3)
    counts = set()
    for example in examples:
        numbers = my_numbers(example.prompt)
        counts.add(len(numbers))
        assert low <= len(numbers) <= high and all(1 <= n <= largest for n in numbers)
        assert example.label == str(sum(numbers)) and example.extra["numbers"] == numbers
        assert my_check(numbers, example.demonstration)
        assert len(example.demonstration) < task.default_max_new_tokens  # a digit per token is the worst case
    assert counts == set(range(low, high + 1))  # n varies, so the answer must find where the list ends


def test_every_one_line_mistake_scores_zero():
    task = RunningTotalTask(operands=6, min_operands=6)
    example = task.examples(1, seed=0)[0]
    lines = example.demonstration.split("\n")
    assert task.reward([example.demonstration], demonstration=[example.demonstration]) == [1.0]
    assert task.reward(["\n " + example.demonstration + "\n"], demonstration=[example.demonstration]) == [1.0]
    for index, line in enumerate(lines):
        wrong = re.sub(r"\d+(?=\D*$)", lambda m: str(int(m[0]) + 1), line)  # its last number off by one
        mistaken = "\n".join(lines[:index] + [wrong] + lines[index + 1:])
        assert not my_check(example.extra["numbers"], mistaken)
        assert task.reward([mistaken], demonstration=[example.demonstration]) == [0.0]
    for shortened in ("\n".join(lines[:-1]), "\n".join(lines[:1] + lines[2:]), lines[-1], ""):
        assert task.reward([shortened], demonstration=[example.demonstration]) == [0.0]


def test_reward_lines_up_with_its_columns():
    task = RunningTotalTask()
    examples = task.examples(5, seed=1)
    demos = [e.demonstration for e in examples]
    grouped = reward_columns(examples, repeat=3)
    assert task.reward([d for d in demos for _ in range(3)], **grouped) == [1.0] * 15
    shifted = demos[1:] + demos[:1]
    assert task.reward(demos, demonstration=shifted) == [0.0] * 5


def test_walk_metrics_by_hand():
    demo = "7\n7 + 3 = 10\n10 + 9 = 19\nThe total is 19."
    task = RunningTotalTask()
    metrics = task.walk_metrics([demo, "7\n7 + 3 = 10\n10 + 8 = 18\nThe total is 18.",
                                 "7\n7 + 3 = 10\nThe total is 10.", "7\n7 + 4 = 11\n11 + 8 = 19\nThe total is 19."],
                                [demo] * 4)
    # wrong lines at 2, 2 (the stop where line 2 should be) and 1; the last one's total is right by luck
    assert metrics == {"walk_exact": 0.25, "answer_accuracy": 0.5, "first_error_hop": 5 / 3}
    assert task.walk_metrics([demo], [demo]) == {"walk_exact": 1.0, "answer_accuracy": 1.0}


def test_seeds_and_splits_differ_and_repeat():
    task = RunningTotalTask()
    prompts = [e.prompt for e in task.examples(50, seed=0)]
    assert prompts == [e.prompt for e in task.examples(50, seed=0)]
    assert not set(prompts) & {e.prompt for e in task.examples(50, seed=0, split="test")}
    assert not set(prompts) & {e.prompt for e in task.examples(50, seed=1)}


@pytest.mark.parametrize("overrides, message", [
    ({"operands": 1}, "--operands must be in 2..64, got 1"),
    ({"operands": 65}, "--operands must be in 2..64, got 65"),
    ({"operands": 5, "min_operands": 6}, r"--min-operands must be in 2..operands \(5\), got 6"),
    ({"min_operands": 1}, r"--min-operands must be in 2..operands \(20\), got 1"),
    ({"max_operand": 0}, "--max-operand must be in 1..999, got 0"),
    ({"restate_every": -1}, r"--restate-every must be in 0..operands - 2 \(18\); 0 = never, got -1"),
    ({"operands": 6, "min_operands": 4, "restate_every": 5}, r"--restate-every must be in 0..operands - 2 \(4\)"),
])
def test_bad_options_say_what_to_fix(overrides, message):
    """The config (before any model loads) and the constructor refuse the same values with the same message, naming
    the flag: the bounds live in one place."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"task": "running_total", **{k: str(v) for k, v in overrides.items()}})
    with pytest.raises(ConfigError, match=message):
        RunningTotalTask(**{"operands": 20, "min_operands": min(16, overrides.get("operands", 20)), **overrides})


@pytest.mark.parametrize("options", [{"operands": 2, "min_operands": 2}, {"operands": 64, "min_operands": 64},
                                     {"max_operand": 1}, {"max_operand": 999}, {"restate_every": 18},
                                     {"operands": 2, "min_operands": 2, "restate_every": 0}])
def test_the_bounds_themselves_are_accepted_by_both(options):
    config = load_config(overrides={"task": "running_total", **{k: str(v) for k, v in options.items()}})
    from sparserl.tasks.registry import task_from_config

    assert task_from_config(config.task) == RunningTotalTask(**options)


# Worked by hand from the numbers, not from the code: 7, 3, 9, 2, 5, 4 adds up to 10, 19, 21, 26, 30.
HAND_NUMBERS = [7, 3, 9, 2, 5, 4]
HAND_K2 = ("7\n"
           "7 + 3 = 10\n"
           "10 + 9 = 19; left: 2, 5, 4\n"
           "19 + 2 = 21\n"
           "21 + 5 = 26; left: 4\n"
           "26 + 4 = 30\n"
           "The total is 30.")
HAND_K1 = ("7\n"
           "7 + 3 = 10; left: 9, 2, 5, 4\n"
           "10 + 9 = 19; left: 2, 5, 4\n"
           "19 + 2 = 21; left: 5, 4\n"
           "21 + 5 = 26; left: 4\n"
           "26 + 4 = 30\n"  # nothing left to add: no restatement, even though k divides the line
           "The total is 30.")
HAND_K3 = ("7\n"
           "7 + 3 = 10\n"
           "10 + 9 = 19\n"
           "19 + 2 = 21; left: 5, 4\n"
           "21 + 5 = 26\n"
           "26 + 4 = 30\n"
           "The total is 30.")
HAND_K4 = ("7\n7 + 3 = 10\n10 + 9 = 19\n19 + 2 = 21\n21 + 5 = 26; left: 4\n26 + 4 = 30\nThe total is 30.")
HAND_PROMPT_K2 = "Keep a running total of these numbers; after every 2 sums, list the numbers left.\n7, 3, 9, 2, 5, 4\n"


@pytest.mark.parametrize("k, answer", [(1, HAND_K1), (2, HAND_K2), (3, HAND_K3), (4, HAND_K4)])
def test_restated_answers_by_hand(k, answer):
    from sparserl.tasks.running_total import demonstration

    assert demonstration(HAND_NUMBERS, restate_every=k) == answer


def test_a_restating_task_writes_the_hand_worked_prompt_and_answer():
    """The task's own example (not only `demonstration`): its prompt states the rule, its answer is worked by hand
    for the numbers it drew (2, 9, 3, 8, 9, 4: totals 11, 14, 22, 31, 35), and a wrong restated list is a wrong
    answer although every sum is right."""
    task = RunningTotalTask(operands=6, min_operands=6, restate_every=2)
    example = task.examples(1, seed=0)[0]
    by_hand = ("2\n2 + 9 = 11\n11 + 3 = 14; left: 8, 9, 4\n14 + 8 = 22\n22 + 9 = 31; left: 4\n31 + 4 = 35\n"
               "The total is 35.")
    prompt = HAND_PROMPT_K2.replace("7, 3, 9, 2, 5, 4", "2, 9, 3, 8, 9, 4")
    assert (example.prompt, example.demonstration, example.label) == (prompt, by_hand, "35")
    assert task.reward([by_hand + "\n"], demonstration=[example.demonstration]) == [1.0]
    wrong = by_hand.replace("left: 4", "left: 9")
    assert task.reward([wrong], demonstration=[example.demonstration]) == [0.0]
    # the first wrong line is line 4 (the first number is line 0); the total is still right
    assert task.walk_metrics([wrong], [example.demonstration]) == {"walk_exact": 0.0, "answer_accuracy": 1.0,
                                                                    "first_error_hop": 4}


@pytest.mark.parametrize("low, high, largest", [(16, 20, 9), (2, 2, 1), (3, 8, 99), (64, 64, 9)])
def test_k0_is_the_original_format_byte_for_byte(low, high, largest):
    """restate_every = 0 must not change a byte of any prompt or answer, so that the earlier study reproduces: the
    prompt is the documented one and the answer is the study checker's, and both equal the default task's."""
    plain = RunningTotalTask(operands=high, min_operands=low, max_operand=largest)
    zero = RunningTotalTask(operands=high, min_operands=low, max_operand=largest, restate_every=0)
    for a, b in zip(plain.examples(50, seed=5, split="test"), zero.examples(50, seed=5, split="test")):
        assert a == b
        numbers = my_numbers(b.prompt)  # the original prompt's exact shape
        assert my_check(numbers, b.demonstration) and ";" not in b.demonstration and "left" not in b.demonstration
    assert plain.default_max_new_tokens == zero.default_max_new_tokens


# The second held-out prompt (seed 0, test split, 16-20 numbers) as the earlier study recorded it, in
# docs/results/running_total/b64/dense/seed0/samples.jsonl (step 0, eval_dense), with the model's answer that its
# reward scored correct there, so the demonstration then was exactly this text.
RECORDED_PROMPT = ("Add these numbers one at a time, from left to right, writing the running total after each.\n"
                   "Numbers: 1, 1, 6, 1, 2, 2, 4, 3, 5, 2, 1, 5, 7, 5, 2, 9, 2, 7, 2")
RECORDED_ANSWER = ("1\n1 + 1 = 2\n2 + 6 = 8\n8 + 1 = 9\n9 + 2 = 11\n11 + 2 = 13\n13 + 4 = 17\n17 + 3 = 20\n"
                   "20 + 5 = 25\n25 + 2 = 27\n27 + 1 = 28\n28 + 5 = 33\n33 + 7 = 40\n40 + 5 = 45\n45 + 2 = 47\n"
                   "47 + 9 = 56\n56 + 2 = 58\n58 + 7 = 65\n65 + 2 = 67\nThe total is 67.")


def test_k0_reproduces_a_prompt_and_answer_recorded_before_the_option():
    example = RunningTotalTask(restate_every=0).examples(2, seed=0, split="test")[1]
    assert (example.prompt, example.demonstration, example.label) == (RECORDED_PROMPT, RECORDED_ANSWER, "67")


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_restated_answers_agree_with_arithmetic(k):
    task = RunningTotalTask(operands=14, min_operands=10, restate_every=k)
    for example in task.examples(100, seed=2):
        numbers = example.extra["numbers"]
        lines = example.demonstration.split("\n")
        assert lines[0] == str(numbers[0]) and lines[-1] == f"The total is {sum(numbers)}."
        for index, line in enumerate(lines[1:-1], start=1):
            head, _, left = line.partition("; left: ")
            assert head == f"{sum(numbers[:index])} + {numbers[index]} = {sum(numbers[:index + 1])}"
            wants = index % k == 0 and index < len(numbers) - 1
            assert (left != "") == wants
            if wants:
                assert [int(n) for n in left.split(", ")] == numbers[index + 1:]
        assert len(example.demonstration) < task.default_max_new_tokens
        assert example.prompt == my_prompt(k, numbers)


def my_prompt(k: int, numbers: list[int]) -> str:
    every = "each sum" if k == 1 else f"every {k} sums"
    listed = ", ".join(map(str, numbers))
    return f"Keep a running total of these numbers; after {every}, list the numbers left.\n{listed}\n"


def _saved_tiny_model(path):
    model, tokenizer = make_tiny_model(seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _sft_config(model_dir, task="pointer_walk"):
    return load_config(overrides={"model": str(model_dir), "task": task, "difficulty": "4", "threads": "1",
                                  "seed": "0"})


def test_the_sft_loss_is_the_response_cross_entropy_of_plain_forwards():
    """Against one unpadded float64 forward per example: the mean negative log-likelihood of the demonstration and
    EOS, prompt tokens excluded. The loss takes the LM head's logits in float32, as every log-prob of the learner
    does (`model.forward.head_logits`), so the two agree to float32 rounding (4e-7 measured), not to 1e-10."""
    from sparserl.experiments.sft import _loss
    from sparserl.tasks.pointer_walk import PointerWalkTask

    model, tokenizer = make_tiny_model(seed=2)
    model = model.double()
    examples = PointerWalkTask(letters=7, min_letters=3).examples(5, seed=4)  # prompts of different lengths
    total, count = torch.zeros((), dtype=torch.float64), 0
    for example in examples:
        prompt = tokenizer(example.prompt).input_ids
        response = tokenizer(example.demonstration, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
        for offset, token in enumerate(response):
            total -= logits[len(prompt) + offset - 1, token]
            count += 1
    assert abs(float(_loss(model, tokenizer, examples).detach()) - float(total / count)) < 2e-6


def test_sft_stops_at_its_probe_and_saves_a_model_that_loads(tmp_path):
    from sparserl.experiments.sft import PROBE_ANSWERS_FILE, sft
    from sparserl.model.loading import load_policy

    model_dir = _saved_tiny_model(tmp_path / "tiny")
    out = tmp_path / "warm"
    settings = SFTConfig(out=str(out), steps=3, batch_size=4, probe_every=2, probe_examples=3, band_low=0.0,
                         stop_at=0.0, lr=1e-3)
    card = sft(_sft_config(model_dir), settings)
    assert card["step"] == 2 and [h["step"] for h in card["history"] if "loss" in h] == [1, 2]
    assert json.loads((out / "card.json").read_text())["heldout_greedy_accuracy"] == card["heldout_greedy_accuracy"]
    answers = [json.loads(line) for line in (out / PROBE_ANSWERS_FILE).read_text().splitlines()]
    assert len(answers) == 3 and {"prompt", "label", "completion", "correct"} <= set(answers[0])
    loaded, _ = load_policy(str(out), torch.float32)
    before, _ = load_policy(str(model_dir), torch.float32)
    assert not torch.equal(loaded.lm_head.weight, before.lm_head.weight)  # the steps were taken and saved


def test_sft_refuses_a_start_with_no_room_and_saves_nothing(tmp_path):
    """A band the probes never reach (the random model solves nothing; the band asks for every answer right): the
    run fails, saying so, and leaves no model behind."""
    from sparserl.experiments.sft import sft

    model_dir = _saved_tiny_model(tmp_path / "tiny")
    settings = SFTConfig(out=str(tmp_path / "warm"), steps=2, batch_size=2, probe_every=1, probe_examples=2,
                         band_low=1.0, stop_at=1.0, band_high=1.0)
    with pytest.raises(UserError, match="no held-out probe reached the band"):
        sft(_sft_config(model_dir), settings)
    assert not (tmp_path / "warm").exists()


def _pinned_digest(task) -> str:
    """A digest of 30 examples per split and seed (prompt, label, demonstration, extra), in a fixed order."""
    import hashlib

    rows = [[e.prompt, e.label, e.demonstration, e.extra] for split in ("train", "test") for seed in (0, 1)
            for e in task.examples(30, seed=seed, split=split)]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def test_prompts_and_answers_are_those_recorded_before_the_line_task_base():
    """Recorded from the code before the running total and the counted progression shared a base (issue 56):
    the same seeds still give the same prompts, answers and response bounds."""
    task = RunningTotalTask(operands=5, min_operands=3, max_operand=9, restate_every=2)
    first, second = task.examples(2, seed=7, split="train")
    assert (first.prompt, first.label, first.extra) == (
        "Keep a running total of these numbers; after every 2 sums, list the numbers left.\n3, 3, 1, 6\n", "13",
        {"numbers": [3, 3, 1, 6]})
    assert first.demonstration == "3\n3 + 3 = 6\n6 + 1 = 7; left: 6\n7 + 6 = 13\nThe total is 13."
    assert second.demonstration == "4\n4 + 7 = 11\n11 + 1 = 12\nThe total is 12."
    assert task.default_max_new_tokens == 98
    wide = RunningTotalTask(operands=4, min_operands=4, max_operand=20)
    assert [e.prompt for e in wide.examples(2, seed=7, split="test")] == [
        "Add these numbers one at a time, from left to right, writing the running total after each.\n"
        "Numbers: 17, 13, 15, 12",
        "Add these numbers one at a time, from left to right, writing the running total after each.\n"
        "Numbers: 20, 13, 19, 2"]
    assert wide.default_max_new_tokens == 76
    default = RunningTotalTask()
    assert (_pinned_digest(default), default.default_max_new_tokens) == ("c877d17a81309398", 305)
    restating = RunningTotalTask(restate_every=4)
    assert (_pinned_digest(restating), restating.default_max_new_tokens) == ("b4ceacc135c204db", 445)
