"""Math grading and the data-backed tasks, against hand-worked expectations (the reward guard is
tested in test_reward_runner.py and test_reward_guard.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sparserl.tasks.base import TASKS
from sparserl.tasks.grading import boxed_answer, math_verify_reward
from sparserl.tasks.math_jsonl import DataError, MathJsonlTask
from sparserl.tasks.registry import build_task

FIXTURE = Path(__file__).parent / "data" / "math_small.jsonl"


# --- boxed extraction -------------------------------------------------------------------------

def test_boxed_nested_braces() -> None:
    assert boxed_answer(r"so the answer is \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"


def test_boxed_last_wins_and_fbox() -> None:
    assert boxed_answer(r"\boxed{1} no, \boxed{2}") == "2"
    assert boxed_answer(r"\boxed{1} no, \fbox{7}") == "7"


def test_boxed_absent_or_unbalanced() -> None:
    assert boxed_answer("the answer is 4") is None
    # The last box is cut off (truncated completion): the last complete one is taken.
    assert boxed_answer(r"\boxed{3} then \boxed{4") == "3"
    # Escaped braces are literal, not grouping.
    assert boxed_answer(r"\boxed{\{1,2\}}") == r"\{1,2\}"


# --- math-verify ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("completion", "label", "expected"),
    [
        (r"\boxed{0.5}", "1/2", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),  # no box, no tag
        ("<answer>-2</answer>", "-2", 1.0),
        (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        # Bare, math-verify reads only a prefix of these (2x+1 -> 2, 3\sqrt{2} -> 3).
        (r"\boxed{2x+1}", "2", 0.0),
        (r"\boxed{3\sqrt{2}}", "3", 0.0),
        (r"\boxed{2^{10}}", "1024", 1.0),
    ],
)
def test_math_verify_hand_cases(completion: str, label: str, expected: float) -> None:
    assert math_verify_reward([completion], label=[label]) == [expected]


# --- MathJsonlTask ----------------------------------------------------------------------------

def test_math_jsonl_loads_and_splits() -> None:
    task = MathJsonlTask(FIXTURE)
    # 12 records (the blank line is skipped): floor(10% of 12) = 1 test, 11 train. The train split is
    # drawn without repeats while it lasts, so 3 passes show exactly its records; the held-out one is never
    # repeated (a prompt scored twice would count twice in an accuracy).
    train = task.examples(33, seed=0)
    with pytest.warns(UserWarning, match=r"the test split holds 1 example\(s\), fewer than the 3 asked for: each is used once"):
        test = task.examples(3, seed=0, split="test")
    train_prompts, test_prompts = {e.prompt for e in train}, {e.prompt for e in test}
    assert len(train_prompts) == 11 and len(test) == len(test_prompts) == 1 and not train_prompts & test_prompts
    assert len(train_prompts | test_prompts) == 12
    by_prompt = {e.prompt: e.label for e in train + test}
    assert by_prompt["Solve for x: 3x = 12."] == "4"  # JSON number 4
    assert by_prompt["What is 0.25 * 2?"] == "0.5"  # JSON number 0.5


def test_math_jsonl_deterministic_per_seed() -> None:
    task = MathJsonlTask(FIXTURE, template="Q: {prompt}\nA:")
    first, again, other = (task.examples(6, seed=s) for s in (1, 1, 2))
    assert first == again and first != other
    assert first[0].prompt.startswith("Q: ") and first[0].prompt.endswith("\nA:")
    # More than the split holds: whole passes, each without repeats.
    assert len({e.prompt for e in task.examples(22, seed=0)[:11]}) == 11


def test_math_jsonl_reward() -> None:
    task = MathJsonlTask(FIXTURE)
    assert task.reward([r"\boxed{\frac{2}{4}}", r"\boxed{5}"], label=["1/2", "4"],
                       extra=[{}, {}]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("bad_line", "needles"),
    [
        ('{"prompt": "2+2?", "label": "4"', ["line 3", "invalid JSON"]),
        ('{"prompt": "2+2?", "answer": "4"}', ["line 3", "'label'", "answer", "label_key"]),
        ('{"prompt": 5, "label": "4"}', ["line 3", "'prompt'", "string"]),
        ('{"prompt": "2+2?", "label": true}', ["line 3", "'label'"]),
        ('["2+2?", "4"]', ["line 3", "JSON object"]),
    ],
)
def test_math_jsonl_bad_line(tmp_path: Path, bad_line: str, needles: list[str]) -> None:
    good = json.dumps({"prompt": "1+1?", "label": "2"})
    path = tmp_path / "math.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")  # the bad line is line 3
    with pytest.raises(DataError) as info:
        MathJsonlTask(path)
    message = str(info.value)
    assert "math.jsonl" in message
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig"])
def test_math_jsonl_text_encodings(tmp_path: Path, encoding: str) -> None:
    """A file saved as UTF-16 (as Windows editors often do) is refused in one line that says how to convert it; a
    UTF-8 file with a byte-order mark loads."""
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{n}+1?", "label": str(n + 1)}) + "\n" for n in range(4)),
                    encoding=encoding)
    if encoding == "utf-16":
        with pytest.raises(DataError, match="not UTF-8 text .*save it as UTF-8"):
            MathJsonlTask(path)
    else:
        task = MathJsonlTask(path)
        assert sorted(e.label for e in task.examples(3, seed=0) + task.examples(1, seed=0, split="test")) == \
            ["1", "2", "3", "4"]


# --- ReasoningGymTask -------------------------------------------------------------------------

def _chain_sum_by_hand(question: str) -> int:
    """Evaluate the `a + b - c =` expression of a chain_sum question without its label."""
    expression = re.search(r":\s*([-\d\s+]+?)\s*=\s*$", question.splitlines()[0]).group(1)
    tokens = expression.split()
    total = int(tokens[0])
    for op, value in zip(tokens[1::2], tokens[2::2]):
        total += int(value) if op == "+" else -int(value)
    return total


def test_reasoning_gym_chain_sum() -> None:
    task = build_task("gym:chain_sum", size=20)
    train = task.examples(5, seed=0)
    test = task.examples(5, seed=0, split="test")
    assert task.examples(5, seed=0) == train
    for e in train + test:
        assert "<answer></answer>" in e.prompt
        assert e.label == str(_chain_sum_by_hand(e.prompt))
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    right = [f"thinking...<answer>{e.label}</answer>" for e in train]
    wrong = [f"<answer>{int(e.label) + 1}</answer>" for e in train]
    columns = {"label": [e.label for e in train] * 2, "extra": [e.extra for e in train] * 2}
    scores = task.reward(right + wrong, **columns)
    assert scores[:5] == [1.0] * 5
    assert all(s < 1.0 for s in scores[5:])


def test_reasoning_gym_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="chain_sum.*dataset_names"):
        build_task("gym:chain_summ")


# --- registry ---------------------------------------------------------------------------------

def test_registry_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'") as error:
        build_task("nope")
    assert all(name in str(error.value) for name in TASKS)


def test_registry_builds_pointer_walk_and_rejects_bad_option() -> None:
    assert build_task("pointer_walk", letters=6).examples(1, seed=0)[0].prompt.startswith("^")
    with pytest.raises(ValueError, match="leters.*letters"):
        build_task("pointer_walk", leters=6)
