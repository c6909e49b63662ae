"""Prompt and correct-answer lengths of running-total and counted-progression settings in SmolLM2's tokenizer, chat
template on and off.

    python docs/results/paper_regime/lengths.py models/smollm2-135m > docs/results/paper_regime/lengths.md

Counts the held-out prompts (seed 0, test split, 200) as `sparserl eval` builds them and the demonstrations plus EOS
(what a correct greedy answer generates), so that a KV budget can be set >= the longest prompt and compared with the
mean answer before any model runs.
"""

import sys

from transformers import AutoTokenizer

from sparserl.tasks.chat import ChatPrompts
from sparserl.tasks.counted_progression import CountedProgressionTask
from sparserl.tasks.running_total import RunningTotalTask

SETTINGS = [(16, 20, 0), (9, 12, 1), (10, 12, 1), (12, 13, 2), (12, 14, 2), (13, 14, 2), (12, 15, 2), (13, 15, 2),
            (14, 15, 3), (13, 15, 3), (14, 16, 3), (15, 16, 3), (14, 16, 4), (15, 16, 4)]

PROGRESSIONS = [(16, 20, 0), (14, 18, 1), (12, 16, 1), (12, 16, 2), (12, 16, 3)]

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])


def row(task, template: bool) -> str:
    source = ChatPrompts(task, tokenizer) if template else task
    examples = source.examples(200, seed=0, split="test")
    prompts = [len(tokenizer(e.prompt).input_ids) for e in examples]
    answers = [len(tokenizer(e.demonstration, add_special_tokens=False).input_ids) + 1 for e in examples]
    mean = sum(answers) / len(answers)
    return (f"{'on' if template else 'off'} | {sum(prompts) / len(prompts):.1f} / {max(prompts)} | {min(answers)} / "
            f"{mean:.1f} / {max(answers)} | {mean / max(prompts):.2f} |")


print("Running total (k = 0: the original prompt; k > 0: the restating prompt of tasks/running_total.py).\n")
print("| operands | restate_every | template | prompt tokens mean / max | answer tokens (+EOS) min / mean / max "
      "| mean answer / max prompt |\n|---|---|---|---|---|---|")
for low, high, k in SETTINGS:
    task = RunningTotalTask(operands=high, min_operands=low, restate_every=k)
    for template in (False, True):
        print(f"| {low}-{high} | {k} | " + row(task, template))
print("\nCounted progression (starts 10-99, steps 2-9; 200 distinct held-out prompts).\n")
print("| count | count_every | template | prompt tokens mean / max | answer tokens (+EOS) min / mean / max "
      "| mean answer / max prompt |\n|---|---|---|---|---|---|")
for low, high, k in PROGRESSIONS:
    task = CountedProgressionTask(progression_steps=high, min_progression_steps=low, count_every=k)
    for template in (False, True):
        print(f"| {low}-{high} | {k} | " + row(task, template))
