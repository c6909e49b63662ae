"""R-KV (Cai et al., 2025): redundancy-aware scoring for long reasoning, importance against redundancy."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from ....errors import ConfigError
from .base import (
    KERNEL_HELP,
    POOLING_HELP,
    KVPolicy,
    ScoringInputs,
    host_reads_are_cheap,
    option,
    register,
)
from .snapkv import SnapKV


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

    A row sum is split as sum_j sim[i, j] - sum_{j older, sim > threshold} sim[i, j]: the first term is
    linear in the keys (one matrix-vector product against a sum of keys), so only the second needs the
    pairwise products, and only over the older slots j < i (slots are in column order), one triangle.
    The row sums are kept between compressions of a rollout (per stack of layers scored together,
    `ScoringInputs.layers`): a compression adds the rows and columns of the slots appended since the last
    one (Δ rows against L), and then keeps the kept rows' sums against the kept columns only, whichever way
    costs fewer products: recomputed from the B kept keys (B²/2, after a long prompt) or with the E evicted
    columns removed (L·E, every Δ steps, E = Δ). The pairwise products are computed in blocks of at most
    `CPU_BLOCK_ELEMENTS` values (`DEVICE_BLOCK_ELEMENTS` off a CPU), thresholded and masked in place in one
    reused buffer.
    """

    name: ClassVar[str] = "rkv"
    # One block of similarities: on a CPU 4 MiB, so that the threshold and the sum that follow the product read
    # it from cache (at L = 2048 a compression with 16 MiB blocks took 1.15x as long); on a GPU large enough
    # to fill the device. A block has BLOCK_ROWS rows (or all it can), since a product of fewer rows runs several
    # times slower per value on a CPU.
    CPU_BLOCK_ELEMENTS: ClassVar[int] = 1 << 20
    DEVICE_BLOCK_ELEMENTS: ClassVar[int] = 1 << 26
    BLOCK_ROWS: ClassVar[int] = 64
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
        # layers scored together -> [len(layers)·N, Hkv, L] for the slots scored last
        self._row_sums: dict[tuple[int, ...], torch.Tensor] = {}
        self._unit: torch.Tensor | None = None  # the unit keys `score` made, for `before_keep`
        self._buffer = torch.empty(0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` of each layer in a stack (a stack of k layers holds k·N rows, layer by layer)."""
        def each_layer(layers: tuple[int, ...], sums: torch.Tensor) -> torch.Tensor:
            per_layer = sums.shape[0] // len(layers)
            offsets = torch.arange(0, sums.shape[0], per_layer, device=rows.device)
            return sums.index_select(0, (offsets[:, None] + rows[None, :]).reshape(-1))
        self._row_sums = {layers: each_layer(layers, sums) for layers, sums in self._row_sums.items()}

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        real, _ = inputs.per_kv_head()
        all_real = inputs.all_real()
        attention = self.importance.score(inputs)
        if not all_real:
            attention.masked_fill_(~real, 0.0)
        importance = attention.div_(attention.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
        self._unit = _unit_keys(inputs.keys, real, all_real)
        sums = self._update_row_sums(inputs.layers, self._unit)
        return importance.mul_(self.lam).sub_(self._distribution(sums, real, all_real).mul_(1.0 - self.lam))

    def before_keep(self, inputs: ScoringInputs, slots: torch.Tensor) -> None:
        """Keep the row sums of the kept slots `slots [N, Hs, B]` against the kept slots: the E evicted slots removed
        from every row's sum where that takes fewer products (L·E) than recomputing the kept rows' sums (B²/2)."""
        sums, unit = self._row_sums[inputs.layers], self._unit
        self._unit = None
        n, heads, length = sums.shape
        slots = slots.expand(n, heads, -1)
        budget = slots.shape[-1]
        if length * (length - budget) < budget * (budget + 1) // 2:
            self._row_sums[inputs.layers] = (sums - self._evicted_sums(unit, slots)).gather(2, slots)
        else:
            self._row_sums[inputs.layers] = self._new_row_sums(_gather_rows(unit, slots), 0)

    def _evicted_sums(self, unit: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`[N, Hkv, L]`: what the slots evicted (all but `slots [N, Hkv, B]`) add to each slot's row sum, from the
        unit keys `unit [N, Hkv, L, D]`. Every row, kept or not: gathering the kept ones' keys first costs more than
        the E products per row it saves."""
        n, heads, length, dim = unit.shape
        evicted, pairs = length - slots.shape[-1], n * heads
        evicted_mask = torch.ones(n, heads, length, dtype=torch.bool, device=unit.device).scatter_(2, slots, False)
        gone_slots = _true_positions(evicted_mask, evicted)  # [N, Hkv, E], ascending
        gone = _gather_rows(unit, gone_slots)
        removed = _matvec(unit, gone.sum(dim=2))  # every evicted slot, thresholds aside
        # Row i spares the evicted slots older than it. The products are taken evicted x all ([E, D] @ [D, L], so
        # the sum runs over the evicted along dim -2): on a CPU that orientation took a third of [L, D] @ [D, E]'s
        # time at L = 88, E = 8.
        gone_rows, gone_at = gone.reshape(pairs, evicted, dim), gone_slots.view(pairs, evicted)
        columns = unit.reshape(pairs, length, dim).mT
        spared = removed.view(pairs, length)
        zero = torch.zeros((), dtype=unit.dtype, device=unit.device)
        slot = torch.arange(length, device=unit.device)
        elements = self._block_elements(unit.device)
        for start in range(0, evicted, self.BLOCK_ROWS):
            stop = min(evicted, start + self.BLOCK_ROWS)
            chunk = max(1, elements // (length * (stop - start)))
            for first in range(0, pairs, chunk):
                last = min(pairs, first + chunk)
                sim = self._spared(gone_rows[first:last, start:stop], columns[first:last])  # [P, b, L]
                not_older = gone_at[first:last, start:stop, None] >= slot  # evicted slot e is not older than row i
                torch.where(not_older, zero, sim, out=sim)
                spared[first:last] -= sim.sum(dim=-2)
        return removed

    def _update_row_sums(self, layers: tuple[int, ...], unit: torch.Tensor) -> torch.Tensor:
        # A layer's sums live in the one stack that last scored it: when the stacks change (they are cut by size,
        # `eviction.scored_stacks`), an older stack holding any of these layers is out of date.
        for stale in [other for other in self._row_sums if other != layers and not set(other).isdisjoint(layers)]:
            del self._row_sums[stale]
        previous = self._row_sums.get(layers)
        old = 0 if previous is None else previous.shape[2]
        sums = torch.empty(unit.shape[:3], dtype=unit.dtype, device=unit.device)
        if previous is not None:
            # Old rows gain the appended slots, which are newer, so always counted.
            torch.add(previous, _matvec(unit[:, :, :old], unit[:, :, old:].sum(dim=2)),
                      out=sums[:, :, :old])
        self._new_row_sums(unit, old, out=sums[:, :, old:])
        self._row_sums[layers] = sums
        return sums

    def _new_row_sums(self, unit: torch.Tensor, first_row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row sums `[N, Hkv, L - first_row]` of the slots first_row.. of `unit [N, Hkv, L, D]` against all,
        without the diagonal and without older near-duplicates; written into `out` when given."""
        n, heads, length, dim = unit.shape
        rows = unit[:, :, first_row:]
        # The diagonal |u_i|² as a squared norm: no [N, Hkv, L, D] temporary (of 117 MB at L = 512 in Qwen2.5-1.5B)
        diagonal = torch.linalg.vector_norm(rows, dim=-1).square_()
        sums = torch.sub(_matvec(rows, unit.sum(dim=2)), diagonal, out=out)
        pairs = unit.reshape(n * heads, length, dim)
        # [N·Hkv, D, L]: a copy with the columns in rows makes each block's product faster, which pays for the copy
        # over several blocks of rows (a first compression), not over the Δ rows of the next ones.
        transposed = pairs.mT.contiguous() if length - first_row > self.BLOCK_ROWS else pairs.mT
        spared = sums.view(n * heads, length - first_row)
        for start, stop, first, last in self._triangle_tiles(n * heads, first_row, length, unit.device):
            # Row r of the tile, slot start + r, spares only older slots: columns ..start + r - 1.
            sim = self._spared(pairs[first:last, start:stop], transposed[first:last, :, :stop])  # [P, b, stop]
            _zero_upper(sim[..., start:])
            spared[first:last, start - first_row:stop - first_row] -= sim.sum(dim=-1)
        return sums

    def _triangle_tiles(self, pairs: int, first_row: int, length: int,
                        device: torch.device) -> Iterator[tuple[int, int, int, int]]:
        """Tiles (start, stop, first, last): the slots start..stop - 1 of the (row, head) pairs first..last - 1,
        whose products against the slots ..stop - 1 fit one block (`BLOCK_ROWS` rows, one pair at least)."""
        elements = self._block_elements(device)
        for start in range(first_row, length, self.BLOCK_ROWS):
            stop = min(length, start + self.BLOCK_ROWS)
            chunk = max(1, elements // ((stop - start) * stop))
            for first in range(0, pairs, chunk):
                yield start, stop, first, min(pairs, first + chunk)

    def _block_elements(self, device: torch.device) -> int:
        return self.CPU_BLOCK_ELEMENTS if device.type == "cpu" else self.DEVICE_BLOCK_ELEMENTS

    def _spared(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """`rows [..., a, D] @ columns [..., D, b]` where above the threshold, else 0, in the reused buffer."""
        shape = (*rows.shape[:-1], columns.shape[-1])
        size = math.prod(shape)
        if self._buffer.numel() < size or self._buffer.device != rows.device:
            self._buffer = torch.empty(size, dtype=torch.float32, device=rows.device)
        sim = torch.matmul(rows, columns, out=self._buffer[:size].view(shape))
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


def _matvec(matrices: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """`[..., L]`: each matrix `[..., L, D]` times its vector `[..., D]`, as a row vector times the transposed
    matrix: on a CPU the batched matrix-vector product of the same values took 4-6x as long (384 products of 88 x 32,
    1.25 ms against 0.21-0.35 on one free core)."""
    return (vectors[..., None, :] @ matrices.mT).squeeze(-2)


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
