"""Teacher-forced log-probs of sampled responses under a dense model (π_old, π_ref and π_θ).

One parallel forward over prompt+response with full attention, in the engine's column layout
(left-padded prompt of width P, right-padded response of width T). Positions count real tokens
only, exactly as the sampler assigned them. With `share_prompts` each group's prompt is computed once
(`shared_prompt.py`), with the same outputs and gradients; with `masks` each query sees what a sparse sampler
saw (its exact replay), and with a `SamplerView` every layer's keys and values are also what a quantized sampler's
cache gave back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .attention import FixedMasks, SamplerView, masked_attention
from .shared_prompt import prompt_groups, shared_prompt_hidden
from .structure import positions_from_mask, rope_depends_on_length, text_config

# Bytes of float32 logits one chunk may hold: positions are processed so many at a time that
# [rows, chunk, V] stays under it (one chunk for a small vocabulary; 16 positions of 8 rows at V = 128k).
LOGIT_CHUNK_BYTES = 64 * 2**20


def response_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                    share_prompts: bool = False, masks: list[torch.Tensor] | SamplerView | None = None) -> torch.Tensor:
    """Final hidden states `[N, T, H]` at the positions that predict the response tokens.

    `share_prompts`: runs of rows with the same prompt compute it once (when some run holds two rows or more, and
    the model's RoPE does not depend on the forward's length: dynamic NTK or LongRoPE would rotate a prompt-only
    forward otherwise than the whole sequence's).
    `masks`: per layer, bool `[N, Hs, S, S]`, what each query sees (a sparse sampler's replay), or a `SamplerView`
    (`rollout.sparsity.replay.sampler_replay`: those masks and the sampler's K/V quantization); else the plain
    causal forward.
    """
    view = SamplerView.of(masks)
    if share_prompts and not rope_depends_on_length(text_config(model)) and \
            len(prompt_groups(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])[1]) < len(input_ids):
        return shared_prompt_hidden(model, input_ids, attention_mask, prompt_width, view)
    decoder, positions = model.get_decoder(), positions_from_mask(attention_mask)
    if view is None:
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    else:
        with masked_attention(model, FixedMasks(view.masks, view.kv_transform)):
            outputs = decoder(input_ids=input_ids, position_ids=positions, use_cache=False)
    return outputs.last_hidden_state[:, prompt_width - 1:-1]


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits of the model's LM head, with its final soft-capping (Gemma-2/3), if it has one, taken as
    the model's forward takes it (in the head's dtype, / cap, tanh, · cap): the logits the sampler drew from."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    return (torch.tanh(logits / cap) * cap if cap else logits).float()


def position_chunks(rows: int, positions: int, vocab: int) -> list[slice]:
    step = max(1, LOGIT_CHUNK_BYTES // max(1, rows * vocab * 4))
    return [slice(start, min(start + step, positions)) for start in range(0, positions, step)]


def map_head_chunks(model, hidden: torch.Tensor, fn, *per_position: torch.Tensor,
                    temperature: float = 1.0) -> list[torch.Tensor]:
    """`fn(log_probs [N, c, V], *(x[:, chunk] for x in per_position))` over position chunks of
    `hidden` (log-probs of logits / temperature), each output `[N, c]` concatenated along positions. With gradients on, each chunk is
    recomputed in the backward pass (activation checkpointing), so the full `[N, T, V]` is never
    held: peak memory is one chunk's logits."""
    from torch.utils.checkpoint import checkpoint

    def piece(h, *xs):
        logits = head_logits(model, h)
        return fn(torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1), *xs)

    vocab = model.get_output_embeddings().weight.shape[0]
    outputs = []
    for chunk in position_chunks(hidden.shape[0], hidden.shape[1], vocab):
        args = (hidden[:, chunk], *(x[:, chunk] for x in per_position))
        result = checkpoint(piece, *args, use_reentrant=False) if torch.is_grad_enabled() else piece(*args)
        outputs.append(result if isinstance(result, tuple) else (result,))
    return [torch.cat(parts, dim=1) for parts in zip(*outputs)]


def logit_scale(temperature: float) -> float:
    """What a sampler at `temperature` divided its logits by: the temperature, or 1 for greedy (whose
    recorded log-probs are the plain softmax's). Log-probs set against the sampler's (ξ, α, the PPO
    ratio) are taken of the same distribution, as TRL and verl do; else at T = 0.7 a dense rollout
    would look off-policy (a sequence geometric mean of 0.91 on SmolLM2)."""
    return temperature if temperature > 0 else 1.0


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                      with_entropy: bool = False, temperature: float = 1.0, share_prompts: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N, T]` of `input_ids[:, P:]` given everything before, under the distribution a
    sampler at `temperature` draws from (`logit_scale`); entropy `[N, T]` of it if asked.

    input_ids, attention_mask: `[N, P + T]`. Gradients flow if the caller has them enabled. The
    vocabulary is never materialised for the whole batch (`map_head_chunks`).
    """
    hidden = response_hidden(model, input_ids, attention_mask, prompt_width, share_prompts)
    return hidden_logprobs(model, hidden, input_ids[:, prompt_width:], with_entropy, temperature)


def hidden_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N, T]` of `targets [N, T]` from the final hidden states `[N, T, H]` that predict them (through
    the LM head, at `temperature`), and the entropy `[N, T]` of each distribution if asked."""

    def per_token(log_probs, target):
        token = log_probs.gather(2, target[..., None]).squeeze(-1)
        if not with_entropy:
            return token
        return token, -(log_probs.exp() * log_probs).sum(dim=-1)

    results = map_head_chunks(model, hidden, per_token, targets, temperature=logit_scale(temperature))
    return results[0], (results[1] if with_entropy else None)


def micro_batches(rows: int, size: int) -> Iterator[slice]:
    for start in range(0, rows, size):
        yield slice(start, min(start + size, rows))


@torch.no_grad()
def batched_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                   micro_batch_size: int, share_prompts: bool = False) -> torch.Tensor:
    """`response_hidden` without gradients, in micro-batches to bound memory; `[N, T, H]`."""
    return torch.cat([response_hidden(model, input_ids[rows], attention_mask[rows], prompt_width, share_prompts)
                      for rows in micro_batches(input_ids.shape[0], micro_batch_size)])


@torch.no_grad()
def batched_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                     micro_batch_size: int, temperature: float = 1.0, share_prompts: bool = False) -> torch.Tensor:
    """`response_logprobs` without gradients, in micro-batches to bound memory; `[N, T]`."""
    return torch.cat([response_logprobs(model, input_ids[rows], attention_mask[rows], prompt_width,
                                        temperature=temperature, share_prompts=share_prompts)[0]
                      for rows in micro_batches(input_ids.shape[0], micro_batch_size)])
