"""Where a step's shards are sampled: the registry of dispatch backends, and the one the config asks for.

A backend is a class in a file of its own, registered with `@register_backend(NAME)`, with
`from_config(config, model, adapter, device)`, `sync_weights(model, version)`,
`generate(shards, sampling, spec) -> StepRollouts` and `close()`; a new one is that file plus its import in
`dispatch/__init__.py`. `local` samples with the trainer's model (`local.py`); `ray` on Ray actors that hold
a copy of it (`ray_workers.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from ...errors import ConfigError

BACKENDS: dict[str, type] = {}


def register_backend(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        BACKENDS[name] = cls
        return cls
    return register


def backend_name(rollout) -> str:
    """The backend a `RolloutConfig` asks for: `rollout_backend`, where `auto` is ray with `--rollout-workers`
    and local without."""
    if rollout.rollout_backend != "auto":
        return rollout.rollout_backend
    return "ray" if rollout.rollout_workers else "local"


def make_rollouts(config, model, adapter, device):
    """The dispatch backend of `config.rollout`, sampling with `model` (and DistillSparse's `adapter`)."""
    name = backend_name(config.rollout)
    if name not in BACKENDS:
        raise ConfigError(f"rollout_backend {name!r} is unknown; choose one of auto, {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name].from_config(config, model, adapter, device)
