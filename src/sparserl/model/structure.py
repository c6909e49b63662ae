"""What the rest of the package reads of a model's structure: its language model's config, each decoder layer's
kind and attention window, the positions of left-padded rows (which count real tokens only), whether its RoPE
depends on the sequence's length, and the name its forward takes a KV cache under."""

from __future__ import annotations

import inspect

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids `[N, S]` that count real tokens only (left padding gets 0)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def text_config(model):
    """The language model's own config: a multimodal model's text part, else the model's config itself."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    """Each decoder layer's kind: the config's `layer_types`, or full attention throughout."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return list(kinds[: config.num_hidden_layers])


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's attention window (None: none), as transformers masks them: the sliding layers' of
    `layer_types` where the config has them (Gemma-2/3, Qwen2), else every layer's when it sets
    `sliding_window` (Mistral, Phi-3, Mixtral, Starcoder2)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None) is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types(config)]


# RoPE variants whose frequencies depend on the longest position of the forward that computes them (transformers'
# `dynamic_rope_update`): a forward over part of a sequence rotates its tokens otherwise than one over all of it.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def rope_depends_on_length(config) -> bool:
    """Whether some layer's rotary embedding is `LENGTH_DEPENDENT_ROPE` (dynamic NTK, Phi-3's LongRoPE); the config's
    `rope_parameters` are one mapping, or one per layer kind (Gemma-3)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = [parameters.get("rope_type")] if "rope_type" in parameters else \
        [p.get("rope_type") for p in parameters.values() if isinstance(p, dict)]
    return any(kind in LENGTH_DEPENDENT_ROPE for kind in kinds)


def cache_keyword(model) -> str:
    """The name under which the model's forward takes the KV cache: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); earlier 5.x know only the old."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
