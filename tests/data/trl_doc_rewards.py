"""Reward functions exactly as TRL's documentation writes them (GRPOTrainer guide), to run unchanged."""

import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def reward_boxed(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def hangs(completions, **kwargs):
    if any("hang" in c for c in completions):
        import time

        time.sleep(600)
    return [1.0] * len(completions)


def raises_on_some(completions, **kwargs):
    if any(c.startswith("bad") for c in completions):
        raise ValueError("cannot score this one")
    return [0.5] * len(completions)
