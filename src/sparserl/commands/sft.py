"""`sparserl sft`: a short supervised warm start of a model on a task's demonstrations (`experiments/sft.py`)."""

from __future__ import annotations

import json

from .base import command, common_arguments


def _arguments(sub) -> None:
    import dataclasses
    import typing

    from ..config.flags import add_config_arguments
    from ..config.schema import SFTConfig, field_help

    common_arguments(sub)
    hints, helps = typing.get_type_hints(SFTConfig), field_help(SFTConfig)
    for f in dataclasses.fields(SFTConfig):
        sub.add_argument("--" + f.name.replace("_", "-"), dest=f"sft__{f.name}", default=None,
                         metavar=hints[f.name].__name__.upper(), help=f"{helps.get(f.name, '')} (default: {f.default})")
    add_config_arguments(sub, only=("model", "task", "seed"), skip=("out",))


@command("sft", "warm-start a model on a task's demonstrations, stopped where RL has room to improve", _arguments)
def _sft(args) -> int:
    import typing

    from ..config.schema import SFTConfig, coerce
    from ..experiments.sft import sft
    from .base import config_from_args

    hints = typing.get_type_hints(SFTConfig)
    values = {k[5:]: coerce(v, hints[k[5:]], k[5:]) for k, v in vars(args).items()
              if k.startswith("sft__") and v is not None}
    card = sft(config_from_args(args), SFTConfig(**values))
    print(json.dumps({k: v for k, v in card.items() if k not in ("history", "settings")}, indent=2))
    return 0
