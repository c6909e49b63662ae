"""Our corrections on TRL's and verl's batches, for users of those trainers.

Both libraries already carry what the filters need: the trainer's log-probs of the sampled tokens
(π_old), the sampler's (vLLM, SGLang, or a compressed-cache engine) and the response mask. These
functions read them under each library's names and return our `Corrections`: multiply the per-token
loss by `weights` and mask it with `keep_mask`. docs/interop.md has a runnable example.

- TRL `GRPOTrainer` (the dict `_generate_and_score_completions` returns): `old_per_token_logps`,
  `sampling_per_token_logps`, `completion_mask`. When TRL skips π_old (one optimizer step per
  batch), pass the current `per_token_logps`, detached, as `old`.
- verl (`DataProto.batch`): `old_log_probs`, `rollout_log_probs`, `response_mask`; and
  `verl_rollout_correction`: a preset as verl's own `algorithm.rollout_correction` settings, with how exact.

Inside TRL's trainer itself, `sparserl.integrations.trl` samples and corrects (docs/interop.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .config.corrections import CorrectionConfig
from .config.presets import dense_learner_correction
from .learner.corrections import Corrections, compute_corrections


def _take(batch: Mapping, key: str, library: str) -> torch.Tensor:
    value = batch.get(key) if hasattr(batch, "get") else batch[key]
    if value is None:
        raise KeyError(f"{library} batch has no {key!r}; the corrections need the sampler's and the trainer's "
                       "log-probs of the sampled tokens and the response mask")
    return value


def corrections_from_trl(batch: Mapping, correction: CorrectionConfig | str = "sparse-tis",
                         old: torch.Tensor | None = None) -> Corrections:
    """Corrections for a TRL GRPO batch. `correction`: a preset's name, a preset YAML file or a `CorrectionConfig`.

    Tensors are [B, T] over the completion tokens; `old` overrides `old_per_token_logps`.
    """
    config = dense_learner_correction(correction, "TRL's GRPOTrainer")
    logp_old = old if old is not None else _take(batch, "old_per_token_logps", "TRL")
    return compute_corrections(logp_old, _take(batch, "sampling_per_token_logps", "TRL"),
                               _take(batch, "completion_mask", "TRL"), config)


def corrections_from_verl(batch: Mapping, correction: CorrectionConfig | str = "sparse-tis") -> Corrections:
    """Corrections for a verl batch (`DataProto.batch`, or any mapping with its keys); [B, T] tensors."""
    config = dense_learner_correction(correction, "verl")
    return compute_corrections(_take(batch, "old_log_probs", "verl"), _take(batch, "rollout_log_probs", "verl"),
                               _take(batch, "response_mask", "verl"), config)


# --------------------------------------------------------------------------------- verl's settings
@dataclass(frozen=True)
class VerlSettings:
    """A correction as verl 0.9's `algorithm.rollout_correction` writes it (always `bypass_mode: false`: our
    corrections compare the sampler with a dense π_old the actor recomputes), how closely verl reproduces it
    (`exact`, `approximate` or `partial`, where some part has no verl counterpart), and what differs."""

    settings: dict
    match: str
    notes: tuple[str, ...]


def verl_rollout_correction(correction: CorrectionConfig | str) -> VerlSettings:
    """verl's `algorithm.rollout_correction` for a correction (a preset's name or a `CorrectionConfig`).

    verl (`trainer/ppo/rollout_corr_helper.py`) tests k1 = −log ξ against "lo_hi" bounds on π_rollout / π_old, so
    our bounds on ξ are written inverted: [a, b] becomes "1/b_1/a". Its token veto
    (`rollout_token_veto_threshold`) was removed in verl#4544 (v0.7.1); the nearest setting is the sequence
    guard `seq_max_k2` at (ln 1/τ)² / 2, which rejects a sequence holding a token with ξ < τ, as the veto does,
    and also one holding a token with ξ > 1/τ, which ours keeps.
    """
    config = dense_learner_correction(correction, "verl")
    mapped = _Mapped({"bypass_mode": False, "rollout_is": None, "rollout_rs": None})
    if config.is_mode != "none":
        _map_weights(config, mapped)
    rejections = _map_rejections(config, mapped)
    if rejections:
        mapped.settings["rollout_rs"] = ",".join(name for name, _ in rejections)
        thresholds = [threshold for _, threshold in rejections]
        mapped.settings["rollout_rs_threshold"] = thresholds[0] if len(thresholds) == 1 else \
            ",".join(str(t) if isinstance(t, str) else repr(t) for t in thresholds)
    return VerlSettings(mapped.settings, mapped.match, tuple(mapped.notes))


@dataclass
class _Mapped:
    """verl's settings as they are worked out, how closely they match so far, and what differs."""

    settings: dict
    match: str = "exact"
    notes: list[str] = field(default_factory=list)

    def worse(self, to: str, note: str) -> None:
        """The match falls to `to` (partial stays partial), for the reason `note`."""
        self.match = "partial" if "partial" in (self.match, to) else to
        self.notes.append(note)


def _map_weights(config: CorrectionConfig, mapped: _Mapped) -> None:
    """The importance weights as verl's `rollout_is`, where verl has them."""
    if config.is_level == "geometric" or config.is_mode == "clip":
        missing = "geometric-mean" if config.is_level == "geometric" else "two-sided clip"
        mapped.worse("partial", f"verl has no {missing} importance weight: weights are not carried over")
        return
    mapped.settings["rollout_is"] = config.is_level
    # IcePop's "lo_hi" zeroes weights outside [lo, hi]; ours are at least e^-20, so 1e-9 is no bound.
    mapped.settings["rollout_is_threshold"] = (config.is_cap if config.is_mode == "truncate"
                                               else f"1e-09_{config.is_cap!r}")
    mapped.settings["rollout_is_batch_normalize"] = config.batch_normalize
    if config.batch_normalize and config.is_level == "sequence":
        mapped.worse("approximate", "verl normalises sequence weights by their mean over sequences, ours by their "
                                    "mean over tokens")
    elif config.batch_normalize:
        mapped.notes.append("verl's batch mean adds 1e-8 to its token count (weights within 1e-8 relative)")


def _map_rejections(config: CorrectionConfig, mapped: _Mapped) -> list[tuple[str, str | float]]:
    """The filters as verl's `rollout_rs` criteria with their thresholds, in verl's order."""
    rejections: list[tuple[str, str | float]] = []
    if config.band is not None:
        low, high = config.band
        rejections.append(("token_k1", f"{1 / high!r}_{1 / low!r}"))
    if config.seq_geo_bounds is not None:
        low, high = config.seq_geo_bounds
        rejections.append(("seq_mean_k1", f"{1 / high!r}_{1 / low!r}"))
    if config.seq_k3_max is not None:
        rejections.append(("seq_mean_k3", config.seq_k3_max))
    guards = [config.seq_log_ratio_max ** 2 / 2] if config.seq_log_ratio_max is not None else []
    if config.veto_threshold is not None and config.veto_scope == "prefix":
        mapped.worse("partial", "verl has no prefix veto: the tokens after a vetoing one stay in its loss")
    elif config.veto_threshold is not None:
        guards.append(math.log(1 / config.veto_threshold) ** 2 / 2)
        mapped.worse("approximate", f"the veto becomes seq_max_k2, which also rejects a sequence holding a token with "
                                    f"ξ > {1 / config.veto_threshold:g} (ours keeps it)")
    if guards:
        rejections.append(("seq_max_k2", min(guards)))
    return rejections
