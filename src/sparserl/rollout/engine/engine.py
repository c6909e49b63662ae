"""The rollout engine: batched sampling with its own decode loop and KV cache (the dense sampler, and the
sparse one with a `KVCompression` or a `BlockSparsity`).

`RolloutEngine.generate` samples one response per prompt row (the caller repeats each prompt G
times for a group), recording for every response token the log-prob of the exact distribution it
was drawn from (temperature applied, no top-p/top-k). With a `KVCompression` it compresses the
cache while decoding (a sparse rollout); with a `BlockSparsity` it keeps the whole cache and each
decode step attends to a budget of pages (`block_sparse.py`); without either it is the dense
sampler. All run the same code, so a sparse rollout whose budget is never reached is bitwise the
dense rollout. With `kv_dtype` fp8 or int8 the cache stores keys and values quantized (`quantization.py`), alone or
under any KV policy, and the batch records the scales its exact replay needs.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...model.clock import now
from ..batch import RolloutBatch, SamplingConfig, left_pad
from ..cache import build_cache
from ..quantization import kv_format
from ..sparsity.block_sparse import BlockSparsity
from ..sparsity.eviction import KVCompression
from .decode_loop import DecodeLoop
from .step import StepRunner

FULL_DISTRIBUTION_VOCAB = 4096


class RolloutEngine:
    """Samples from a causal LM with a dense or compressed KV cache, or block-sparse attention (a
    `rollout.sampler.Sampler`).

    `record_distributions` keeps what the acceptance rate α needs: the sampler's processed next-token
    distribution at every response position for a vocabulary up to FULL_DISTRIBUTION_VOCAB, else
    the eviction records or page selections that replay the sampler exactly (`RolloutBatch`).
    """

    def __init__(self, model, compression: KVCompression | BlockSparsity | None = None,
                 record_evictions: bool = True, record_distributions: bool = False,
                 release_finished_rows: bool = True, check_every: int = 4,
                 runners: dict[str, StepRunner] | None = None, kv_dtype: str = "auto"):
        """`release_finished_rows=False` keeps every row in the batch until the longest ends (a static
        batch, the engine's shape before rows could leave; `bench/scheduler.py` compares the two).
        `check_every`: decode steps between the loop's reads of which rows ended (each read waits for the device).
        How the static decode step runs is the sampling's `compile_decode` (`step.StepRunner`); `runners`: the
        runners by mode, shared with the samplers before and after this one (the dispatch's `SamplerCache`), so
        that compilations last the run. `kv_dtype`: auto (the model's dtype), fp8 or int8 (a quantized cache)."""
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.kv_dtype, self.kv_format = kv_dtype, kv_format(kv_dtype)
        if self.kv_format is not None and isinstance(compression, BlockSparsity):
            raise ConfigError(f"kv_dtype {kv_dtype} does not combine with block-sparse attention, which reads the "
                              "cache's pages unquantized: use --kv-dtype auto or --sparsity eviction")
        self.model = model
        self.runners = runners if runners is not None else {}  # by mode: a runner keeps its compilations
        self.check_every = check_every
        self.num_layers = len(decoder_layers(model))
        self.release_finished_rows = release_finished_rows
        self.compression = compression
        self.policy = compression.build_policy() if isinstance(compression, KVCompression) else None
        self.record_distributions = record_distributions
        large_vocabulary = model.get_output_embeddings().weight.shape[0] > FULL_DISTRIBUTION_VOCAB
        self.record_evictions = record_evictions or (record_distributions and large_vocabulary)

    def step_runner(self, compile_decode: str) -> StepRunner:
        """The runner of the static decode step for `compile_decode` on the model's device."""
        runner = StepRunner.for_model(compile_decode, self.model)
        return self.runners.setdefault(runner.mode, runner)

    def take_stats(self) -> None:
        """Nothing is counted beyond each batch's own `kv` figures."""
        return None

    @property
    def refills_rows(self) -> bool:
        """Whether `generate` admits waiting requests into the rows that leave (continuous batching);
        block-sparse and static-batch rollouts run their requests in waves instead."""
        return self.release_finished_rows and not isinstance(self.compression, BlockSparsity)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 generator: torch.Generator | None = None, on_step=None,
                 seeds: list[int] | None = None, max_rows: int | None = None) -> RolloutBatch:
        """Sample one response per prompt, at most `max_rows` rows at a time (None: all at once), through
        a `DecodeLoop`: a row that ended leaves the batch once an eighth of its rows have ended, and
        waiting prompts join in its place (continuous batching; `decode_loop.py`). Randomness comes
        from `seeds` (one per prompt: a row's draw at a step is a function of its seed and its step,
        `row_uniforms`, so its tokens do not depend on the other rows) or else from the one `generator`
        shared by the batch. `on_step`, if given, is called after each decode step."""
        device = next(self.model.parameters()).device
        started = now(device)
        prompt_ids, prompt_mask = left_pad(prompts, sampling.pad_token_id, sampling.prompt_width)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        row_seeds = torch.tensor(seeds, dtype=torch.long, device=device) if seeds is not None else None
        vocabulary = self.model.get_output_embeddings().weight.shape[0]
        loop = DecodeLoop(self, prompt_ids, prompt_mask, sampling, generator, row_seeds,
                          max_rows=min(max_rows or len(prompts), len(prompts)),
                          record_distributions=self.record_distributions and vocabulary <= FULL_DISTRIBUTION_VOCAB,
                          on_step=on_step).run()
        stats = loop.stats
        peaks = loop.cache.peak_bytes() if loop.cache is not None else {}  # None: no token asked for
        stats.kv_peak_bytes_by_layer_type = peaks
        stats.kv_peak_bytes = sum(peaks.values())
        out = loop.out
        span = int(out.lengths.max())
        stats.kv_dtype = self.kv_dtype
        if loop.cache is not None:  # a dense cache of the rows first in flight, prompt width + longest response
            stats.kv_slot_bytes = loop.cache.slot_bytes()
            stats.kv_dense_bytes = stats.kv_slot_bytes * loop.max_rows * (prompt_ids.shape[1] + span)
        stats.kept_tokens, stats.evicted_tokens = loop.held, out.fed.float() - loop.held
        if loop.selector is not None:
            stats.attended_frac = loop.selector.attended_frac
        response_mask = (torch.arange(span, device=device)[None, :] < out.lengths[:, None]).float()
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=out.ids[:, :span], response_mask=response_mask,
            sampler_logprobs=out.logprobs[:, :span], prompt_lengths=loop.prompt_lengths,
            response_lengths=out.lengths, ended=out.ended,
            rollout_seconds=now(device) - started, kv=stats,
            evictions=loop.evictions(), block_selections=loop.selector.record if loop.selector is not None else None,
            sampler_distribution=out.distributions[:, :span] if out.distributions is not None else None,
            replayable=self.compression is None or self.record_evictions, kv_scales=loop.kv_scales,
        )

    def capacities(self, width: int, steps: int, num_layers: int) -> list[int]:
        """Slots each layer's buffer may reach for prompts of width `width` and `steps` new tokens: the
        whole sequence when dense (or block-sparse, in whole pages); max(prompt, the layer's largest
        budget) + one interval when compressed."""
        comp = self.compression if isinstance(self.compression, KVCompression) else None
        if comp is None:
            return [self.full_capacity(width, steps)] * num_layers
        budgets = self.layer_budgets(comp.budgets.max_budget, num_layers)
        return [min(max(width, budgets[i]) + comp.interval, width + steps) for i in range(num_layers)]

    def full_capacity(self, width: int, steps: int) -> int:
        """The dense cache's slots (and sliding-window layers'): the whole sequence, in whole pages under
        block attention, which gathers whole pages of the buffers."""
        page = self.compression.page_size if isinstance(self.compression, BlockSparsity) else 1
        return -(-(width + steps) // page) * page

    def row_bytes(self, width: int, steps: int) -> int:
        """The KV bytes one row can reach (its buffers at capacity) for prompts of width `width` and
        `steps` new tokens."""
        parameter = next(self.model.parameters())
        capacities = self.capacities(width, steps, self.num_layers)
        full = self.full_capacity(width, steps)
        # An empty cache of one row: its layers know their kinds and capacities and allocate nothing yet.
        cache = build_cache(self.model, 1, capacities, False, parameter.dtype, parameter.device, full_capacity=full,
                            kv_format=self.kv_format)
        return sum(layer.max_capacity * layer.slot_bytes() for layer in cache.layers)

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        return [self.policy.layer_budget(budget, i, num_layers) for i in range(num_layers)]


def decoder_layers(model) -> list:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(base.layers)
