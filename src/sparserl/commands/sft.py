"""`sparserl sft`: a short supervised warm start of a model on a task's demonstrations (`experiments/sft.py`)."""

from __future__ import annotations

import json

from .base import command, common_arguments, settings_arguments


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments
    from ..config.schema import SFTConfig

    common_arguments(sub)
    settings_arguments(sub, SFTConfig, "sft__")
    add_config_arguments(sub, only=("model", "task", "seed"))


@command("sft", "warm-start a model on a task's demonstrations, stopped where RL has room to improve", _arguments)
def _sft(args) -> int:
    from ..experiments.sft import sft

    config, settings = sft_settings(args)
    card = sft(config, settings)
    print(json.dumps({k: v for k, v in card.items() if k not in ("history", "settings")}, indent=2))
    return 0


def sft_settings(args):
    """(the experiment config, the `SFTConfig`) of `sparserl sft`'s arguments. A `--config` file gives the model
    and task settings, and the warm start's own under an `sft:` section; the flags go on top. A training setting in
    the file whose name is also one of sft's (`lr`, `steps`) is refused: it would read as sft's and is not."""
    import dataclasses
    import typing
    from pathlib import Path

    from ..config.flags import overrides_from_args
    from ..config.schema import SFTConfig, load_config, read_yaml
    from ..config.values import coerce
    from ..errors import ConfigError

    hints = typing.get_type_hints(SFTConfig)
    own = {f.name for f in dataclasses.fields(SFTConfig)}
    values = read_yaml(Path(args.config)) if args.config else {}
    section = values.pop("sft", None) or {}
    if not isinstance(section, dict) or set(section) - own:
        unknown = sorted(set(section) - own) if isinstance(section, dict) else section
        raise ConfigError(f"--config {args.config}: the sft section takes {', '.join(sorted(own))}; got {unknown}")
    clashes = sorted(set(values) & own)
    if clashes:
        raise ConfigError(f"--config {args.config} sets {', '.join(clashes)} for training, which sparserl sft does not "
                          "read: put the warm start's own under an `sft:` section, or pass them as flags")
    config = load_config(None, {**values, **overrides_from_args(args)})
    given = {**section, **{k[5:]: v for k, v in vars(args).items() if k.startswith("sft__") and v is not None}}
    return config, SFTConfig(**{key: coerce(value, hints[key], key) for key, value in given.items()})
