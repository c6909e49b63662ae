"""Evaluation of a policy on held-out examples: greedy accuracy and sampled pass@k, under dense or
sparse inference, with token counts and, under sparse inference, the KV figures and α of the
rollouts. The trainer's periodic evaluation and every inference command use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..learner.alpha import rollout_alpha_metrics
from ..rewards.runner import RewardRunner
from ..rollout.block_sparse import BlockSparsity
from ..rollout.engine import KVCompression, RolloutBatch, RolloutEngine, SamplingConfig
from ..rollout.kv_cache import KVStats
from ..rollout.scheduler import request_seed, schedule_rollouts
from ..tasks.base import Example, Task, walk_metrics


@dataclass
class Completions:
    texts: list[str]
    batches: list[RolloutBatch]

    @property
    def ids(self) -> list[list[int]]:
        """Each completion's token ids, without padding."""
        return [ids for batch in self.batches for ids in response_ids(batch)]


def complete(model, tokenizer, examples: list[Example], max_new_tokens: int, temperature: float,
             compression: KVCompression | BlockSparsity | None = None, max_rows: int = 256, samples: int = 1,
             seed: int = 0, progress: str | None = None, record_distributions: bool = False) -> Completions:
    """Sample `samples` completions per example (grouped: example i's come out consecutively), at most
    `max_rows` at a time, row i from the seed (`seed`, i). `progress`: a label for a progress bar over
    the decode steps, None for silence."""
    engine = RolloutEngine(model, compression, record_evictions=False, record_distributions=record_distributions)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              max_rows=max_rows)
    prompts = [ids for e in examples for ids in [tokenizer(e.prompt).input_ids] * samples]
    total = math.ceil(len(prompts) / max_rows) * max_new_tokens
    with tqdm(total=total, desc=progress, unit="tok", leave=False, disable=progress is None) as bar:
        batch = schedule_rollouts(engine, prompts, sampling, [request_seed(seed, row) for row in range(len(prompts))],
                                  on_step=bar.update)
        bar.n = total  # waves may stop early: count them as done
    return Completions(decode_responses(tokenizer, batch), [batch])


def response_ids(batch: RolloutBatch) -> list[list[int]]:
    return [row[:length].tolist() for row, length in zip(batch.response_ids, batch.response_lengths)]


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    return tokenizer.batch_decode(response_ids(batch), skip_special_tokens=True)


def greedy_scores(model, tokenizer, task: Task, examples: list[Example], max_new_tokens: int,
                  compression: KVCompression | BlockSparsity | None = None,
                  rewards: RewardRunner | None = None) -> dict[str, float]:
    """Greedy `accuracy` (reward 1) on `examples`, plus the task's `walk_metrics` where it has them.
    `rewards` scores with the task's reward (default: `RewardRunner.for_task(task)`)."""
    done = complete(model, tokenizer, examples, max_new_tokens, temperature=0.0, compression=compression)
    scores = (rewards or RewardRunner.for_task(task)).score_examples(examples, done.texts, done.ids)
    return {"accuracy": sum(r >= 1.0 for r in scores) / max(len(scores), 1),
            **walk_metrics(task, done.texts, examples)}


def task_rewards(config, task: Task) -> RewardRunner:
    """The task's reward under the run's reward guard settings: what every evaluation scores with."""
    return RewardRunner.for_task(task, timeout_s=config.train.reward_timeout,
                                 max_failure_frac=config.train.max_reward_failure_frac)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_policy(model, tokenizer, task: Task, examples: list[Example], max_new_tokens: int,
                    compression: KVCompression | BlockSparsity | None, samples: int, temperature: float, seed: int,
                    progress: bool = False, alpha_bin_size: int = 16, rewards: RewardRunner | None = None) -> dict:
    """Greedy accuracy (and walk metrics), pass@k from `samples` samples, and under sparse inference
    the KV figures and the acceptance rate α of the greedy rollouts against the dense model.
    `rewards` scores with the task's reward (default: `RewardRunner.for_task(task)`)."""
    rewards = rewards or RewardRunner.for_task(task)
    kind = "dense" if compression is None else "sparse"
    label = (lambda what: f"eval {kind} {what}") if progress else (lambda what: None)
    greedy = complete(model, tokenizer, examples, max_new_tokens, 0.0, compression, progress=label("greedy"),
                      record_distributions=compression is not None)
    correct = [r >= 1.0 for r in rewards.score_examples(examples, greedy.texts, greedy.ids)]
    result = {"accuracy": sum(correct) / max(len(correct), 1), **walk_metrics(task, greedy.texts, examples),
              **_token_figures(greedy.batches)}
    if compression is not None:
        result["kv"] = {**_sparsity_settings(compression), **_kv_figures(greedy.batches)}
        result.update(rollout_alpha_metrics(model, greedy.batches, 0.0, alpha_bin_size))
    if samples > 0:
        sampled = complete(model, tokenizer, examples, max_new_tokens, temperature, compression, samples=samples,
                           seed=seed, progress=label("sampled"))
        hits = [r >= 1.0 for r in rewards.score_examples(examples, sampled.texts, sampled.ids, samples)]
        per_example = [sum(hits[i * samples:(i + 1) * samples]) for i in range(len(examples))]
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]
        result["pass_at_k"] = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in per_example) / len(examples)
                               for k in ks}
        result["sampled_accuracy"] = sum(hits) / max(len(hits), 1)
    return result


def _token_figures(batches: list[RolloutBatch]) -> dict:
    prompt = max(int(b.prompt_lengths.max()) for b in batches)
    total = max(int((b.prompt_lengths + b.response_lengths).max()) for b in batches)
    responses = torch.cat([b.response_lengths for b in batches]).float()
    return {"max_prompt_tokens": prompt, "max_total_tokens": total,
            "mean_response_tokens": float(responses.mean()),
            "truncated_frac": float(torch.cat([~b.ended for b in batches]).float().mean())}


def _sparsity_settings(compression: KVCompression | BlockSparsity) -> dict:
    schedule = None if compression.schedule is None else list(compression.schedule.budgets)
    if isinstance(compression, BlockSparsity):
        return {"sparsity": "block", "budget": compression.budget, "schedule": schedule,
                "page_size": compression.page_size, "dense_layers": compression.dense_layers}
    return {"sparsity": "eviction", "policy": compression.policy, "budget": compression.budget, "schedule": schedule,
            "window": compression.window, "interval": compression.interval}


def _kv_figures(batches: list[RolloutBatch]) -> dict:
    stats = KVStats.merged([b.kv for b in batches], [len(b) for b in batches])
    return stats.summary(sum(b.rollout_seconds for b in batches))
