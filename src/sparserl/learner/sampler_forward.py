"""The learner's forwards through the sparse sampler's attention (a preset's `learner_attention: sampler`, the
`sparse-learner` mode; the idea of awslabs' keys_values, which runs GRPO through an H2O cache in the rollout and in
the learner's forward alike).

π_old, π_θ (the PPO loss and its gradient) and π_ref are then teacher-forced forwards under the exact replay of what
each row's sampler attended (`rollout.sparsity.replay`): π_old is the sampler's own policy (to float rounding), so the
loss's ratio π_θ / π_old starts at 1 with no correction, and the policy is trained for the sparse inference it
samples with. The reference model's log-probs go through the same replay: the KL term then measures how far the
policy moved from its start under the same attention (0 at step 1, as in dense GRPO), not the sparse-vs-dense gap,
which would otherwise pull the sparse forward toward the dense reference whatever the policy learned.

A step's shards each replay in their own column layout (`rollout.dispatch.shards.concat_rollouts` keeps no eviction
record in the merged batch): `SamplerForward` takes any rows of the step's merged batch from their shards and pads
their log-probs to its response width. Memory: the replay's masks, `[n, Hs, S, S]` bool per layer for a micro-batch
of n rows, beside the forward's own activations.
"""

from __future__ import annotations

import torch

from ..model.forward import hidden_logprobs, micro_batches, response_hidden
from ..rollout.batch import RolloutBatch
from ..rollout.sparsity.replay import sampler_replay


class SamplerForward:
    """Log-probs of a step's sampled tokens under a model attending as the step's sparse sampler did.

    shards: the step's rollout batches as sampled (each recorded with its evictions or page selections), whose rows
    in order are the merged batch's; share_prompts: each group's prompt computed once; temperature: the sampler's.
    """

    def __init__(self, shards: list[RolloutBatch], share_prompts: bool = False, temperature: float = 1.0):
        if not all(shard.replayable for shard in shards):
            raise ValueError("training through the sampler's attention needs rollouts that replay it: sample them "
                             "with record_evictions (a dense or speculative sampler has no sparse attention)")
        self.shards, self.share_prompts, self.temperature = shards, share_prompts, temperature
        sizes = torch.tensor([len(shard) for shard in shards])
        self.ends = sizes.cumsum(0)
        self.starts = self.ends - sizes
        self.rows = int(sizes.sum())
        self.span = max(shard.response_ids.shape[1] for shard in shards)

    def logprobs(self, model, rows: slice | torch.Tensor | None = None,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs `[n, T]` of the merged batch's rows `rows` (indices or a slice; all when None), and their
        entropy `[n, T]` if asked, T the merged batch's response width (0 beyond a shard's own). Gradients flow if
        the caller has them enabled; one forward per shard the rows touch."""
        index = torch.arange(self.rows)[slice(None) if rows is None else rows].cpu()
        shard_of = torch.bucketize(index, self.ends, right=True)
        logps, entropies, picked = [], [], []
        for number, shard in enumerate(self.shards):
            here = (shard_of == number).nonzero().squeeze(1)
            if len(here):
                logp, entropy = self._shard_logprobs(model, shard, index[here] - self.starts[number], with_entropy)
                logps.append(self._pad(logp))
                entropies.append(self._pad(entropy) if with_entropy else None)
                picked.append(here)
        order = torch.cat(picked).argsort()  # back to the order of `rows`
        logp = torch.cat(logps)[order]
        return logp, (torch.cat(entropies)[order] if with_entropy else None)

    @torch.no_grad()
    def batched_logprobs(self, model, micro_batch_size: int) -> torch.Tensor:
        """`logprobs` of every row without gradients, in micro-batches to bound memory (the replay's masks
        included); `[N, T]`."""
        return torch.cat([self.logprobs(model, rows)[0] for rows in micro_batches(self.rows, micro_batch_size)])

    def _shard_logprobs(self, model, shard: RolloutBatch, rows: torch.Tensor, with_entropy: bool):
        width = shard.prompt_ids.shape[1]
        ids, mask = shard.input_ids[rows], shard.attention_mask[rows]
        # The one question this mode asks of the replay: what these rows' sampler attended.
        seen = sampler_replay(model, shard, rows)
        hidden = response_hidden(model, ids, mask, width, self.share_prompts, masks=seen)
        return hidden_logprobs(model, hidden, ids[:, width:], with_entropy, self.temperature)

    def _pad(self, values: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(values, (0, self.span - values.shape[1]))
