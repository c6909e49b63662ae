"""Quantized KV caches (`--kv-dtype fp8 | int8`): keys and values stored in one byte each, and their exact replay.

Two formats behind one interface (`KVFormat`): `quantize(x, scale)` and `dequantize(q, scale, dtype)` elementwise,
`row_scales` (a row's scales fixed for its rollout, from its prompt), `encode` (what the cache stores for new tokens)
and `fake_quant` (encode then decode: what an attention reads). Shapes: keys and values `[N, Hkv, S, D]`; a row's
scales `[N, Hkv, 1, Dk]` (Dk = D or 1); a per-token scale `[N, Hkv, S, 1]`.

- fp8: e4m3 (`torch.float8_e4m3fn`), keys and values each divided by a scale per (row, layer, KV head) and clamped
  to e4m3's ±448 (it has no infinity: a value past it would cast to NaN). Bytes per slot and layer: 2·Hkv·D.
- int8, as KIVI (arXiv 2402.02750): keys per channel, a symmetric scale per (row, layer, KV head, channel), values
  per token, a scale per (slot, KV head) from that token's own values when it is written, stored beside them in the
  model's dtype (so it moves with eviction and row selection, and its bytes count). Bytes per slot and layer:
  2·Hkv·D + Hkv·s, s the model dtype's size.

A row's fixed scales are 2 · amax / limit (448 or 127; `HEADROOM`) over its real prompt tokens, per head (fp8) or
per key channel (int8, the amax of the channel's rotary pair's norm: `rotary_pair_norms`), taken at its prefill:
computed once per rollout (the weights change between rollouts), and deterministic whichever rows share its batch.
Later tokens past them are clamped. The rollout records them (`KVScales`, in the batch), so the replay uses the very
scales the sampler used.

What makes the replay exact: every attention of the sampler, prefill and decode, full and sliding layers, reads the
cache's dequantized keys and values, a token's own included. So the learner's replay is the same forward with every
layer's K/V passed through `fake_quant` with the recorded scales (`KVFakeQuant`, installed by
`sparsity.replay.sampler_replay`): elementwise the same operations on the same values, float rounding of the
projections aside. Its gradient is the straight-through estimator (identity inside the clamp range, zero past it),
so the replay still trains the key and value projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "fp8", "int8")


@dataclass
class KVScales:
    """What the replay of a quantized cache needs (`RolloutBatch.kv_scales`): its format (`kv_dtype`, fp8 or int8)
    and each row's scales, fixed for its rollout: keys `[N, L, Hkv, Dk]` (Dk = D for int8's per-channel keys, 1 for
    fp8's per-head ones) and values `[N, L, Hkv, 1]` (fp8; None for int8, whose value scales are per token,
    recomputed from the values). L: every decoder layer."""

    kv_dtype: str
    keys: torch.Tensor
    values: torch.Tensor | None = None

    def rows(self, index: slice | torch.Tensor) -> KVScales:
        return KVScales(self.kv_dtype, self.keys[index], None if self.values is None else self.values[index])

    @staticmethod
    def cat(records: list[KVScales | None]) -> KVScales | None:
        """The records of batches' rows one after the other (None if any batch has none)."""
        if not records or any(r is None for r in records):
            return None
        values = None if records[0].values is None else torch.cat([r.values for r in records])
        return KVScales(records[0].kv_dtype, torch.cat([r.keys for r in records]), values)


# A row's fixed scales leave twice its prompt's range: later tokens go past it, and a clamped key or value costs far
# more than the resolution given up. On the built-in model (32 rows of 64 tokens) the dense model's log-probs of the
# quantized samplers' tokens moved by 6.0e-3 on average (fp8) and 1.6e-1 (int8, keys scaled by each channel's own
# prompt amax) with no headroom; 1.4e-3 (fp8) and 3.5e-4 (int8 by rotary pairs) with 2x. fp8 gains nothing past 2x
# (its relative precision does not depend on the scale).
HEADROOM = 2.0


