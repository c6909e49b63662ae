"""Evaluation of a policy on held-out examples: greedy accuracy and sampled pass@k, under dense or
sparse inference, with token counts and, under sparse inference, the KV figures and α of the
rollouts. The trainer's periodic evaluation and every inference command use it.

Sparse inference is the run's sampler: its KV policy (or block attention) and its KV storage (`kv_dtype`: a cache
quantized to fp8 or int8, alone or under eviction). Dense inference is the whole cache in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..learner.alpha import rollout_alpha_metrics
from ..rewards.runner import RewardRunner
from ..rollout.batch import KVStats, RolloutBatch, SamplingConfig
from ..rollout.dispatch.scheduler import (
    RowLimits,
    request_seed,
    rows_in_flight,
    schedule_rollouts,
)
from ..rollout.engine.engine import RolloutEngine
from ..rollout.engine.step import StepRunner
from ..rollout.sparsity.block_sparse import BlockSparsity
from ..rollout.sparsity.eviction import KVCompression
from ..tasks.base import Example, Task, is_correct, walk_metrics


@dataclass
class Completions:
    texts: list[str]
    batches: list[RolloutBatch]

    @property
    def ids(self) -> list[list[int]]:
        """Each completion's token ids, without padding."""
        return [ids for batch in self.batches for ids in response_ids(batch)]


def complete(model, tokenizer, examples: list[Example], max_new_tokens: int, temperature: float,
             compression: KVCompression | BlockSparsity | None = None, limits: RowLimits = RowLimits(),
             samples: int = 1, seed: int = 0, progress: str | None = None,
             record_distributions: bool = False, kv_dtype: str = "auto",
             runners: dict[str, StepRunner] | None = None) -> Completions:
    """Sample `samples` completions per example (grouped: example i's come out consecutively), row i from
    the seed (`seed`, i), as many rows at a time as `limits` allow (`RowLimits.for_inference`). A KV memory
    budget that holds no row is refused before anything is sampled. `progress`: a label for a progress
    bar over the decode steps, None for silence. `kv_dtype`: how the cache stores keys and values (auto: the
    model's dtype; fp8 or int8: quantized, with or without `compression`). `runners`: the step runners to share with
    earlier and later calls (a run's evaluations), so that captured steps are kept across them (None: this call's)."""
    engine = RolloutEngine(model, compression, record_evictions=False, record_distributions=record_distributions,
                           kv_dtype=kv_dtype, runners=runners)
    limits = limits.for_inference()
    prompts = [ids for e in examples for ids in [tokenizer(e.prompt).input_ids] * samples]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              **limits.sampling_fields())
    rows = rows_in_flight(engine, sampling, max(len(p) for p in prompts), len(prompts))
    total = math.ceil(len(prompts) / rows) * max_new_tokens
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
                  rewards: RewardRunner | None = None, limits: RowLimits = RowLimits(),
                  answers: list[dict] | None = None, kv_dtype: str = "auto",
                  runners: dict[str, StepRunner] | None = None) -> dict[str, float]:
    """Greedy `accuracy` (`is_correct` by the task's reward) on `examples`, plus the task's `walk_metrics`
    where it has them. `rewards` scores with the task's reward (default: `RewardRunner.for_task(task)`).
    `answers`, if given, gets each example's prompt, label, greedy completion and verdict appended.
    `kv_dtype`, `runners`: the cache's storage and the step runners (`complete`)."""
    done = complete(model, tokenizer, examples, max_new_tokens, temperature=0.0, compression=compression,
                    limits=limits, kv_dtype=kv_dtype, runners=runners)
    scores = (rewards or RewardRunner.for_task(task)).score_examples(examples, done.texts, done.ids)
    if answers is not None:
        answers.extend(answer_records(examples, done.texts, scores))
    return {"accuracy": accuracy(scores), **walk_metrics(task, done.texts, examples)}


def answer_records(examples: list[Example], texts: list[str], scores: list[float]) -> list[dict]:
    """One record per greedy answer, to read how a score was earned: prompt, label, completion, verdict."""
    return [{"prompt": e.prompt, "label": e.label, "completion": text, "correct": is_correct(score)}
            for e, text, score in zip(examples, texts, scores)]


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
                    progress: bool = False, alpha_bin_size: int = 16, rewards: RewardRunner | None = None,
                    limits: RowLimits = RowLimits(), measure_alpha: bool = True,
                    answers: list[dict] | None = None, kv_dtype: str = "auto") -> dict:
    """Greedy accuracy (and walk metrics), pass@k from `samples` samples, the KV figures of the greedy
    rollouts (peak bytes, rows in flight under `limits`), and under sparse inference (with `measure_alpha`) the
    acceptance rate α of the greedy rollouts against the dense model, a replay that costs about twice the greedy
    pass on a real model. Sparse inference is `compression`, or a cache quantized by `kv_dtype` (fp8 or int8), or
    both. `rewards` scores with the task's reward (default: `RewardRunner.for_task(task)`); `answers`, if given,
    gets a record per greedy answer (`answer_records`)."""
    rewards = rewards or RewardRunner.for_task(task)
    sparse = compression is not None or kv_dtype != "auto"
    kind = "sparse" if sparse else "dense"
    label = (lambda what: f"eval {kind} {what}") if progress else (lambda what: None)
    greedy = complete(model, tokenizer, examples, max_new_tokens, 0.0, compression, limits=limits,
                      progress=label("greedy"), record_distributions=sparse and measure_alpha, kv_dtype=kv_dtype)
    scores = rewards.score_examples(examples, greedy.texts, greedy.ids)
    if answers is not None:
        answers.extend(answer_records(examples, greedy.texts, scores))
    result = {"accuracy": accuracy(scores), **walk_metrics(task, greedy.texts, examples),
              **_token_figures(greedy.batches)}
    result["kv"] = {**_sparsity_settings(compression, kv_dtype), "kv_dtype": kv_dtype, **_kv_figures(greedy.batches)}
    if sparse and measure_alpha:
        result.update(rollout_alpha_metrics(model, greedy.batches, 0.0, alpha_bin_size))
    if samples > 0:
        sampled = complete(model, tokenizer, examples, max_new_tokens, temperature, compression, limits=limits,
                           samples=samples, seed=seed, progress=label("sampled"), kv_dtype=kv_dtype)
        hits = [is_correct(r) for r in rewards.score_examples(examples, sampled.texts, sampled.ids, samples)]
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


def accuracy(task_scores: list[float]) -> float:
    """The share of completions the task's own reward calls correct (`is_correct`)."""
    return sum(map(is_correct, task_scores)) / max(len(task_scores), 1)


def _sparsity_settings(compression: KVCompression | BlockSparsity | None, kv_dtype: str) -> dict:
    if compression is None:  # every token kept: the dense sampler, unless the cache is stored quantized
        return {"sparsity": "dense" if kv_dtype == "auto" else "none"}
    schedule = None if compression.schedule is None else list(compression.schedule.budgets)
    if isinstance(compression, BlockSparsity):
        return {"sparsity": "block", "budget": compression.budget, "schedule": schedule,
                "page_size": compression.page_size, "dense_layers": compression.dense_layers}
    return {"sparsity": "eviction", "policy": compression.policy, "budget": compression.budget, "schedule": schedule,
            "window": compression.window, "interval": compression.interval}


def _kv_figures(batches: list[RolloutBatch]) -> dict:
    stats = KVStats.merged([b.kv for b in batches], [len(b) for b in batches])
    return stats.summary(sum(b.rollout_seconds for b in batches))
