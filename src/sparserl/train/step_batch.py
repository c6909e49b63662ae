"""What one training step carries from stage to stage, and the step's diagnostics of it.

The stages of the step pipeline (`pipeline.py`) fill a `StepBatch` in order:
sample → score → recompute → correct → update → diagnose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..learner.corrections import Corrections, rejection_by_length
from ..rollout.batch import RolloutBatch
from ..rollout.dispatch.shards import StepRollouts
from ..tasks.base import Example, Task, walk_metrics

LENGTH_BUCKETS = 4
# What Sparse-RL's filters would flag, logged under these names in every mode (whatever the mode
# applies) so that the mismatch is comparable across modes; the unprefixed metrics are what was applied.
FLAGGED_METRICS = {"rejected_seq_frac": "flagged_veto_frac", "band_mask_frac": "flagged_band_frac",
                   "rejected_sequences": "flagged_vetoed_sequences"}


@dataclass
class StepBatch:
    """One step's data (B = prompts × group rows, T = response positions).

    sample: `examples` (one per prompt), `rollouts` (the shards as sampled), `batch` (their rows for
        the learner), `generator` (the minibatch shuffle's, seeded with the step's seed);
    score: `texts` (B decoded responses), `rewards` [B] float32 (the weighted sum of the reward functions),
        `correct` [B] bool (the task's own reward calls the response correct, `is_correct`);
    recompute: `logp_old` [B, T] (π_old's log-probs of the sampled tokens, the loss's), `logp_ref` [B, T] (the
        reference model's, when kl_coef > 0), `fused_forward` (the update's own forward, log-probs and
        entropy, when one optimizer step makes it π_old's too), `acceptance` (α metrics of a sparse sampler),
        `logp_dense` [B, T] (the dense policy's, where π_old is not it: a learner through the sampler's attention);
    correct: `corrections` (what the mode applies), `flagged` (what Sparse-RL's filters would flag), both of the
        sampler against the dense policy, `learner_metrics` (the loss's own ratio, where π_old is not the dense
        policy), `advantages` [B].
    """

    step: int
    examples: list[Example]
    rollouts: StepRollouts
    batch: RolloutBatch
    generator: torch.Generator
    texts: list[str] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    fused_forward: tuple[torch.Tensor, torch.Tensor | None] | None = None
    acceptance: dict[str, float] = field(default_factory=dict)
    logp_dense: torch.Tensor | None = None
    corrections: Corrections | None = None
    flagged: Corrections | None = None
    learner_metrics: dict[str, float] = field(default_factory=dict)
    advantages: torch.Tensor | None = None


def reward_metrics(rewards: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """The step's rewards [B] and the share of responses that solved their task (`correct` [B] bool)."""
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "accuracy": float(correct.float().mean())}


def kept_vs_rejected(rewards: torch.Tensor, lengths: torch.Tensor, seq_keep: torch.Tensor, prefix: str,
                     rejected: str) -> dict[str, float]:
    """Reward and length of the rollouts a filter keeps vs removes whole: does it separate good from bad?"""
    out = {}
    for name, rows in (("kept", seq_keep), (rejected, ~seq_keep)):
        if bool(rows.any()):
            out[f"{prefix}reward_{name}_mean"] = float(rewards[rows].mean())
            out[f"{prefix}response_len_{name}_mean"] = float(lengths[rows].float().mean())
    return out


def kept_advantages(advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """The advantages that still train after the filters. Group advantages sum to 0; a filter that
    removes more of one sign leaves a net push (`kept_advantage_sum` ≠ 0) on the kept rows.

    advantages: [B]; keep: [B, T] 0/1.
    """
    rows = keep.sum(dim=1) > 0
    kept = advantages[rows]
    return {"kept_advantage_sum": float(kept.sum()),
            "kept_advantage_mean": float(kept.mean()) if len(kept) else 0.0,
            "kept_advantage_token_mean": float((advantages[:, None] * keep).sum() / keep.sum().clamp(min=1))}


@torch.no_grad()
def learner_ratio_metrics(logp_old: torch.Tensor, logp_sampler: torch.Tensor,
                          response_mask: torch.Tensor) -> dict[str, float]:
    """Where the loss's π_old is not the dense policy (a learner through the sampler's attention): that it is, and
    its ratio to the sampler at the start of the update, π_old / π_sampler over the response tokens, smallest and
    largest (1 up to float rounding, since π_old replays the sampler). The unprefixed ξ metrics stay the sampler
    against the dense policy, as in every mode. All `[B, T]`."""
    log_ratio = (logp_old.double() - logp_sampler.double())[response_mask.bool()]
    if not len(log_ratio):
        return {"learner_attention_sampler": 1.0, "learner_xi_min": 1.0, "learner_xi_max": 1.0}
    return {"learner_attention_sampler": 1.0, "learner_xi_min": float(log_ratio.min().exp()),
            "learner_xi_max": float(log_ratio.max().exp())}


def length_edges(max_new_tokens: int) -> list[int]:
    """The inner edges of LENGTH_BUCKETS equal response-length buckets up to `max_new_tokens`."""
    return [math.ceil(max_new_tokens * i / LENGTH_BUCKETS) for i in range(1, LENGTH_BUCKETS)]


def diagnose(data: StepBatch, task: Task, group_size: int, max_new_tokens: int) -> dict[str, float]:
    """Mismatch, rejection and acceptance metrics of the step, and the task's own."""
    batch, rewards, corrections, flagged = data.batch, data.rewards, data.corrections, data.flagged
    by_length = rejection_by_length(batch.response_lengths, flagged.seq_keep, length_edges(max_new_tokens))
    return {
        **corrections.metrics,
        **{flagged_name: flagged.metrics[name] for name, flagged_name in FLAGGED_METRICS.items()},
        **{"flagged_" + key: value for key, value in by_length.items()},
        **kept_vs_rejected(rewards, batch.response_lengths, flagged.seq_keep, "flagged_", "vetoed"),
        **kept_vs_rejected(rewards, batch.response_lengths, corrections.seq_keep, "", "rejected"),
        **kept_advantages(data.advantages, corrections.keep_mask),
        **walk_metrics(task, data.texts, data.examples, group_size),
        **data.acceptance,
        **data.learner_metrics,
    }


def rollout_samples(data: StepBatch, group_size: int) -> list[dict]:
    """Each rollout's text, reward, verdict and whether the correction kept it (`samples.jsonl`)."""
    kept = data.corrections.seq_keep.tolist()
    return [{"step": data.step, "kind": "train", "prompt_index": row // group_size,
             "prompt": data.examples[row // group_size].prompt, "completion": text,
             "reward": reward, "correct": correct, "kept": keep}
            for row, (text, reward, correct, keep) in enumerate(zip(data.texts, data.rewards.tolist(),
                                                                     data.correct.tolist(), kept))]
