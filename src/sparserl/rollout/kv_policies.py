"""KV compression policies: one small class per method, each with one `score` method.

A policy only scores the cached tokens of one layer; what is kept is decided the same way for all
of them by `select_slots`: the w most recent real tokens, plus the B - w best-scored others, never
a padding slot while a real token is left. Register a new policy with `@register`.

A policy is a dataclass whose fields are its options. Each field is a config key and a flag of its own
(`kv_` + the field name, or the `option` named in its metadata, with the `help` given there), so a new
option is one field here: `policy_options()` is what the config derives its `--kv-*` flags from, and an
option several policies share (the pooling of SnapKV, R-KV and PyramidKV) is one flag.

Default selection: one kept set shared per layer, scores summed over KV heads, as the Sparse-RL
reference does; per-head selection (kvpress, original SnapKV) is the option (`per_head=True` in the
engine, which makes `real`/`columns` carry one row per KV head). Shared is the default because one
set per layer keeps one mask per layer and gathers all heads with a single index. `score` always
returns one score per KV head, so the same policy serves both.

Scores are computed in float32 on the keys' device. Policies: `streamingllm`, `h2o`, `snapkv`,
`rkv`, `pyramidkv`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from ..errors import ConfigError

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
    """What a policy may look at for one layer. Hs is 1 (shared kept set) or Hkv (per head)."""

    keys: torch.Tensor  # [N, Hkv, L, D] cached keys, post-RoPE
    queries: torch.Tensor  # [N, Hq, w, D] post-RoPE queries of the last w fed tokens (observation window)
    query_real: torch.Tensor  # [N, w] bool, False where a window query was padding
    real: torch.Tensor  # [N, Hs, L] bool, False for padding slots
    columns: torch.Tensor  # [N, Hs, L] long, the slot's column (larger is more recent); increasing along L
    attention_mass: torch.Tensor | None  # [N, Hkv, L] attention received so far (H2O), else None
    layer_idx: int
    num_layers: int

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
        """Keep only the per-row state of batch rows `rows` (the others finished)."""


@register
@dataclass
class StreamingLLM(KVPolicy):
    """Attention sinks (the first `sinks` real tokens of each row) plus the most recent tokens."""

    name: ClassVar[str] = "streamingllm"
    sinks: int = option(4, "streamingllm: attention-sink tokens always kept")

    def __post_init__(self):
        if self.sinks < 0:
            raise ConfigError(f"kv_sinks must be >= 0, got {self.sinks}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        real, columns = inputs.per_kv_head()
        length = real.shape[-1]
        # Rank by column among real slots only: left padding must not take a sink's place.
        order_key = torch.where(real, columns, torch.full_like(columns, torch.iinfo(columns.dtype).max))
        rank = order_key.argsort(dim=-1, stable=True).argsort(dim=-1).float()
        sink = real & (rank < self.sinks)
        # Ranks are < L, so 2L puts every sink above every recency score.
        score = torch.where(sink, torch.full_like(rank, 2.0 * length), rank)
        return torch.where(real, score, torch.full_like(score, -1.0))


@register
@dataclass
class H2O(KVPolicy):
    """Heavy hitters: the attention each cached token has received so far, summed over queries."""

    name: ClassVar[str] = "h2o"
    needs_attention_mass: ClassVar[bool] = True

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.attention_mass is None:
            raise ValueError("h2o needs attention_mass; the engine collects it when needs_attention_mass is set")
        return inputs.attention_mass.float()


@register
@dataclass
class SnapKV(KVPolicy):
    """Attention of the observation-window queries onto the cache, pooled (SnapKV, Li et al. 2024).

    Candidates of the softmax are all real slots, the window's own keys included, with no causal
    mask inside the window: the window slots are kept anyway, so this only changes the softmax
    normaliser, and query columns are not part of `ScoringInputs`. Padding queries add nothing.
    The one `pooling` choice serves both the pooling over a KV group's query heads and the 1-D
    smoothing along the slots (max-pool or avg-pool, stride 1, padding kernel // 2, as the
    reference's `F.max_pool1d` / `F.avg_pool1d`, which counts the zero padding in the mean).

    The logits are q·k/√D for every model, as in the references (SnapKV, kvpress), and so is H2O's
    mass (`decode_loop.RolloutAttention._accumulate_mass`): neither a model's own scale (Gemma's
    query_pre_attn_scalar) nor Gemma-2's attention soft-capping enters, on purpose. The score only
    ranks tokens to keep, and the replay reads the kept columns, not the scores, so it stays exact
    either way; tanh is increasing, so each query orders keys the same capped or not, and a cap of
    50 moves a logit by 1.3% at 10 and 5% at 20: only sums over queries of the largest logits could
    rank differently, which is not worth a per-family rule in every policy.
    """

    name: ClassVar[str] = "snapkv"
    kernel_size: int = option(7, KERNEL_HELP)
    pooling: Literal["max", "mean"] = option("max", POOLING_HELP)

    def __post_init__(self):
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"kv_kernel_size must be odd and >= 1, so that pooling keeps the length; "
                              f"got {self.kernel_size}")
        if self.pooling not in ("max", "mean"):
            raise ConfigError(f"kv_pooling must be 'max' or 'mean', not {self.pooling!r}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        keys = inputs.keys.float()
        queries = inputs.queries.to(device=keys.device, dtype=torch.float32)
        n, hkv, length, dim = keys.shape
        hq, w = queries.shape[1], queries.shape[2]
        # Query head h reads KV head h // group (GQA), so group the queries under their KV head.
        grouped = queries.view(n, hkv, hq // hkv, w, dim)
        # In place on the fresh products (the same kernels, so the same values as out of place); masks
        # that would change nothing (every slot real, every window query real) are skipped.
        # The product einsum("nhgwd,nhld->nhgwl") makes, as the same batched matmul without its overhead.
        logits = torch.matmul(grouped.reshape(n, hkv, hq // hkv * w, dim), keys.transpose(-1, -2))
        logits = logits.view(n, hkv, hq // hkv, w, length).div_(dim ** 0.5)
        if not inputs.all_real():
            logits.add_(additive_mask(inputs.real)[:, :, None, None, :])
        probs = logits.softmax(dim=-1)
        if not inputs.every_row_real():  # a row with no real slot softmaxes to NaN: nothing to rank, so zero
            probs.nan_to_num_(0.0)
        if not inputs.all_queries_real():
            probs.mul_(inputs.query_real.to(probs)[:, None, None, :, None])
        summed = probs.sum(dim=3)  # [N, Hkv, group, L]
        if self.pooling == "max":  # the max over the group, one head at a time (exact, cheaper than amax)
            pooled = summed[:, :, 0]
            for head in range(1, summed.shape[2]):
                pooled = torch.maximum(pooled, summed[:, :, head])
        else:
            pooled = summed.mean(dim=2)
        flat = pooled.reshape(n * hkv, 1, length)
        pad = self.kernel_size // 2
        if self.pooling == "max":
            flat = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            flat = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        return flat.view(n, hkv, length)


@register
@dataclass
class RKV(KVPolicy):
    """Redundancy-aware scoring for long reasoning (R-KV): lam * importance - (1 - lam) * redundancy.

    importance: the SnapKV score divided by its sum over the real slots of its (row, KV head).
    redundancy, per KV head, among the real slots: cosine similarity of the keys, diagonal zeroed;
    a pair (i, j) with sim > threshold spares the more recent token, so sim[i, j] is set to 0
    when column_i > column_j, and the older token i keeps it counted. Then redundancy_i is the mean
    of the row sim[i, j] over the other real slots j, turned into a distribution by a softmax
    over the real slots (as the reference does).

    The row sums are kept between compressions of a rollout: each compression adds the rows and
    columns of the slots appended since the last one and removes those of the evicted slots,
    O(B·Δ) work instead of the O(B²) of recomputing the whole similarity matrix. A row sum is split
    as sum_j sim[i, j] - sum_{j older, sim > threshold} sim[i, j]: the first term is linear in the
    keys (one matrix-vector product against a sum of keys), so only the second needs the pairwise
    products, and those are thresholded and masked in place in one reused buffer, in blocks of
    `BLOCK` slots. On a CPU, allocating a fresh [N, Hkv, Δ, B] matrix per compression costs more in page
    faults than the product itself.
    """

    name: ClassVar[str] = "rkv"
    BLOCK: ClassVar[int] = 128
    lam: float = option(0.1, "rkv: weight of importance against redundancy, in [0, 1]", name="kv_lambda")
    similarity_threshold: float = option(0.5, "rkv: key cosine similarity above which the older twin is redundant")
    kernel_size: int = option(7, KERNEL_HELP)
    pooling: Literal["max", "mean"] = option("max", POOLING_HELP)

    def __post_init__(self):
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"kv_lambda must be in [0, 1] (the weight of importance), got {self.lam}")
        if not -1 <= self.similarity_threshold <= 1:
            raise ConfigError(f"kv_similarity_threshold is a cosine similarity, in [-1, 1]; got "
                              f"{self.similarity_threshold}")
        self.importance = SnapKV(kernel_size=self.kernel_size, pooling=self.pooling)
        self.begin_rollout()

    def begin_rollout(self) -> None:
        self._row_sums: dict[int, torch.Tensor] = {}  # layer -> [N, Hkv, L] for the slots scored last
        self._unit: torch.Tensor | None = None  # the unit keys `score` made, for `before_keep`
        self._buffer = torch.empty(0)

    def select_rows(self, rows: torch.Tensor) -> None:
        self._row_sums = {layer: sums.index_select(0, rows) for layer, sums in self._row_sums.items()}

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        real, _ = inputs.per_kv_head()
        all_real = inputs.all_real()
        attention = self.importance.score(inputs)
        if not all_real:
            attention.masked_fill_(~real, 0.0)
        importance = attention.div_(attention.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
        self._unit = _unit_keys(inputs.keys, real, all_real)
        sums = self._update_row_sums(inputs.layer_idx, self._unit)
        return importance.mul_(self.lam).sub_(self._distribution(sums, real, all_real).mul_(1.0 - self.lam))

    def redundancy(self, keys: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The redundancy distribution `[N, Hkv, L]` computed from scratch."""
        unit = _unit_keys(keys, real)
        return self._distribution(self._new_row_sums(unit, 0), real)

    def before_keep(self, inputs: ScoringInputs, slots: torch.Tensor) -> None:
        """Remove the evicted slots' similarity from the kept rows, then keep those rows."""
        sums, unit = self._row_sums[inputs.layer_idx], self._unit
        n, heads, length = sums.shape
        slots = slots.expand(n, heads, -1)
        evicted_mask = torch.ones(n, heads, length, dtype=torch.bool, device=sums.device).scatter_(2, slots, False)
        evicted = _true_positions(evicted_mask, length - slots.shape[-1])  # [N, Hkv, E], in slot order
        gone = _gather_rows(unit, evicted)  # [N, Hkv, E, D], in slot order
        removed = (unit @ gone.sum(dim=2)[..., None]).squeeze(-1)  # every evicted slot, thresholds aside
        # Row i spares the evicted slots older than it: the first `older[i]` of them (both in slot order).
        older = evicted_mask.long().cumsum(dim=-1) - evicted_mask.long()
        zero = torch.zeros((), dtype=unit.dtype, device=unit.device)
        for start in range(0, gone.shape[2], self.BLOCK):
            block = gone[:, :, start:start + self.BLOCK]
            width = block.shape[2]
            sim = self._spared(unit, block)  # [N, Hkv, L, b]
            # (older is in [0, E] already: with one block, the clamp changes nothing)
            first_not_older = older if gone.shape[2] <= self.BLOCK else (older - start).clamp_(0, width)
            # Row i zeroes its columns from first_not_older[i] on: row k of `suffixes` is that mask for
            # first_not_older = k, so the [N, Hkv, L, b] mask is one row lookup (a broadcast comparison
            # that size is ~30x slower on a CPU), and where(out=sim) zeroes in place faster than masked_fill_.
            columns = torch.arange(width, device=sim.device)
            suffixes = columns >= torch.arange(width + 1, device=sim.device)[:, None]  # [b + 1, b]
            beyond = suffixes.index_select(0, first_not_older.reshape(-1)).view(sim.shape)
            torch.where(beyond, zero, sim, out=sim)
            removed -= sim.sum(dim=-1)
        self._row_sums[inputs.layer_idx] = (sums - removed).gather(2, slots)

    def _update_row_sums(self, layer: int, unit: torch.Tensor) -> torch.Tensor:
        previous = self._row_sums.get(layer)
        old = 0 if previous is None else previous.shape[2]
        sums = torch.empty(unit.shape[:3], dtype=unit.dtype, device=unit.device)
        if previous is not None:
            # Old rows gain the appended slots, which are newer, so always counted.
            torch.add(previous, (unit[:, :, :old] @ unit[:, :, old:].sum(dim=2)[..., None]).squeeze(-1),
                      out=sums[:, :, :old])
        self._new_row_sums(unit, old, out=sums[:, :, old:])
        self._row_sums[layer] = sums
        return sums

    def _new_row_sums(self, unit: torch.Tensor, first_row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row sums of the slots first_row.. against all, without the diagonal and without older
        near-duplicates. Slots are in column order (ScoringInputs), so "j is older than i" is j < i.
        Written into `out` when given."""
        rows = unit[:, :, first_row:]
        diagonal = rows.square().sum(dim=-1)
        sums = torch.sub((rows @ unit.sum(dim=2)[..., None]).squeeze(-1), diagonal, out=out)
        for start in range(0, rows.shape[2], self.BLOCK):
            stop = min(start + self.BLOCK, rows.shape[2])
            sim = self._spared(rows[:, :, start:stop], unit)  # [N, Hkv, b, L]
            # Only older slots spare: row r of the block is slot first_row + start + r.
            _zero_upper(sim[..., first_row + start:])
            sums[..., start:stop] -= sim.sum(dim=-1)
        return sums

    def _spared(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """`rows @ columns^T` ([N, Hkv, a, b]) where above the threshold, else 0, in the reused buffer."""
        shape = (*rows.shape[:3], columns.shape[2])
        size = shape[0] * shape[1] * shape[2] * shape[3]
        if self._buffer.numel() < size or self._buffer.device != rows.device:
            self._buffer = torch.empty(size, dtype=torch.float32, device=rows.device)
        sim = torch.matmul(rows, columns.transpose(-1, -2), out=self._buffer[:size].view(shape))
        return F.threshold_(sim, self.similarity_threshold, 0.0)

    @staticmethod
    def _distribution(sums: torch.Tensor, real: torch.Tensor, all_real: bool = False) -> torch.Tensor:
        mean_sim = sums / (real.sum(dim=-1, keepdim=True) - 1).clamp_min(1)
        if not all_real:
            mean_sim.masked_fill_(~real, float("-inf"))
        return mean_sim.softmax(dim=-1).nan_to_num_(0.0)


def _unit_keys(keys: torch.Tensor, real: torch.Tensor, all_real: bool = False) -> torch.Tensor:
    """Unit-norm keys in float32, zero on padding, so padding adds no similarity (with every slot
    real the multiplication by 1 is skipped: it changes no value)."""
    keys = keys.float()
    # F.normalize's own computation (x / max(||x||, 1e-12)), without its Python overhead.
    unit = keys / torch.linalg.vector_norm(keys, 2, dim=-1, keepdim=True).clamp_min_(1e-12)
    return unit if all_real else unit.mul_(real[..., None])


def _gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor [N, H, L, D]` at slots `index [N, H, K]` (an index_select of whole rows of the flattened
    tensor, a plain copy, faster on a CPU than a gather with the index expanded over D)."""
    n, heads, length, dim = tensor.shape
    if not tensor.is_contiguous():
        return tensor.gather(2, index[..., None].expand(-1, -1, -1, dim))
    offsets = torch.arange(0, n * heads * length, length, device=tensor.device).view(n, heads, 1)
    return tensor.view(-1, dim).index_select(0, (index + offsets).view(-1)).view(n, heads, index.shape[-1], dim)


def _zero_upper(matrices: torch.Tensor) -> None:
    """`matrices.tril_(-1)` (zero where column >= row): on a large strided view as a where() in place,
    which on a CPU is ~3x faster than tril_'s copy there and back; the same values either way."""
    rows, cols = matrices.shape[-2:]
    if matrices.numel() < 1 << 16:
        matrices.tril_(-1)
        return
    upper = torch.arange(cols, device=matrices.device) >= torch.arange(rows, device=matrices.device)[:, None]
    torch.where(upper, torch.zeros((), dtype=matrices.dtype, device=matrices.device), matrices, out=matrices)


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """`[..., count]` positions of the True entries of `mask [..., L]` along its last dim, ascending;
    every row must hold exactly `count` of them."""
    if not host_reads_are_cheap(mask):  # nonzero reads its size back; a stable sort does not
        return mask.to(torch.uint8).argsort(dim=-1, descending=True, stable=True)[..., :count]
    found = mask.nonzero()
    if found.shape[0] != mask[..., 0].numel() * count:
        raise ValueError(f"every row of the mask must hold exactly {count} True entries")
    return found[:, -1].reshape(*mask.shape[:-1], count)


@register
@dataclass
class PyramidKV(SnapKV):
    """SnapKV scores with budgets that shrink linearly with depth (PyramidKV, Cai et al. 2024).

    As the reference, the part of the budget above the window, E = budget - window, runs from
    top = 2E - bottom at layer 0 down to bottom = max(1, floor(E / beta)) at the last layer; the
    arithmetic sequence has mean E, and rounding down keeps the total <= num_layers * budget.
    Every layer keeps >= window + 1. `window` is the compression's window, which the engine sets.
    """

    name: ClassVar[str] = "pyramidkv"
    beta: float = option(20.0, "pyramidkv: how steeply budgets shrink with depth (the last layer keeps "
                               "(budget - window) / beta above the window; >= 1)")
    window: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ConfigError(f"kv_beta must be >= 1, got {self.beta}")

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int) -> int:
        extra = budget - self.window
        if num_layers <= 1 or extra <= 1:
            return budget
        bottom = max(1, int(extra // self.beta))
        top = 2 * extra - bottom
        steps_from_bottom = num_layers - 1 - layer_idx
        return self.window + bottom + (top - bottom) * steps_from_bottom // (num_layers - 1)


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
