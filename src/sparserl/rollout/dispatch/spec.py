"""What a step samples with, all but the weights (`SamplerSpec`), and the sampler built from it.

The trainer builds a spec per step from the config and the KV budgets then in force; wherever the step samples
(this process, `local.py`, or a Ray worker, `ray_workers.py`) builds exactly the sampler the spec describes
(`build_sampler`), and rebuilds it only when the spec changed, so a sampler's settings are never changed from
outside and a speculative sampler keeps its adaptive draft length from step to step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import RolloutEngine
from ..sampler import Sampler
from ..sparsity.block_sparse import BlockSparsity
from ..sparsity.eviction import KVCompression
from ..speculative.drafts import WindowDraft
from ..speculative.sampler import SpeculativeSampler


@dataclass(frozen=True)
class SamplerSpec:
    """`sparsity`: KV eviction or block attention (None: dense). `draft`: set, speculative rollouts that draft
    with it and are exact dense samples (`sparsity` is then None). `record_evictions`: keep what replays the
    sparse sampler exactly (DistillSparse trains through it); `record_distributions`: keep what α needs."""

    sparsity: KVCompression | BlockSparsity | None = None
    draft: BlockSparsity | WindowDraft | None = None
    draft_tokens: int | str = 4
    record_evictions: bool = True
    record_distributions: bool = False

    @property
    def speculative(self) -> bool:
        return self.draft is not None


def build_sampler(model, spec: SamplerSpec) -> Sampler:
    """The sampler `spec` describes, over `model`'s current weights."""
    if spec.speculative:
        return SpeculativeSampler(model, spec.draft, spec.draft_tokens)
    return RolloutEngine(model, spec.sparsity, record_evictions=spec.record_evictions,
                         record_distributions=spec.record_distributions)


class SamplerCache:
    """The sampler of the last spec asked for over one model: built again only when the spec changes."""

    def __init__(self, model):
        self.model = model
        self.spec: SamplerSpec | None = None
        self.sampler: Sampler | None = None

    def get(self, spec: SamplerSpec) -> Sampler:
        if spec != self.spec:
            self.sampler, self.spec = build_sampler(self.model, spec), spec
        return self.sampler
