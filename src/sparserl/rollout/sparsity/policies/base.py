"""What every KV compression policy shares: the interface (`KVPolicy`, one `score` method), what it scores
(`ScoringInputs`), its options as config keys (`option`, `policy_options`), the registry (`register`,
`build_policy`), and the one rule that turns scores into kept slots (`select_slots`): the w most recent real
tokens, plus the B - w best-scored others, never a padding slot while a real token is left.

A policy is one file in this package: a dataclass whose fields are its options, decorated with `@register`, and
imported once in `policies/__init__.py` (its registration line). Each field is a config key and a flag of its own
(`kv_` + the field name, or the `option` named in its metadata, with the `help` given there), so a new option is
one field: `policy_options()` is what the config derives its `--kv-*` flags from, and an option several policies
share (the pooling of SnapKV, R-KV and PyramidKV) is one flag.

Default selection: one kept set shared per layer, scores summed over KV heads, as the Sparse-RL reference does;
per-head selection (kvpress, original SnapKV) is the option (`per_head=True` in the engine, which makes
`real`/`columns` carry one row per KV head). Shared is the default because one set per layer keeps one mask per
layer and gathers all heads with a single index. `score` always returns one score per KV head, so the same
policy serves both. Scores are computed in float32 on the keys' device.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ....errors import ConfigError

POLICIES: dict[str, type["KVPolicy"]] = {}
KERNEL_HELP = "snapkv, rkv, pyramidkv: 1-D pooling kernel over positions (odd)"
POOLING_HELP = "snapkv, rkv, pyramidkv: pooling over query heads and positions"


def register(cls: type["KVPolicy"]) -> type["KVPolicy"]:
    POLICIES[cls.name] = cls
    return cls


def option(default: Any, help: str, name: str | None = None) -> Any:
    """A policy option: a dataclass field that is also config key `name` (default `kv_<field>`) with `help`."""
    return field(default=default, metadata={"help": help, "option": name})


@dataclass(frozen=True)
class PolicyOption:
    """One config key (and flag) that sets a field of one or more registered policies."""

    key: str  # the config key, e.g. kv_lambda
    field: str  # the policy dataclass field it sets, e.g. lam
    annotation: Any
    default: Any
    help: str
    policies: tuple[str, ...]  # the registered policies that take it


def policy_options() -> dict[str, PolicyOption]:
    """Every option of every registered policy, by config key. Policies sharing a key share its default."""
    found: dict[str, PolicyOption] = {}
    for name, cls in sorted(POLICIES.items()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue  # set by the engine (PyramidKV's window), not by the user
            key = f.metadata["option"] or f"kv_{f.name}"
            known = found.get(key)
            if known and (known.field, known.default) != (f.name, f.default):
                raise AssertionError(f"policies {known.policies} and {name} give option {key} different fields "
                                     "or defaults; one key is one setting")
            takers = (known.policies if known else ()) + (name,)
            found[key] = PolicyOption(key, f.name, hints[f.name], f.default, f.metadata["help"], takers)
    return found


@dataclass
class ScoringInputs:
    """What a policy may look at for the layers `layers`, scored as one batch: the N rows are each layer's rows in
    turn (the compression stacks the layers that hold the same number of slots and the same budget). Hs is 1
    (shared kept set) or Hkv (per head)."""

    keys: torch.Tensor  # [N, Hkv, L, D] cached keys, post-RoPE
    queries: torch.Tensor  # [N, Hq, w, D] post-RoPE queries of the last w fed tokens (observation window)
    query_real: torch.Tensor  # [N, w] bool, False where a window query was padding
    real: torch.Tensor  # [N, Hs, L] bool, False for padding slots
    columns: torch.Tensor  # [N, Hs, L] long, the slot's column (larger is more recent); increasing along L
    attention_mass: torch.Tensor | None  # [N, Hkv, L] attention received so far (H2O), else None
    layers: tuple[int, ...]  # the layers stacked along N, each with N / len(layers) rows

    def per_kv_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`real` and `columns` broadcast to `[N, Hkv, L]`, so scoring code need not care about Hs."""
        n, hkv, length = self.keys.shape[:3]
        return self.real.expand(n, hkv, length), self.columns.expand(n, hkv, length)

    def all_real(self) -> bool:
        """Every slot holds a real token (then masks of padding slots change nothing and are skipped).
        Known only where asking is free (`host_reads_are_cheap`); elsewhere False, and the masks run."""
        if getattr(self, "_all_real", None) is None:
            self._all_real = host_reads_are_cheap(self.real) and bool(self.real.all())
        return self._all_real

    def every_row_real(self) -> bool:
        """Every (row, selection head) holds at least one real slot (known where asking is free, as `all_real`)."""
        if getattr(self, "_every_row_real", None) is None:
            self._every_row_real = host_reads_are_cheap(self.real) and bool(self.real.any(dim=-1).all())
        return self._every_row_real

    def all_queries_real(self) -> bool:
        if getattr(self, "_all_queries_real", None) is None:
            self._all_queries_real = host_reads_are_cheap(self.query_real) and bool(self.query_real.all())
        return self._all_queries_real


