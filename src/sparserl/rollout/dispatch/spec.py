"""What a step samples with, all but the weights (`SamplerSpec`), and the sampler built from it.

The trainer builds a spec per step from the config and the KV budgets then in force; wherever the step samples
(this process, `local.py`, or a Ray worker, `ray_workers.py`) builds exactly the sampler the spec describes
(`build_sampler`), and rebuilds it only when the spec changed, so a sampler's settings are never changed from
outside and a speculative sampler keeps its adaptive draft length from step to step. The runners of the static steps
(`engine.step.StepRunner`) outlive the samplers: one set per model, for the whole run, so that a budget that moves
does not compile the steps again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ..engine.engine import RolloutEngine
from ..engine.step import StepRunner
from ..sampler import Sampler
from ..sparsity.block_sparse import BlockSparsity
from ..sparsity.eviction import KVCompression
from ..speculative.drafts import WindowDraft
from ..speculative.sampler import SpeculativeSampler


@dataclass(frozen=True)
class SamplerSpec:
    """`sparsity`: KV eviction or block attention (None: dense). `draft`: set, speculative rollouts that draft
    with it and are exact dense samples (`sparsity` is then None). `record_evictions`: keep what replays the
    sparse sampler exactly (DistillSparse trains through it); `record_distributions`: keep what α needs. `kv_dtype`:
    how the cache stores keys and values (auto: the model's dtype; fp8 or int8: quantized, `quantization.py`)."""

    sparsity: KVCompression | BlockSparsity | None = None
    draft: BlockSparsity | WindowDraft | None = None
    draft_tokens: int | str = 4
    record_evictions: bool = True
    record_distributions: bool = False
    kv_dtype: str = "auto"

    @property
    def speculative(self) -> bool:
        return self.draft is not None


def build_sampler(model, spec: SamplerSpec, runners: dict[str, StepRunner] | None = None) -> Sampler:
    """The sampler `spec` describes, over `model`'s current weights, running its steps through `runners` (None: its
    own)."""
    if spec.speculative:
        if spec.kv_dtype != "auto":
            raise ConfigError(f"kv_dtype {spec.kv_dtype} does not combine with speculative rollouts, whose dense "
                              "verification must read unquantized keys: use --kv-dtype auto or --speculative false")
        return SpeculativeSampler(model, spec.draft, spec.draft_tokens, runners=runners)
    return RolloutEngine(model, spec.sparsity, record_evictions=spec.record_evictions,
                         record_distributions=spec.record_distributions, runners=runners, kv_dtype=spec.kv_dtype)


class SamplerCache:
    """The sampler of the last spec asked for over one model: built again only when the spec changes, with the step
    runners of the whole run (by mode for the engine, by `compile_decode` for the speculative sampler)."""

    def __init__(self, model):
        self.model = model
        self.spec: SamplerSpec | None = None
        self.sampler: Sampler | None = None
        self.engine_runners: dict[str, StepRunner] = {}
        self.speculative_runners: dict[str, StepRunner] = {}

    def get(self, spec: SamplerSpec) -> Sampler:
        if spec != self.spec:
            runners = self.speculative_runners if spec.speculative else self.engine_runners
            self.sampler, self.spec = build_sampler(self.model, spec, runners), spec
        return self.sampler
