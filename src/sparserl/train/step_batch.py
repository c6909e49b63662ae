"""What one training step carries from stage to stage, and the step's diagnostics of it.

The stages of `GRPOTrainer.train_step` fill a `StepBatch` in order:
sample → score → recompute → correct → update → diagnose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..learner.corrections import Corrections
from ..rollout.batch import RolloutBatch
from ..rollout.dispatch.shards import StepRollouts
from ..tasks.base import Example


@dataclass
class StepBatch:
    """One step's data (B = prompts × group rows, T = response positions).

    sample: `examples` (one per prompt), `rollouts` (the shards as sampled), `batch` (their rows for
        the learner), `generator` (the minibatch shuffle's, seeded with the step's seed);
    score: `texts` (B decoded responses), `rewards` [B] float32 (the weighted sum of the reward functions),
        `correct` [B] bool (the task's own reward calls the response correct, `is_correct`);
    recompute: `logp_old` [B, T] (π_old's log-probs of the sampled tokens), `logp_ref` [B, T] (the
        reference model's, when kl_coef > 0), `fused_forward` (the update's own forward, log-probs and
        entropy, when one optimizer step makes it π_old's too), `acceptance` (α metrics of a sparse sampler);
    correct: `corrections` (what the mode applies), `flagged` (what Sparse-RL's filters would flag),
        `advantages` [B].
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
    corrections: Corrections | None = None
    flagged: Corrections | None = None
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
