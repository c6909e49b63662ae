"""The policy's update on one step's batch: PPO epochs over shuffled minibatches, each minibatch's loss
accumulated over micro-batches before one optimizer step (the loss is `learner.grpo.ppo_loss`).

A minibatch's rows are taken in batch order, so a group's rows sit next to each other and a forward that shares
each group's prompt (`--share-prompts`) computes it once per micro-batch; the loss is a sum over rows, so the order
changes no value beyond float rounding. π_θ's forward is the plain causal one, or another the caller gives
(`PolicyLogprobs`: the sparse sampler's replayed attention, `learner.sampler_forward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.forward import micro_batches, response_logprobs
from .grpo import ppo_loss, token_coefficients

# π_θ's log-probs and entropy (when asked) `[n, T]` of the batch's rows `rows` (indices, batch order), with gradients.
PolicyLogprobs = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def ppo_update(model, optimizer: torch.optim.Optimizer, batch, logp_old: torch.Tensor, logp_ref: torch.Tensor | None,
               advantages: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, generator: torch.Generator,
               train, temperature: float,
               first_forward: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               policy_logprobs: PolicyLogprobs | None = None) -> dict[str, float]:
    """`train.epochs` passes over `batch` (a `RolloutBatch`) in `train.minibatches` shuffled minibatches.

    logp_old, weights, keep: `[B, T]`; logp_ref: `[B, T]` or None; advantages: `[B]`. `first_forward`: the
    update's own forward (log-probs and entropy `[B, T]`, with gradients) when one optimizer step on the whole
    batch made it π_old's too. `policy_logprobs`: π_θ's forward (None: the dense one, each group's prompt once with
    `train.share_prompts`). `train`: a `TrainConfig`. Returns the averaged loss terms, the mean gradient norm
    and the optimizer steps taken (a minibatch with nothing kept, or with a gradient of exactly 0, takes none).
    """
    model.eval()  # dropout off, as in the sampler and π_old's forward: at the first minibatch π_θ / π_old is 1
    rows = len(batch)
    size = rows // train.minibatches
    forward = policy_logprobs or dense_logprobs(model, batch, temperature, train.share_prompts)
    totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0}
    grad_norms, steps = [], 0
    for _ in range(train.epochs):
        order = torch.arange(rows) if first_forward is not None else \
            torch.randperm(rows, generator=generator, device=generator.device).cpu()
        for start in range(0, rows, size):
            index = order[start:start + size].sort().values  # batch order: a group's rows side by side
            coefficients = token_coefficients(keep[index], train.loss_agg)
            if float(coefficients.sum()) == 0:
                continue
            if train.kl_coef == 0 and train.entropy_coef == 0 and not bool(advantages[index].any()):
                grad_norms.append(0.0)  # the gradient is exactly 0: no forward, no backward, no step (below)
                continue
            optimizer.zero_grad(set_to_none=True)
            for part in micro_batches(len(index), train.micro_batch_size):
                rows_part = index[part]
                logp_new, entropy = first_forward if first_forward is not None else \
                    forward(rows_part, train.entropy_coef > 0)
                terms = ppo_loss(logp_new, logp_old[rows_part], advantages[rows_part], weights[rows_part],
                                 coefficients[part], train.clip_eps, train.clip_eps_high,
                                 train.kl_coef, None if logp_ref is None else logp_ref[rows_part],
                                 train.entropy_coef, entropy)
                terms.loss.backward()
                share = len(rows_part) / len(index)
                for key in totals:
                    value = float(terms.loss.detach()) if key == "loss" else getattr(terms, key)
                    totals[key] += value if key in ("loss", "pg_loss", "kl", "entropy") else value * share
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip))
            grad_norms.append(norm)
            if norm == 0.0:
                # No signal (every advantage 0: each group's samples all right or all wrong, no KL, no entropy
                # term): AdamW would still move every weight along its moments, for dozens of steps after the last
                # real gradient. On SmolLM2 at lr 2e-5 that drift alone broke the model's arithmetic.
                continue
            optimizer.step()
            steps += 1
    optimizer.zero_grad(set_to_none=True)
    averaged = {k: v / max(steps, 1) for k, v in totals.items()}
    return {**averaged, "grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "optimizer_steps": steps}


def dense_logprobs(model, batch, temperature: float, share_prompts: bool) -> PolicyLogprobs:
    """π_θ's plain causal forward over `batch`'s rows (a `RolloutBatch`), at the sampler's `temperature`."""
    input_ids, attention_mask, width = batch.input_ids, batch.attention_mask, batch.prompt_ids.shape[1]

    def forward(rows: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return response_logprobs(model, input_ids[rows], attention_mask[rows], width,
                                 with_entropy=with_entropy, temperature=temperature, share_prompts=share_prompts)
    return forward
