"""Check a running-total study's answers by arithmetic, independently of the task's reward (which compares with a
demonstration), and print a few to read.

    python docs/results/running_total/check_outputs.py runs/running-total-study [--show 3]

Reads every `samples.jsonl` below the directory (training rollouts and held-out answers). For each answer: the
numbers from its prompt, then the rules written out here (first line the first number; line k "t + n = t'" with
n the k-th number and t' = t + n; a last line "The total is T." with T the sum; nothing else). It reports, per
run and kind, how many answers the reward called correct, how many pass this check, and any answer where the two
disagree (there should be none), and prints the first `--show` correct and wrong answers of the held-out sets.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

NUMBERS = re.compile(r"Numbers: (\d+(?:, \d+)*)")
LINE = re.compile(r"(\d+) \+ (\d+) = (\d+)")


def numbers_of(prompt: str) -> list[int]:
    match = NUMBERS.search(prompt)
    if match is None:
        raise ValueError(f"no 'Numbers: ...' in the prompt: {prompt[:120]!r}")
    return [int(n) for n in match.group(1).split(", ")]


def check_answer(numbers: list[int], answer: str) -> tuple[bool, int]:
    """(whether `answer` is the running total of `numbers`, the index of its first wrong line: len(numbers) + 1
    for a right answer)."""
    lines = answer.strip().split("\n")
    if not lines or lines[0].strip() != str(numbers[0]):
        return False, 0
    total = numbers[0]
    for index, number in enumerate(numbers[1:], start=1):
        match = LINE.fullmatch(lines[index].strip()) if index < len(lines) else None
        if not match or (int(match[1]), int(match[2]), int(match[3])) != (total, number, total + number):
            return False, index
        total += number
    ending = len(numbers)
    if len(lines) != ending + 1 or lines[ending].strip() != f"The total is {total}.":
        return False, ending
    return True, ending + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--show", type=int, default=2, help="correct and wrong held-out answers to print per run")
    args = parser.parse_args()
    files = sorted(args.study.rglob("samples.jsonl"))
    if not files:
        raise SystemExit(f"no samples.jsonl below {args.study}")
    disagreements = 0
    print("| run | kind | answers | reward says correct | arithmetic says correct | disagree | mean first wrong line "
          "(wrong answers) |")
    print("|---|---|---|---|---|---|---|")
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        counts, wrong_lines, shown = Counter(), {}, Counter()
        for row in rows:
            kind = row["kind"]
            right, first_wrong = check_answer(numbers_of(row["prompt"]), row["completion"])
            counts[kind, "all"] += 1
            counts[kind, "reward"] += bool(row["correct"])
            counts[kind, "check"] += right
            if right != bool(row["correct"]):
                counts[kind, "disagree"] += 1
                print(f"DISAGREE {path.parent} step {row['step']}: {row['completion']!r}")
            if not right:
                wrong_lines.setdefault(kind, []).append(first_wrong)
            if kind.startswith("eval") and shown[kind, right] < args.show and row["step"] > 0:
                shown[kind, right] += 1
                print(f"\n<!-- {path.parent.name} {kind} step {row['step']} {'right' if right else 'wrong'}: "
                      f"{numbers_of(row['prompt'])}\n{row['completion']}\n-->\n")
        for kind in sorted({k for k, _ in counts}):
            wrong = wrong_lines.get(kind, [])
            first_wrong = f"{sum(wrong) / len(wrong):.1f}" if wrong else "—"
            print(f"| {path.parent.relative_to(args.study)} | {kind} | {counts[kind, 'all']} | {counts[kind, 'reward']} | "
                  f"{counts[kind, 'check']} | {counts[kind, 'disagree']} | {first_wrong} |")
            disagreements += counts[kind, "disagree"]
    print(f"\n{disagreements} disagreements between the reward and the arithmetic")
    raise SystemExit(1 if disagreements else 0)


if __name__ == "__main__":
    main()
