"""`sparserl warmup`: the supervised warm start of the built-in model (`experiments/warmup.py`)."""

from __future__ import annotations

import json

from .base import command, settings_arguments


def _arguments(sub) -> None:
    from ..config.schema import WarmupConfig

    settings_arguments(sub, WarmupConfig, "dc__")


@command("warmup", "warm-start the built-in model by supervised learning", _arguments)
def _warmup(args) -> int:
    import typing

    from ..config.schema import WarmupConfig
    from ..config.values import coerce
    from ..experiments.warmup import warmup

    hints = typing.get_type_hints(WarmupConfig)
    values = {k[4:]: coerce(v, hints[k[4:]], k[4:]) for k, v in vars(args).items()
              if k.startswith("dc__") and v is not None}
    card = warmup(WarmupConfig(**values))
    print(json.dumps({k: v for k, v in card.items() if k not in ("probes", "settings")}, indent=2))
    return 0
