"""Scoring completions: reward functions called TRL's way, weighted, in worker processes that are
killed on timeout.

A reward function is called with keywords, as TRL's `GRPOTrainer` calls it:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

where the columns are the examples' fields (`label`, `extra`, `demonstration` where present),
lined up with the completions. So a function written for TRL runs unchanged, and one that takes
only `completion_ids` gets token ids, not text. `None` marks "does not apply" for a completion
and scores 0 there, as in TRL.

Each function scores the whole batch in one call, in a forked worker process. A call that raises
or runs past `timeout_s` is killed (a hung sympy call cannot hold the GIL or the process) and the
batch is scored again one completion per process, so that only the culprits score 0. Nothing is
silent: the failed batch is logged and counted (`reward_<name>_batch_failures`), and every
completion that still fails or times out is logged and counted, in all (`reward_failures`,
`reward_timeouts`) and per function (`reward_<name>_failures`, `reward_<name>_timeouts`); a worker
that dies counts as a failure. If more than `max_failure_frac` of the completions fail in one
function, the step stops with an error naming the function and its first error: training on
silent zeros is worse than stopping.

A worker ignores SIGINT and SIGTERM (Ctrl-C reaches the whole process group; the trainer alone
decides what it means, and kills the worker if it must), and dies with the process that started
it, so that a trainer killed mid-call leaves no worker behind.

`RewardRunner.from_spec("task,pkg.mod:fn", "1,0.5", task)` builds the weighted list; `task` is the
task's own reward. `last_scores` holds each function's own scores of the last batch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from ..tasks.base import Example, reward_columns

# The char tokenizer's Rust pool must not be running when a worker forks.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RewardFn = Callable[..., list]
# What a worker leaves to its parent; blocked from before the fork until the worker ignores them.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

logger = logging.getLogger(__name__)


class RewardError(UserError):
    """A reward function failed on too many completions, or could not be loaded."""


@dataclass
class RewardFunction:
    name: str
    fn: RewardFn
    weight: float


def load_reward_function(spec: str) -> RewardFn:
    """`pkg.module:function` (importable) or `path/to/file.py:function`."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise RewardError(f"--reward-funcs: {spec!r} is not MODULE:FUNCTION (e.g. mypkg.rewards:format_reward)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or not path.exists():
                raise FileNotFoundError(path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - whatever the user's module raises, say where
        raise RewardError(f"--reward-funcs: cannot import {module_name} ({type(error).__name__}: {error})") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise RewardError(f"--reward-funcs: {module_name} has no function {attribute!r}")
    return fn


def _context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _die_with(parent: int) -> None:
    """End this worker when `parent` dies, even by SIGKILL: an orphan would score on unseen."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it died before prctl
            os._exit(1)
        return

    def exit_when_orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, daemon=True).start()


def _work(connection, fn: RewardFn, kwargs: dict, parent: int) -> None:
    for stop_signal in _STOP_SIGNALS:  # a pending one is dropped with it
        signal.signal(stop_signal, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _die_with(parent)
    try:
        connection.send(("ok", list(fn(**kwargs))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which decides
        connection.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        connection.close()


def call_in_worker(fn: RewardFn, kwargs: dict, timeout_s: float) -> list:
    """`fn(**kwargs)` in a fresh worker process; raises TimeoutError (after killing it) or RuntimeError."""
    context = _context()
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_work, args=(send, fn, kwargs, os.getpid()), daemon=True)
    # Blocked across the fork, so that the child cannot run the parent's handlers before it ignores them.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        worker.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        status, value = receive.recv()
    except EOFError:
        raise RuntimeError(f"the worker died (exit code {worker.exitcode})") from None
    finally:
        receive.close()
        if worker.is_alive():
            worker.kill()
        worker.join()
    if status == "error":
        raise RuntimeError(value)
    return value


def _scores(result: list, count: int) -> list[float]:
    if len(result) != count:
        raise RuntimeError(f"returned {len(result)} scores for {count} completions")
    scores = []
    for score in result:
        value = 0.0 if score is None else float(score)
        if not math.isfinite(value):
            raise RuntimeError(f"returned a non-finite score {value}")
        scores.append(value)
    return scores


def parse_weights(text: str, count: int) -> list[float]:
    """`--reward-weights`: one finite number per reward function, comma-separated; all 1 when empty."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        return [1.0] * count
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            raise RewardError(f"--reward-weights: {part!r} is not a finite number; give one number per reward "
                              "function, comma-separated (e.g. 1,0.5)")
        values.append(value)
    if len(values) != count:
        raise RewardError(f"--reward-weights has {len(values)} values for {count} reward functions; give one "
                          "per function of --reward-funcs, in its order")
    return values


class RewardRunner:
    """The weighted sum of reward functions, with per-function means and failure counts.

    The only reward guard in the package: tasks and user functions are plain functions, and every
    score, in training and in evaluation, comes through here.
    """

    def __init__(self, functions: list[RewardFunction], timeout_s: float = 10.0, max_failure_frac: float = 0.5):
        if not functions:
            raise RewardError("no reward function given")
        self.functions = functions
        self.timeout_s = timeout_s
        self.max_failure_frac = max_failure_frac
        self.counts: dict[str, float] = {}
        self.means: dict[str, float] = {}
        self._last_scores: dict[str, list[float]] = {}
        self._reset_counts()

    @classmethod
    def from_spec(cls, spec: str, weights: str, task_reward: RewardFn, **options) -> RewardRunner:
        names = [s.strip() for s in spec.split(",") if s.strip()] or ["task"]
        values = parse_weights(weights, len(names))
        functions = []
        for name, weight in zip(names, values):
            fn = task_reward if name == "task" else load_reward_function(name)
            functions.append(RewardFunction("task" if name == "task" else name.rpartition(":")[2], fn, weight))
        if "task" not in names:  # scored anyway, weight 0: accuracy is what the task's own reward calls correct
            functions.append(RewardFunction("task", task_reward, 0.0))
        called = [f.name for f in functions]
        if len(set(called)) < len(called):
            twice = next(name for name in called if called.count(name) > 1)
            raise RewardError(f"--reward-funcs names two functions {twice!r}: their scores and metrics would mix; "
                              "give each function a name of its own")
        return cls(functions, **options)

    @classmethod
    def for_task(cls, task, **options) -> RewardRunner:
        """The task's own reward alone: what evaluation scores with."""
        return cls([RewardFunction("task", task.reward, 1.0)], **options)

    def score_examples(self, examples: list[Example], completions: list[str], completion_ids: list[list[int]],
                       repeat: int = 1) -> list[float]:
        """Scores of `completions`, `repeat` consecutive ones per example, with the examples' columns."""
        return self(prompts=[e.prompt for e in examples for _ in range(repeat)], completions=completions,
                    completion_ids=completion_ids, **reward_columns(examples, repeat))

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 **columns: Any) -> list[float]:
        total = [0.0] * len(completions)
        self._last_scores = {}
        for function in self.functions:
            scores = self._score(function, dict(prompts=prompts, completions=completions,
                                                completion_ids=completion_ids, **columns))
            self.means[function.name] = sum(scores) / max(len(scores), 1)
            self._last_scores[function.name] = scores
            total = [t + function.weight * s for t, s in zip(total, scores)]
        return total

    @property
    def last_scores(self) -> dict[str, list[float]]:
        """{function name: its own (unweighted) scores} of the last call, in completion order; a copy.
        What a task's success is read from, rather than the weighted sum."""
        return {name: list(scores) for name, scores in self._last_scores.items()}

    def _score(self, function: RewardFunction, kwargs: dict) -> list[float]:
        count = len(kwargs["completions"])
        try:
            return _scores(call_in_worker(function.fn, kwargs, self.timeout_s), count)
        except (TimeoutError, RuntimeError) as error:
            # Said once per batch: the per-row retry below then counts and names the culprits.
            logger.warning("reward %s: the batch of %d failed (%s); scoring one completion per worker",
                           function.name, count, error)
            self._count(function.name, "batch_failures", 1)
        scores, failures, timeouts, first = [], 0, 0, None
        for i in range(count):
            row = {k: v[i:i + 1] if isinstance(v, list) and len(v) == count else v for k, v in kwargs.items()}
            try:
                scores += _scores(call_in_worker(function.fn, row, self.timeout_s), 1)
            except TimeoutError:
                timeouts += 1
                scores.append(0.0)
            except RuntimeError as error:
                failures += 1
                first = first or str(error)
                scores.append(0.0)
        self._count(function.name, "failures", failures)
        self._count(function.name, "timeouts", timeouts)
        if failures or timeouts:
            logger.warning("reward %s: %d of %d completions failed and %d timed out (after %g s); they score 0%s",
                           function.name, failures, count, timeouts, self.timeout_s,
                           f"; first error: {first}" if first else "")
        if failures + timeouts > self.max_failure_frac * count:
            raise RewardError(
                f"reward {function.name} failed on {failures} and timed out (after {self.timeout_s:g} s) on "
                f"{timeouts} of {count} completions" + (f"; first error: {first}" if first else "")
                + f". Fix the function, or raise --max-reward-failure-frac (now {self.max_failure_frac})")
        return scores

    def _count(self, name: str, kind: str, amount: int) -> None:
        self.counts[f"reward_{name}_{kind}"] = self.counts.get(f"reward_{name}_{kind}", 0) + amount
        if kind != "batch_failures":
            self.counts[f"reward_{kind}"] += amount

    def _reset_counts(self) -> None:
        self.counts = {"reward_failures": 0, "reward_timeouts": 0}
        for function in self.functions:
            for kind in ("failures", "timeouts", "batch_failures"):
                self.counts[f"reward_{function.name}_{kind}"] = 0

    def pop_counts(self) -> dict[str, float]:
        """Failures and timeouts since the last pop (in all and per function, with the batches that
        had to be rescored row by row), and each function's mean score on the last batch."""
        counts = {**self.counts, **{f"reward_{name}_mean": mean for name, mean in self.means.items()}}
        self._reset_counts()
        return counts
