"""How many torch CPU threads a job uses.

`--threads auto` (the default) picks a count that does not depend on luck: a small model gets one
thread, because its matrices are too small for a second to pay and a second thread spinning on a
shared core slows every job on the machine (two runs of the built-in model, each on torch's default
two threads, slowed each other about twentyfold on a 2-core machine). A larger model gets the cores
that other jobs leave free. The count changes float sums and so trajectories: a run records the
count it chose and a resumed run keeps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .loading import count_parameters

# Below this a second thread buys little: the built-in model (0.6M parameters) trains 1.1× faster on two
# threads of a quiet machine and 3.6× slower beside one other such job (docs/benchmarks.md).
SMALL_MODEL_PARAMETERS = 20_000_000


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # one line for the run's log: why this count


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Available cores minus the ones other jobs keep busy (the one-minute load average), at least 1."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return max(1, available_cores() - round(load))


def choose_threads(setting: int | str, parameters: int, recorded: int = 0) -> ThreadChoice:
    """The thread count for `setting` ("auto", 0 for torch's default, or a count) and a model of
    `parameters` parameters; `recorded`: the count a resumed run chose before (0: none), which "auto" keeps."""
    if setting == "auto":
        if recorded:
            return ThreadChoice(recorded, "auto, kept from the run's start so that its float sums stay the same")
        if parameters < SMALL_MODEL_PARAMETERS:
            return ThreadChoice(1, f"auto: a small model ({parameters / 1e6:.1f}M parameters) gains little "
                                   "from a second thread")
        cores = free_cores()
        return ThreadChoice(cores, f"auto: {cores} of {available_cores()} cores free")
    if setting == 0:
        return ThreadChoice(torch.get_num_threads(), "torch's default (--threads 0)")
    return ThreadChoice(int(setting), "--threads")


def set_threads(setting: int | str, model: torch.nn.Module, recorded: int = 0) -> ThreadChoice:
    """Choose (see `choose_threads`) and apply the thread count for `model`."""
    choice = choose_threads(setting, count_parameters(model), recorded)
    torch.set_num_threads(choice.threads)
    return choice
