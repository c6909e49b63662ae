"""Prompts put to an instruction-tuned model as one user turn of its tokenizer's chat template.

An instruction-tuned model answers a bare question as a continuation of text, not as an answer:
SmolLM2-135M-Instruct rarely closes its turn without the template. `ChatPrompts` wraps a task so
that every example's prompt is the template's text (a user turn, then the assistant's opening), and
everything downstream (rollouts, evaluation, calibration) tokenizes it as it tokenizes any prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError
from .base import Example, Task


class ChatPrompts:
    """`task` with each prompt in `tokenizer`'s chat template; scores and names are the task's."""

    def __init__(self, task: Task, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--chat-template true needs a tokenizer with a chat template, and this model's has "
                              "none; leave it false, or use an instruction-tuned model")
        self.task = task
        self.name = task.name
        self.tokenizer = tokenizer
        # The prompt is tokenized later with the tokenizer's own special tokens: a BOS the template
        # writes as text as well would be doubled (Gemma's does; SmolLM2's adds none).
        adds_bos = tokenizer.bos_token_id is not None and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]
        self._strip = tokenizer.bos_token if adds_bos else None
        if hasattr(task, "default_max_new_tokens"):
            self.default_max_new_tokens = task.default_max_new_tokens
        if hasattr(task, "walk_metrics"):  # how an answer was earned reads the answers, not the prompts
            self.walk_metrics = task.walk_metrics

    def chat_text(self, prompt: str) -> str:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        return text[len(self._strip):] if self._strip and text.startswith(self._strip) else text

    def examples(self, count: int, seed: int, split: str = "train") -> list[Example]:
        return [dataclasses.replace(e, prompt=self.chat_text(e.prompt))
                for e in self.task.examples(count, seed, split)]

    def reward(self, completions: list[str], **kwargs: Any) -> list[float]:
        return self.task.reward(completions, **kwargs)