def rotary_pair_norms(keys: torch.Tensor) -> torch.Tensor:
    """`[..., D]`: each channel's norm with the channel rotary embeddings rotate it with (i and i ± D/2, transformers'
    `rotate_half` layout), which a rotation by any position keeps: a key channel's scale from the prompt then bounds
    it at every later position, whose rotation moves magnitude from one channel of the pair to the other. For a
    channel no rotation touches, a bound all the same."""
    half = keys.shape[-1] // 2
    if keys.shape[-1] % 2:
        return keys.abs()
    pair = keys[..., :half].hypot(keys[..., half:])
    return torch.cat([pair, pair], dim=-1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scales and (de)quantization are computed: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KVFormat:
    """One quantized format: stored as `store_dtype`, scaled values clamped to ±`limit`; `key_per_channel`: a key
    scale per channel (else per head); `value_per_token`: a value scale per written token (else a row's, per head)."""

    name: str
    store_dtype: torch.dtype
    limit: float
    key_per_channel: bool
    value_per_token: bool

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`x / scale`, clamped to ±limit, in the stored dtype (fp8: the cast rounds to nearest even; int8: round
        half to even)."""
        scaled = (x.to(compute_dtype(x.dtype)) / scale.to(compute_dtype(x.dtype))).clamp(-self.limit, self.limit)
        return scaled.to(self.store_dtype) if self.store_dtype.is_floating_point else scaled.round().to(self.store_dtype)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`q · scale` in `dtype` (computed in `compute_dtype(dtype)`)."""
        compute = compute_dtype(dtype)
        return (q.to(compute) * scale.to(compute)).to(dtype)

    def row_scales(self, keys: torch.Tensor, values: torch.Tensor,
                   real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prefill's rows' fixed scales from its keys and values `[N, Hkv, P, D]` over its real tokens
        `real [N, P]`: keys `[N, Hkv, 1, Dk]`, values `[N, Hkv, 1, 1]` (None when per token). HEADROOM · amax / limit,
        the amax per head, or per key channel of the channel's rotary pair (`rotary_pair_norms`)."""
        hidden = ~real.bool()[:, None, :, None]

        def scale(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
            x = x.to(compute_dtype(x.dtype))
            amax = (rotary_pair_norms(x) if per_channel else x.abs()).masked_fill(hidden, 0.0).amax(dim=2, keepdim=True)
            amax = amax if per_channel else amax.amax(dim=3, keepdim=True)
            return (amax * HEADROOM / self.limit).clamp_min(torch.finfo(amax.dtype).tiny)

        return scale(keys, self.key_per_channel), None if self.value_per_token else scale(values, False)

    def token_scales(self, values: torch.Tensor) -> torch.Tensor:
        """Each token's value scale `[N, Hkv, S, 1]` in the values' dtype: its amax over D / limit."""
        amax = values.to(compute_dtype(values.dtype)).abs().amax(dim=3, keepdim=True)
        return (amax / self.limit).to(values.dtype).clamp_min(torch.finfo(values.dtype).tiny)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, key_scale: torch.Tensor,
               value_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the cache stores for new keys and values `[N, Hkv, Q, D]`: both quantized, and the tokens' value
        scales `[N, Hkv, Q, 1]` (None unless per token)."""
        tokens = self.token_scales(values) if self.value_per_token else None
        return self.quantize(keys, key_scale), self.quantize(values, tokens if tokens is not None else value_scale), \
            tokens

    def fake_quant(self, keys: torch.Tensor, values: torch.Tensor, key_scale: torch.Tensor,
                   value_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`keys`, `values` as the cache would give them back (encoded, then decoded), with straight-through
        gradients."""
        return _FakeQuant.apply(keys, values, key_scale, value_scale, self)

    def slot_bytes(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one slot takes in one layer of one row: its keys, values and, per token, its value scales."""
        stored = 2 * kv_heads * head_dim * self.store_dtype.itemsize
        return stored + (kv_heads * dtype.itemsize if self.value_per_token else 0)


class _FakeQuant(torch.autograd.Function):
    """encode → decode forward; backward the straight-through estimator: the gradient passes where the scaled value
    was inside ±limit (a per-token value scale is its token's amax, so nothing of it is clamped)."""

    @staticmethod
    def forward(ctx, keys, values, key_scale, value_scale, fmt: KVFormat):
        key_q, value_q, tokens = fmt.encode(keys, values, key_scale, value_scale)
        value_scale = tokens if tokens is not None else value_scale
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(*[(x.to(compute_dtype(x.dtype)) / s.to(compute_dtype(x.dtype))).abs() <= fmt.limit
                                    for x, s in ((keys, key_scale), (values, value_scale))])
        return fmt.dequantize(key_q, key_scale, keys.dtype), fmt.dequantize(value_q, value_scale, values.dtype)

    @staticmethod
    def backward(ctx, key_grad, value_grad):
        key_inside, value_inside = ctx.saved_tensors
        return key_grad * key_inside, value_grad * value_inside, None, None, None


def fp8_available() -> bool:
    return hasattr(torch, "float8_e4m3fn")


FORMATS = {"int8": KVFormat("int8", torch.int8, 127.0, True, True)}
if fp8_available():
    FORMATS["fp8"] = KVFormat("fp8", torch.float8_e4m3fn, 448.0, False, False)


def kv_format(kv_dtype: str) -> KVFormat | None:
    """The format `--kv-dtype` names (None for auto: the model's dtype, no quantization)."""
    if kv_dtype == "auto":
        return None
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if kv_dtype not in FORMATS:
        raise ValueError(f"kv_dtype {kv_dtype}: torch {torch.__version__} has no float8_e4m3fn; use --kv-dtype int8 "
                         "or auto, or torch >= 2.1")
    return FORMATS[kv_dtype]


def bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (`uint8`), which every indexing kernel moves on every device; others as they
    are."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point else tensor


class KVFakeQuant:
    """The replay's transform of each layer's keys and values (`model.attention.KVTransform`): `fake_quant` with
    the scales a batch's rows recorded (`KVScales`)."""

    def __init__(self, scales: KVScales):
        self.scales = scales
        self.format = kv_format(scales.kv_dtype)

    def __call__(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`keys`, `values` `[n, Hkv, S, D]` of the rows' layer `layer_idx`, as the sampler's cache read them."""
        value_scale = self.scales.values[:, layer_idx, :, None] if self.scales.values is not None else None
        return self.format.fake_quant(keys, values, self.scales.keys[:, layer_idx, :, None], value_scale)

    def rows(self, index: torch.Tensor | slice) -> KVFakeQuant:
        """The transform of the rows `index` (a shared prompt's forward runs one row per group)."""
        return KVFakeQuant(self.scales.rows(index))
