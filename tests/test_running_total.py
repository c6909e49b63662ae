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


@pytest.mark.parametrize("overrides, message", [({"operands": 1}, "operands must be in 2..64"),
                                                ({"operands": 5, "min_operands": 6}, "min_operands must be in"),
                                                ({"max_operand": 0}, "max_operand must be in")])
def test_bad_options_say_what_to_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"task": "running_total", **{k: str(v) for k, v in overrides.items()}})


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
