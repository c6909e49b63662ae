"""Reward functions in TRL's shape, `f(completions, **columns) -> list[float]`, and a guard.

`safe_reward(fn)` wraps any reward so that one bad completion cannot crash or stall a training
step: each completion is scored on its own in a small pool of daemon worker threads, and one
whose scoring raises or runs past `timeout_s` scores 0.0 and is counted. This works from any
thread, unlike math-verify's own `signal.alarm` timeouts, which only work in the main thread.

`math_verify_reward` grades the last `\\boxed{...}` (or `<answer>...</answer>`) of a completion
against the label with math-verify, with math-verify's own timeouts off: wrap it in
`safe_reward`, which bounds its time.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import re
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

logger = logging.getLogger(__name__)

RewardFn = Callable[..., list[float]]

# Enough that a couple of hung calls leave room for the rest; scoring is GIL-bound sympy, so
# more threads would not add speed.
_WORKERS = 4


class _DaemonPool:
    """A fixed set of daemon threads serving a queue.

    Not `ThreadPoolExecutor`: its threads are joined at interpreter exit, so one hung sympy call
    would keep the process from ever exiting. Daemon threads are simply dropped.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        # Calls that timed out but are still running; guarded by _POOL_LOCK.
        self.abandoned = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._serve, name=f"sparserl-reward-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def close(self) -> None:
        """Let each worker exit once it is done with what it is stuck on."""
        for _ in range(self.workers):
            self._queue.put(None)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                future.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - a SystemExit must not kill the worker
                future.set_exception(RuntimeError(f"reward raised {exc!r}"))
            else:
                future.set_result(result)


_POOL: _DaemonPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _DaemonPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.abandoned >= _POOL.workers:
            if _POOL is not None:
                logger.warning(
                    "all %d reward workers are stuck on timed-out calls; starting a fresh pool",
                    _POOL.workers,
                )
                _POOL.close()
            _POOL = _DaemonPool(_WORKERS)
        return _POOL


def _abandon(pool: _DaemonPool, future: Future[Any]) -> None:
    """Count a timed-out call against its pool until it finishes, if it ever does."""
    if future.cancel():  # still queued: it will never run, so it holds no worker
        return
    with _POOL_LOCK:
        pool.abandoned += 1

    def release(_: Future[Any]) -> None:
        with _POOL_LOCK:
            pool.abandoned -= 1

    future.add_done_callback(release)


class SafeReward:
    """`fn` made safe: per-completion scoring, errors and timeouts score 0.0 and are counted."""

    def __init__(self, fn: RewardFn, timeout_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.failures = 0
        self.timeouts = 0
        # TRL logs each reward under its function's __name__.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._lock = threading.Lock()

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        n = len(completions)
        scores: list[float] = []
        failures = timeouts = 0
        first_error: str | None = None
        for i, completion in enumerate(completions):
            # Columns lined up with the completions are cut to the one row; anything else
            # (TRL also passes e.g. trainer_state) goes through as is.
            row = {
                k: v[i : i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v
                for k, v in kwargs.items()
            }
            pool = _pool()
            future = pool.submit(self.fn, [completion], **row)
            try:
                result = future.result(timeout=self.timeout_s)
                scores.append(_single_score(result))
            except FutureTimeout:
                _abandon(pool, future)
                timeouts += 1
                scores.append(0.0)
            except Exception as exc:
                failures += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
                scores.append(0.0)
        if failures or timeouts:
            with self._lock:
                self.failures += failures
                self.timeouts += timeouts
            logger.warning(
                "reward %s: %d of %d completions raised%s, %d timed out after %.3g s; "
                "they score 0.0",
                self.__name__, failures, n,
                f" (first: {first_error})" if first_error else "", timeouts, self.timeout_s,
            )
        return scores

    def pop_counts(self) -> dict[str, int]:
        """The failure and timeout counts since the last pop, then reset to zero."""
        with self._lock:
            counts = {"reward_failures": self.failures, "reward_timeouts": self.timeouts}
            self.failures = self.timeouts = 0
        return counts


def _single_score(result: Any) -> float:
    if not isinstance(result, (list, tuple)) or len(result) != 1:
        raise ValueError(f"reward returned {result!r} for one completion, expected a 1-list")
    score = float(result[0])
    if not math.isfinite(score):
        raise ValueError(f"reward returned a non-finite score {score}")
    return score


def safe_reward(fn: RewardFn, timeout_s: float = 5.0) -> SafeReward:
    """Wrap `fn` so a completion whose scoring raises or exceeds `timeout_s` scores 0.0."""
    return SafeReward(fn, timeout_s=timeout_s)


_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` with balanced braces, else None."""
    for match in reversed(list(_BOX_START.finditer(text))):
        depth, i = 1, match.end()
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2  # `\{` and `\}` are literal braces, not grouping
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : i].strip()
            i += 1
        # Unbalanced (e.g. a truncated completion): an earlier box may still be complete.
    return None


def answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`, stripped, else None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def completion_text(completion: Any) -> str:
    """The text of a completion, plain or conversational (TRL's list of message dicts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns that its timeouts are off; safe_reward bounds the time instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Imported on first use: it pulls in sympy, which the rest of the package does not need.
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutNotice())
    return parse, verify


def parse_math(text: str) -> list[Any]:
    """math-verify's parse of a bare answer string; [] if nothing parses.

    The string is tried inside `$...$` first: bare, math-verify's plain-expression extractor
    reads a prefix of LaTeX-ish answers (`2x+1` -> 2, `3\\sqrt{2}` -> 3, `2^{10}` -> 2), which
    would grade wrong answers right. The bare string is the fallback.
    """
    parse, _ = _math_verify()
    text = text.strip()
    if not text:
        return []
    delimited = "$" in text or "\\(" in text or "\\[" in text
    for candidate in ([text] if delimited else [f"${text}$", text]):
        parsed = parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


@functools.lru_cache(maxsize=4096)
def _parse_gold(label: str) -> tuple[Any, ...]:
    # Cached: each label is graded against many completions (GRPO groups).
    return tuple(parse_math(label))


def extract_math_answer(completion: str) -> str | None:
    """The last boxed answer, else the last `<answer>` content, else None."""
    boxed = boxed_answer(completion)
    return boxed if boxed is not None else answer_tag(completion)


def math_verify_reward(completions: list[Any], label: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's final answer is mathematically equal to the label, else 0.0.

    No time limit of its own: wrap in `safe_reward`.
    """
    _, verify = _math_verify()
    scores = []
    for completion, gold_text in zip(completions, label, strict=True):
        answer = extract_math_answer(completion_text(completion))
        if answer is None:
            scores.append(0.0)
            continue
        gold, pred = list(_parse_gold(str(gold_text))), parse_math(answer)
        if not gold or not pred:
            scores.append(0.0)
            continue
        # Gold first: math-verify's comparison is not symmetric.
        scores.append(float(verify(gold, pred, timeout_seconds=None)))
    return scores
