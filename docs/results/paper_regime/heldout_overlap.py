"""What the counted progression's held-out split tests (issue 54): the share of held-out prompts whose whole chain of
sums also appears inside a longer training answer.

    PYTHONPATH=src python docs/results/paper_regime/heldout_overlap.py [--config configs/smollm2-counted-progression.yaml]

A held-out (a, d, n) writes the sums a + d, a + 2d, ..., a + nd. A training prompt (a', d, n') writes them all when
a' = a − j·d for some j >= 0 and n' >= n + j (from any start, or with j = 0 only: the same start, a longer count).
Such a held-out prompt asks for no sum training did not write, only for stopping at a count it did not see.
"""

from __future__ import annotations

import argparse

from sparserl.config.schema import load_config
from sparserl.tasks.registry import task_from_config


def covered(start: int, step: int, count: int, train: set[tuple[int, int, int]], most: int, same_start: bool) -> bool:
    """Whether a training prompt (start − j·step, step, a count of at least count + j, more than count when j = 0)
    exists; `most`: the task's largest count, which bounds both j and the longer count."""
    shifts = [0] if same_start else range(most - count + 1)
    return any((start - j * step, step, longer) in train
               for j in shifts for longer in range(count + j + (j == 0), most + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-counted-progression.yaml")
    task = task_from_config(load_config(parser.parse_args().config).task)
    train, held_out = set(task.split_prompts("train")), task.split_prompts("test")
    for label, same_start in (("from any start with the same step", False), ("from the same start", True)):
        inside = sum(covered(*p, train, task.progression_steps, same_start) for p in held_out)
        print(f"held-out prompts whose chain of sums lies inside a longer training answer, {label}: "
              f"{inside} of {len(held_out)} ({inside / len(held_out):.1%})")


if __name__ == "__main__":
    main()
