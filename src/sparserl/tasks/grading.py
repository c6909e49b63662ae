"""Math grading in TRL's reward shape, `f(completions, **columns) -> list[float]`.

`math_verify_reward` grades the last `\\boxed{...}` (or `<answer>...</answer>`) of a completion
against the label with math-verify, with math-verify's own timeouts off: they use `signal.alarm`,
which only works in a main thread. Its time is bounded by the one reward guard,
`reward_runner.RewardRunner`, which scores in a worker process and kills it on timeout; nothing
here keeps threads or other state that a fork could break.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, Callable

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
    """math-verify warns that its timeouts are off; the reward runner bounds the time instead."""

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

    No time limit of its own: call it through `RewardRunner`, which bounds it.
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
