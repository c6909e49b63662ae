"""Every answer of counted-progression runs re-read by arithmetic, not by the task's reward.

    python docs/results/paper_regime/check_samples.py RUN_DIR|ANSWERS.jsonl [...] [--count-every 1]

For each run's samples.jsonl (training rollouts and held-out answers), or a file of `sparserl eval --answers`, the
prompt's start, step and count are read back from its text and each answer is checked line by line
(`measure.read_progression`: the lines rebuilt from the prompt's numbers). Prints, per run and kind of answer (train,
eval_dense, eval_sparse) and step, how many answers the checker and the run's own `correct` agree on, why the wrong
ones first went wrong, and the share of all walk lines whose sum is wrong (slips after the first count too: how often
the model adds wrongly, apart from where it stops). Exits 1 on any disagreement, so that a reward that scores without
doing the task shows here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure import STEP, read_progression  # noqa: E402 - the checker lives beside this script

PROMPT = re.compile(r"Start at (\d+) and add (\d+) to it (\d+) times, one numbered line per addition\.")


def walk_sums(completion: str) -> tuple[int, int]:
    """(walk lines, lines whose sum is wrong) over the whole answer, past its first error too."""
    walk = [STEP.match(line.strip()) for line in completion.split("\n")]
    sums = [tuple(map(int, match.group(3, 4, 5))) for match in walk if match]
    return len(sums), sum(carried + added != result for carried, added, result in sums)


def check_run(run: Path, count_every: int) -> tuple[list[str], int]:
    """Table lines for one run (or answers file) and its number of disagreements."""
    cells: dict[tuple[str, int | str], Counter] = defaultdict(Counter)
    walk_lines: dict[tuple[str, int | str], Counter] = defaultdict(Counter)  # apart from cells: not a reason
    disagreements = 0
    for line in (run / "samples.jsonl" if run.is_dir() else run).read_text().splitlines():
        row = json.loads(line)
        kind, step = row.get("kind") or f"eval_{row['inference']}", row.get("step", "-")
        match = PROMPT.search(row["prompt"])
        if match is None:
            raise SystemExit(f"{run}: a prompt that is not a counted progression: {row['prompt']!r}")
        correct, _, why = read_progression(*map(int, match.groups()), count_every, row["completion"])
        cell = cells[(kind, step)]
        cell["n"] += 1
        cell["correct"] += correct
        cell[why] += not correct
        seen, wrong = walk_sums(row["completion"])
        walk_lines[(kind, step)].update(seen=seen, wrong=wrong)
        if correct != bool(row["correct"]):
            cell["disagree"] += 1
            disagreements += 1
    lines = []
    for (kind, step), cell in sorted(cells.items(), key=lambda item: (item[0][0], str(item[0][1]).zfill(6))):
        reasons = ", ".join(f"{why} {n}" for why, n in cell.most_common()
                            if why not in ("n", "correct", "disagree") and n)
        walk = walk_lines[(kind, step)]
        per_line = walk["wrong"] / walk["seen"] if walk["seen"] else 0.0
        lines.append(f"| {run.parent.name + '/' + run.name if run.is_file() else run.name} | {kind} | {step} | {cell['n']} | {cell['correct'] / cell['n']:.1%} | "
                     f"{cell['disagree']} | {reasons or '-'} | {per_line:.1%} |")
    return lines, disagreements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--count-every", type=int, default=1, help="the task's count_every (the runs' config)")
    args = parser.parse_args()
    print("| run | answers | step | n | correct (checker) | disagree with the run | first errors | wrong sums per line |")
    print("|---|---|---|---|---|---|---|---|")
    total = 0
    for run in args.runs:
        lines, disagreements = check_run(run, args.count_every)
        print("\n".join(lines))
        total += disagreements
    print(f"\n{total} disagreements between the checker and the runs' rewards")
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
