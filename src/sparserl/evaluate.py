"""Held-out evaluation: greedy accuracy and sampled pass@k, under dense or sparse inference.

Writes the JSON that `sparserl eval` prints: accuracy, pass@k (unbiased estimator), token counts
and, under sparse inference, the KV figures of the rollouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rollout.engine import KVCompression, RolloutBatch, RolloutEngine, SamplingConfig
from .tasks.base import Example, Task, reward_columns


@dataclass
class Completions:
    texts: list[str]
    batches: list[RolloutBatch]


def complete(model, tokenizer, examples: list[Example], max_new_tokens: int, temperature: float,
             compression: KVCompression | None = None, batch_size: int = 256, samples: int = 1,
             generator: torch.Generator | None = None) -> Completions:
    """Sample `samples` completions per example (grouped: example i's come out consecutively)."""
    engine = RolloutEngine(model, compression, record_evictions=False)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompts = [ids for e in examples for ids in [tokenizer(e.prompt).input_ids] * samples]
    texts, batches = [], []
    for start in range(0, len(prompts), batch_size):
        batch = engine.generate(prompts[start:start + batch_size], sampling, generator)
        texts.extend(decode_responses(tokenizer, batch))
        batches.append(batch)
    return Completions(texts, batches)


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    ids = [row[:length].tolist() for row, length in zip(batch.response_ids, batch.response_lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def greedy_accuracy(model, tokenizer, task: Task, examples: list[Example], max_new_tokens: int,
                    compression: KVCompression | None = None) -> float:
    done = complete(model, tokenizer, examples, max_new_tokens, temperature=0.0, compression=compression)
    rewards = task.reward(done.texts, **reward_columns(examples))
    return sum(r >= 1.0 for r in rewards) / max(len(rewards), 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
