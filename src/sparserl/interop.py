"""Our corrections on TRL's and verl's batches, for users of those trainers.

Both libraries already carry what the filters need: the trainer's log-probs of the sampled tokens
(π_old), the sampler's (vLLM, SGLang, or a compressed-cache engine) and the response mask. These
functions read them under each library's names and return our `Corrections`: multiply the per-token
loss by `weights` and mask it with `keep_mask`. docs/interop.md has a runnable example.

- TRL `GRPOTrainer` (the dict `_generate_and_score_completions` returns): `old_per_token_logps`,
  `sampling_per_token_logps`, `completion_mask`. When TRL skips π_old (one optimizer step per
  batch), pass the current `per_token_logps`, detached, as `old`.
- verl (`DataProto.batch`): `old_log_probs`, `rollout_log_probs`, `response_mask`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .config.corrections import CorrectionConfig
from .config.presets import load_preset
from .learner.corrections import Corrections, compute_corrections


def _config(correction: CorrectionConfig | str) -> CorrectionConfig:
    return load_preset(correction).correction if isinstance(correction, str) else correction


def _take(batch: Mapping, key: str, library: str) -> torch.Tensor:
    value = batch.get(key) if hasattr(batch, "get") else batch[key]
    if value is None:
        raise KeyError(f"{library} batch has no {key!r}; the corrections need the sampler's and the trainer's "
                       "log-probs of the sampled tokens and the response mask")
    return value


def corrections_from_trl(batch: Mapping, correction: CorrectionConfig | str = "sparse-tis",
                         old: torch.Tensor | None = None) -> Corrections:
    """Corrections for a TRL GRPO batch. `correction`: a preset name or a `CorrectionConfig`.

    Tensors are [B, T] over the completion tokens; `old` overrides `old_per_token_logps`.
    """
    logp_old = old if old is not None else _take(batch, "old_per_token_logps", "TRL")
    return compute_corrections(logp_old, _take(batch, "sampling_per_token_logps", "TRL"),
                               _take(batch, "completion_mask", "TRL"), _config(correction))


def corrections_from_verl(batch: Mapping, correction: CorrectionConfig | str = "sparse-tis") -> Corrections:
    """Corrections for a verl batch (`DataProto.batch`, or any mapping with its keys); [B, T] tensors."""
    return compute_corrections(_take(batch, "old_log_probs", "verl"), _take(batch, "rollout_log_probs", "verl"),
                               _take(batch, "response_mask", "verl"), _config(correction))
