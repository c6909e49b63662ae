"""How a rollout draws its tokens: from the processed next-token distribution, by inverse CDF of one
uniform per row that is a pure function of the row's seed and its step (counter based), so a row's
tokens depend on nothing else: not the rows beside it, not the rows in flight, not the device."""

from __future__ import annotations

import torch

from ...model.forward import logit_scale


def draw_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                draws: torch.Tensor | None = None):
    """Token `[N]`, its log-prob `[N]` and the whole log-distribution `[N, V]` it was drawn from.
    `draws`: one uniform per row `[N]` (float64), inverted through the row's CDF; else `generator`."""
    logp = processed_logprobs(logits, temperature)
    if temperature <= 0:
        token = logp.argmax(dim=-1)
    elif draws is not None:
        cdf = cumulative_sum(logp.double().exp())
        # right=True: the first token whose CDF passes the draw, so tokens of probability 0 are never drawn.
        token = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
        token = token.clamp_(max=logp.shape[-1] - 1)
    else:
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return token, logp.gather(1, token[:, None]).squeeze(1), logp


@torch.library.custom_op("sparserl::cumulative_sum", mutates_args=())
def cumulative_sum(probabilities: torch.Tensor) -> torch.Tensor:
    """`probabilities.cumsum(-1)` `[N, V]`, opaque to torch.compile: a compiled step draws through the same ATen scan
    as an eager or captured one, and Inductor's own float64 scan over a vocabulary fails to generate code for some
    row counts (torch 2.11 on CUDA at 64 rows; docs/benchmarks.md)."""
    return probabilities.cumsum(dim=-1)


@cumulative_sum.register_fake
def _(probabilities: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(probabilities)


def processed_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution `draw_tokens` draws from, as float32 log-probs `[..., V]`: logits / T (greedy: T = 1,
    `logit_scale`; dividing by 1 changes no bit)."""
    return torch.log_softmax(logits.float() / logit_scale(temperature), dim=-1)


# splitmix64's constants as signed 64-bit integers (torch has no unsigned 64-bit arithmetic).
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _logical_shift(x, 30)) * _MIX1
    x = (x ^ _logical_shift(x, 27)) * _MIX2
    return x ^ _logical_shift(x, 31)


def row_uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row `[N]` float64, a pure function of (row seed, the row's decode step;
    `step` is one for all rows or `[N]`): counter
    based (splitmix64 of the pair, on int64 with wrap-around), so a row's draw depends on nothing else,
    neither the rows beside it nor the device."""
    mixed = _splitmix64(_splitmix64(seeds) + step)
    return (_logical_shift(mixed, 11).double() + 0.5) / float(1 << 53)


def stream_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """Seeds `[N]` of another counter stream of each row's seed: `row_uniforms` of them are independent
    of `row_uniforms(seeds, ·)` (the speculative sampler's acceptance tests and residual draws)."""
    return _splitmix64(_splitmix64(seeds) ^ stream)
