"""Teacher-forced log-probs of sampled responses under a dense model (π_old, π_ref and π_θ).

One parallel forward over prompt+response with full attention, in the engine's column layout
(left-padded prompt of width P, right-padded response of width T). Positions count real tokens
only, exactly as the sampler assigned them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids `[N, S]` that count real tokens only (left padding gets 0)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_log_distributions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               prompt_width: int) -> torch.Tensor:
    """Float32 log-distributions `[N, T, V]` over the next token at every response position."""
    response_width = input_ids.shape[1] - prompt_width
    outputs = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=positions_from_mask(attention_mask), use_cache=False,
                    logits_to_keep=response_width + 1)
    return torch.log_softmax(outputs.logits[:, :-1].float(), dim=-1)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N, T]` of `input_ids[:, P:]` given everything before; entropy `[N, T]` if asked.

    input_ids, attention_mask: `[N, P + T]`. Gradients flow if the caller has them enabled.
    """
    log_probs = response_log_distributions(model, input_ids, attention_mask, prompt_width)
    targets = input_ids[:, prompt_width:]
    token_logprobs = log_probs.gather(2, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return token_logprobs, entropy


def micro_batches(rows: int, size: int) -> Iterator[slice]:
    for start in range(0, rows, size):
        yield slice(start, min(start + size, rows))


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                     micro_batch_size: int) -> torch.Tensor:
    """`response_logprobs` without gradients, in micro-batches to bound memory; `[N, T]`."""
    parts = [response_logprobs(model, input_ids[s], attention_mask[s], prompt_width)[0]
             for s in micro_batches(input_ids.shape[0], micro_batch_size)]
    return torch.cat(parts, dim=0)
