"""The settings of the rollout corrections: which filters and importance weights apply, with the
published recipes as named constructors (`CorrectionConfig.sparse_rl()`, ...). The maths that
applies them is `learner.corrections`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError


@dataclass
class CorrectionConfig:
    """Settings of the corrections; the defaults are the Sparse-RL reference's (`sparse_rl()`).

    is_mode: how ξ becomes a weight — "truncate": min(ξ, cap); "clip": clamp(ξ, 1/cap, cap)
        (so it needs cap ≥ 1); "mask": ξ where ξ ≤ cap, else 0 (the token stays in keep_mask and
        only its weight is zeroed); "none": all ones.
    is_level: "token" (per-token ξ), "sequence" (product of ξ over the response) or "geometric"
        (geometric mean of ξ over the response); the mode is applied after the level.
    batch_normalize: divide the weights by their mean over all response tokens of the batch.
    """

    veto_threshold: float | None = 1e-4  # a token with ξ below this rejects its sequence (none: no veto)
    veto_scope: Literal["sequence", "prefix"] = "sequence"  # the veto rejects the whole sequence, or only the tokens from the vetoing one onward
    band: tuple[float, float] | None = (0.5, 1.5)  # two-sided token mask: keep only tokens with LOW <= ξ <= HIGH (none: no band)
    seq_geo_bounds: tuple[float, float] | None = None  # keep sequences whose geometric-mean ξ is in LOW,HIGH (none: off)
    seq_k3_max: float | None = None  # keep sequences whose mean k3 = ξ - 1 - log ξ is at most this (none: off)
    seq_log_ratio_max: float | None = None  # keep sequences whose max |log ξ| is at most this (none: off)
    is_mode: Literal["truncate", "clip", "mask", "none"] = "truncate"  # how ξ becomes an importance weight
    is_cap: float = 1.5  # the weights' cap C
    is_level: Literal["token", "sequence", "geometric"] = "token"  # ratio per token, its product, or geometric mean
    batch_normalize: bool = True  # divide the weights by their batch mean

    def __post_init__(self) -> None:
        if self.veto_threshold is not None and not self.veto_threshold > 0:
            raise ConfigError(f"veto_threshold must be > 0 or None, got {self.veto_threshold!r}")
        if self.veto_scope not in ("sequence", "prefix"):
            raise ConfigError(f"veto_scope must be sequence|prefix, got {self.veto_scope!r}")
        self.band = _bounds("band", self.band)
        self.seq_geo_bounds = _bounds("seq_geo_bounds", self.seq_geo_bounds)
        for name in ("seq_k3_max", "seq_log_ratio_max"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ConfigError(f"{name} must be >= 0 or None, got {value!r}")
        if self.is_mode not in ("truncate", "clip", "mask", "none"):
            raise ConfigError(f"is_mode must be truncate|clip|mask|none, got {self.is_mode!r}")
        if not self.is_cap > 0 or math.isinf(self.is_cap):
            raise ConfigError(f"is_cap must be a finite number > 0, got {self.is_cap!r}")
        if self.is_mode == "clip" and self.is_cap < 1:
            raise ConfigError(f"is_cap must be >= 1 with is_mode='clip' (else [1/cap, cap] is empty), got {self.is_cap!r}")
        if self.is_level not in ("token", "sequence", "geometric"):
            raise ConfigError(f"is_level must be token|sequence|geometric, got {self.is_level!r}")

    # ---------------------------------------------------------------- presets
    # The field's thresholds are for bf16-vs-fp32 drift, not sparse-rollout mismatch: verl's Geo-RS
    # bounds (0.999, 1.001) would reject every sequence with an eviction here. Ours (|log| ≤ 0.1 for
    # the geometric mean, 0.1 for mean k3) flag about as many sequences at step 0 of the built-in
    # paper regime as the reference veto (11%); docs/results.md has the measurement.
    @classmethod
    def off(cls) -> CorrectionConfig:
        """No filter, unit weights: the metrics are still computed."""
        return cls(veto_threshold=None, band=None, is_mode="none", batch_normalize=False)

    @classmethod
    def sparse_rl(cls) -> CorrectionConfig:
        """The Sparse-RL reference: sequence veto at 1e-4, band [0.5, 1.5], token TIS capped at 1.5, batch-normalised."""
        return cls()

    @classmethod
    def sparse_tis(cls) -> CorrectionConfig:
        """The reference's importance weights alone."""
        return cls(veto_threshold=None, band=None)

    @classmethod
    def sparse_rs(cls) -> CorrectionConfig:
        """The reference's rejection alone (veto and band), unit weights."""
        return cls(is_mode="none", batch_normalize=False)

    @classmethod
    def geo_rs(cls, low: float = 0.905, high: float = 1.105, veto: float | None = 1e-4) -> CorrectionConfig:
        """verl's Geo-RS: geometric-mean sequence filter plus the token veto, no weights."""
        return cls(veto_threshold=veto, band=None, seq_geo_bounds=(low, high), is_mode="none", batch_normalize=False)

    @classmethod
    def k3_rs(cls, bound: float = 0.1) -> CorrectionConfig:
        """verl's `seq_mean_k3` rejection: mean k3 per sequence at most `bound`, no weights."""
        return cls(veto_threshold=None, band=None, seq_k3_max=bound, is_mode="none", batch_normalize=False)

    @classmethod
    def seq_mask_tis(cls, low: float = 0.905, high: float = 1.105, cap: float = 2.0) -> CorrectionConfig:
        """OpenRLHF / NeMo-RL `seq-mask-tis`: geometric-mean sequence mask plus token TIS."""
        return cls(veto_threshold=None, band=None, seq_geo_bounds=(low, high), is_cap=cap, batch_normalize=False)

    @classmethod
    def token_tis(cls, cap: float = 2.0) -> CorrectionConfig:
        """Token-level TIS alone, min(ξ, cap) per token, not normalised: NeMo-RL's correction of an FP8 KV cache."""
        return cls(veto_threshold=None, band=None, is_cap=cap, batch_normalize=False)

    @classmethod
    def prefix_veto_tis(cls, veto: float = 1e-4) -> CorrectionConfig:
        """The reference's TIS with a prefix veto: tokens from the first ξ < veto onward are masked."""
        return cls(veto_threshold=veto, veto_scope="prefix", band=None)


def _bounds(name: str, value) -> tuple[float, float] | None:
    if value is None:
        return None
    if len(value) != 2:
        raise ConfigError(f"{name} must be a (low, high) pair or None, got {value!r}")
    low, high = value
    if not (low >= 0 and high > 0):
        raise ConfigError(f"{name} must have low >= 0 and high > 0, got {value!r}")
    if low > high:
        raise ConfigError(f"{name} low must be <= high, got {value!r}")
    return float(low), float(high)