def additive_mask(keep: torch.Tensor) -> torch.Tensor:
    """Float32 0 where `keep`, -inf elsewhere. Added to logits it gives a masked_fill_'s values, and where
    it broadcasts (over query heads, a window) it is several times faster on a CPU."""
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, float("-inf"))


def host_reads_are_cheap(tensor: torch.Tensor) -> bool:
    """A value read back to Python costs nothing on a CPU, but stalls a GPU's queue: the shortcuts that
    need one (skipping masks, sort-free orders) run only on a CPU; the GPU path has no host reads."""
    return tensor.device.type == "cpu"


def build_policy(name: str, settings: Mapping[str, Any], window: int) -> "KVPolicy":
    """Policy `name`, its options read from `settings` (config key -> value; a key not there keeps the
    policy's default), and `window` (the compression's recent window) for the policies that shape around it."""
    if name not in POLICIES:
        raise ConfigError(f"kv_policy {name!r} is unknown; choose one of {', '.join(sorted(POLICIES))}")
    values = {o.field: settings[o.key] for o in policy_options().values() if name in o.policies and o.key in settings}
    if "window" in {f.name for f in dataclasses.fields(POLICIES[name])}:
        values["window"] = window
    return POLICIES[name](**values)


class KVPolicy:
    """Base class: subclasses are dataclasses (their fields are their options), set `name` and implement `score`."""

    name: ClassVar[str]
    needs_attention_mass: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """Float `[N, Hkv, L]` (or `[N, 1, L]`), higher means keep. Padding is handled by the caller."""
        raise NotImplementedError

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int) -> int:
        return budget

    def begin_rollout(self) -> None:
        """Forget any state kept from a previous rollout."""

    def before_keep(self, inputs: ScoringInputs, slots: torch.Tensor) -> None:
        """Called with the inputs just scored and the slots `[N, Hs, B]` about to be kept."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the per-row state of batch rows `rows` (the others finished; state kept for stacked layers,
        `ScoringInputs.layers`, keeps these rows of each layer)."""


def select_slots(scores: torch.Tensor, real: torch.Tensor, columns: torch.Tensor, budget: int,
                 window: int) -> torch.Tensor:
    """Slot indices `[N, Hs, budget]` to keep, in sequence order.

    scores `[N, Hkv or 1, L]` are summed over heads when one set is shared (`real` has Hs = 1), as
    the reference does. The `window` most recent real slots are always kept; padding never is while
    real tokens remain. Ties, padding included, go to the more recent slot, so the choice is
    deterministic.
    """
    if budget > real.shape[-1]:
        raise ValueError(f"budget {budget} exceeds the {real.shape[-1]} slots held")
    if real.shape[1] == 1 and scores.shape[1] != 1:
        scores = scores.sum(dim=1, keepdim=True)
    scores = scores.to(torch.float64).expand_as(real)
    length = real.shape[-1]
    # Slots in column order (columns strictly increasing and >= 0, as the cache keeps them): the recency
    # order, real slots newest first and then padding oldest first, is counts of real slots; the same
    # order as the two sorts of the general case, without them.
    ordered = length > 0 and host_reads_are_cheap(columns) and \
        bool((columns.diff(dim=-1) > 0).all() & (columns[..., 0] >= 0).all())
    if ordered:
        slot = torch.arange(length, device=real.device)
        counted = real.cumsum(dim=-1)
        recent_rank = (counted[..., -1:] - counted).add_(slot.masked_fill(real, 0))
        recent_first = torch.empty_like(recent_rank).scatter_(-1, recent_rank, slot.expand_as(recent_rank))
    else:
        recency = torch.where(real, columns, -1)
        recent_first = recency.argsort(dim=-1, descending=True, stable=True)
        recent_rank = recent_first.argsort(dim=-1)
    in_window = real & (recent_rank < window)
    finite_max = torch.finfo(torch.float64).max
    # Three tiers: window (+inf) above every real score (finite) above padding (-inf).
    tiered = scores.nan_to_num(nan=-finite_max, posinf=finite_max, neginf=-finite_max)
    tiered = tiered.masked_fill_(in_window, float("inf")).masked_fill_(~real, float("-inf"))
    # A stable sort of the recency-ordered scores breaks every tie towards the more recent slot.
    by_score = tiered.gather(-1, recent_first).argsort(dim=-1, descending=True, stable=True)
    chosen = recent_first.gather(-1, by_score[..., :budget])
    if ordered:  # column order is slot order
        return chosen.sort(dim=-1).values
    return chosen.gather(-1, columns.gather(-1, chosen).argsort(dim=-1))
