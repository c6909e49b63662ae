"""DistillSparse (Sparrow): training the sparse sampler's LoRA adapter (`rollout.adapter`) toward the dense policy.

The adapter (peft LoRA, B = 0 at start, so the sampler starts as the policy) is switched on only
while the sparse engine samples (and for sparse-inference evaluation). The dense recompute of
π_old, the learner's update, the reference and α's dense side all see the plain policy. After each
policy update the adapter is trained on that step's rollouts through the exact replay of the
sparse sampler (which has gradients), with Sparrow's L_LoRA:

    PPO loss of the sparse forward against the sampler's recorded log-probs
    + λ · KL(π_dense ‖ π_sparse) summed over the vocabulary at every response position,

with π_dense the freshly updated policy. So the sparse sampler is pulled toward the dense policy,
and a smaller budget can reach the same acceptance-rate tail. Only the adapter's parameters move;
the policy's weights are saved without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.forward import (
    head_logits,
    logit_scale,
    map_head_chunks,
    micro_batches,
    response_hidden,
)
from ..rollout.adapter import AdapterConfig, SamplerAdapter, adapter_config
from ..rollout.batch import RolloutBatch
from ..rollout.sparsity.replay import sampler_replay
from .grpo import ppo_loss, token_coefficients


@dataclass
class DistillConfig:
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    lr: float = 1e-4
    kl_coef: float = 1.0
    clip_eps: float = 0.2
    grad_clip: float = 1.0
    loss_agg: str = "seq-mean-token-mean"
    temperature: float = 1.0  # the sampler's: its recorded log-probs are of logits / temperature
    share_prompts: bool = False  # forwards compute each group's prompt once (the same values and gradients)


def distill_config(train, temperature: float = 1.0) -> DistillConfig:
    """The `distill_*` fields of a `TrainConfig`, with its PPO clip, grad clip, loss aggregation and shared
    prompts, and the rollouts' sampling `temperature`."""
    return DistillConfig(adapter=adapter_config(train), lr=train.distill_lr, kl_coef=train.distill_kl_coef,
                         clip_eps=train.clip_eps, grad_clip=train.grad_clip, loss_agg=train.loss_agg,
                         temperature=temperature, share_prompts=train.share_prompts)


class DistillTrainer:
    """Trains `adapter` with its own optimizer after each policy update (checkpointed by
    `train.checkpoint`)."""

    def __init__(self, adapter: SamplerAdapter, config: DistillConfig):
        self.adapter = adapter
        self.model = adapter.model
        self.parameters = adapter.parameters
        self.config = config
        self.optimizer = torch.optim.AdamW(self.parameters.values(), lr=config.lr, weight_decay=0.0)

    def train_step(self, shards: list[RolloutBatch], advantages: torch.Tensor, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of L_LoRA on a step's rollouts of the adapted sampler; metrics back.

        shards: the step's rollout batches (each replays in its own column layout); advantages: [N]
        (the step's group advantages, the shards' rows in order).
        """
        cfg = self.config
        grads = {name: torch.zeros_like(p) for name, p in self.parameters.items()}
        totals = {"distill_pg_loss": 0.0, "distill_kl": 0.0, "distill_logp_gap": 0.0}
        # The loss aggregates over the step's rows as one batch, whatever the shards.
        span = max(b.response_mask.shape[1] for b in shards)
        masks = torch.cat([torch.nn.functional.pad(b.response_mask, (0, span - b.response_mask.shape[1]))
                           for b in shards])
        step_coefficients = token_coefficients(masks, cfg.loss_agg)  # [N, T]
        self.model.eval()  # dropout off: the sparse forward the adapter learns in is the sampler's
        first = 0
        for batch in shards:
            rows_here = slice(first, first + len(batch))
            first += len(batch)
            self._accumulate(batch, advantages[rows_here],
                             step_coefficients[rows_here, : batch.response_mask.shape[1]], micro_batch_size,
                             grads, totals)
        totals["distill_logp_gap"] /= max(float(masks.sum()), 1.0)
        for name, parameter in self.parameters.items():
            parameter.grad = grads[name]
        norm = torch.nn.utils.clip_grad_norm_(self.parameters.values(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, "distill_grad_norm": float(norm)}

    def _accumulate(self, batch: RolloutBatch, advantages: torch.Tensor, coefficients: torch.Tensor,
                    micro_batch_size: int, grads: dict, totals: dict) -> None:
        """Add one shard's gradients of L_LoRA to `grads`. advantages: [n]; coefficients: [n, T]."""
        cfg = self.config
        width = batch.prompt_ids.shape[1]
        for rows in micro_batches(len(batch), micro_batch_size):
            ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
            with torch.no_grad():  # the dense side: the updated policy, adapter off
                dense_hidden = response_hidden(self.model, ids, mask, width, cfg.share_prompts)
            # Everything of the sparse side, backward included, with the adapter on: the chunked
            # head recomputes its pieces during the backward pass.
            with self.adapter.active():
                sparse_hidden = response_hidden(self.model, ids, mask, width, cfg.share_prompts,
                                                masks=sampler_replay(self.model, batch, rows))
                logp_sparse, kl, logp_dense = map_head_chunks(self.model, sparse_hidden, self._distill_terms,
                                                              dense_hidden, ids[:, width:],
                                                              temperature=logit_scale(cfg.temperature))
                terms = ppo_loss(logp_sparse, batch.sampler_logprobs[rows], advantages[rows],
                                 torch.ones_like(logp_sparse), coefficients[rows], cfg.clip_eps, cfg.clip_eps)
                kl_term = (coefficients[rows] * kl).sum()
                loss = terms.loss + cfg.kl_coef * kl_term
                # Gradients for the adapter only: the policy's weights must not collect any.
                for grad, part in zip(grads.values(), torch.autograd.grad(loss, list(self.parameters.values()))):
                    grad += part
            totals["distill_pg_loss"] += float(terms.pg_loss)
            totals["distill_kl"] += float(kl_term.detach())
            gap = (logp_sparse.detach() - logp_dense).abs()
            totals["distill_logp_gap"] += float((gap * batch.response_mask[rows]).sum())

    def _distill_terms(self, sparse: torch.Tensor, dense_hidden: torch.Tensor, targets: torch.Tensor):
        """Per position: the sparse log-prob of the sampled token, KL(dense ‖ sparse) over the
        vocabulary, and the dense log-prob (no gradient), all at the sampler's temperature.
        sparse: [n, c, V] log-probs."""
        with torch.no_grad():
            dense = torch.log_softmax(head_logits(self.model, dense_hidden) / logit_scale(self.config.temperature),
                                      dim=-1)
        kl = (dense.exp() * (dense - sparse)).sum(dim=-1)
        token = targets[..., None]
        return sparse.gather(2, token).squeeze(-1), kl, dense.gather(2, token).squeeze(-1)
