"""What every draft of a speculative rollout shares: the interface (a dense draft, which narrows nothing), and
the registry that builds a rollout's draft from its settings.

Every draft reads the one full cache the verifier writes; it only narrows what a draft query attends to
(`select`, the mask provider's `select_keys`). A draft is one file in this package: its settings (a frozen
dataclass), its class registered with `@register_draft(NAME, settings type)` and `from_rollout_config`, and its
import line in `drafts/__init__.py`. `--speculative-draft NAME` picks one; no settings (None) is the dense draft,
identical to the verifier, which accepts every draft token (the tests' identity case).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ....errors import ConfigError
from ...cache import BufferCache


@dataclass(frozen=True)
class DraftKind:
    """A registered draft: the type of its settings, how a `RolloutConfig` gives them, and its class."""

    settings: type
    from_rollout_config: Callable
    draft: type


DRAFTS: dict[str, DraftKind] = {}


def register_draft(name: str, settings: type, from_rollout_config: Callable) -> Callable[[type], type]:
    """Class decorator: the draft `name` (`--speculative-draft NAME`), built for rollouts whose draft settings are
    of type `settings`; `from_rollout_config(rollout)` gives those settings from a `RolloutConfig`."""
    def register(cls: type) -> type:
        DRAFTS[name] = DraftKind(settings, from_rollout_config, cls)
        return cls
    return register


def draft_from_config(rollout):
    """The draft settings a `RolloutConfig` asks for with `speculative_draft`, at its `kv_budget`."""
    if rollout.speculative_draft not in DRAFTS:
        raise ConfigError(f"speculative_draft {rollout.speculative_draft!r} is unknown; choose one of "
                          f"{', '.join(sorted(DRAFTS))}")
    return DRAFTS[rollout.speculative_draft].from_rollout_config(rollout)


def build_draft(settings, cache: BufferCache, steps: int, width: int):
    """The draft for one rollout over `cache` (prompts of width `width`, `steps` new tokens) with `settings`."""
    if settings is None:
        return DenseDraft()
    kind = next((k for k in DRAFTS.values() if isinstance(settings, k.settings)), None)
    if kind is None:
        raise TypeError(f"no draft is registered for settings of type {type(settings).__name__}")
    return kind.draft(settings, cache, steps, width)


class DenseDraft:
    """Narrows nothing: every draft query reads every key (the verifier's own attention).

    A draft runs inside the speculative sampler's static steps: `begin_step` (on the host, before each draft step)
    sets what shapes the next one (`static_key`); `select` and `commit_slots` run inside the steps, with tensor
    indices only; `static_tensors` are what they advance."""

    attended_frac = 1.0

    def begin_step(self, cached_len: int, length: int) -> None:
        pass

    def static_key(self) -> tuple:
        """Every Python value `select` and `commit_slots` read: a captured step freezes them in."""
        return ()

    def static_tensors(self) -> list[torch.Tensor]:
        return []

    def select(self, layer_idx: int, query: torch.Tensor, mask: torch.Tensor):
        return None

    def commit_slots(self, cache: BufferCache, slots: torch.Tensor, real: torch.Tensor) -> None:
        """The verification wrote the slots `slots [A, Q]`, real where `real [A, Q]`: now part of every row's context."""

    def recommit(self, cache: BufferCache) -> None:
        """The slots moved (a compaction, rows leaving): rebuild what the draft keeps of them."""


