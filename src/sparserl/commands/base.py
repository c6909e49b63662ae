"""What every command shares: the `Command` registry (`@command`), the common flags, and the small parsers and
writers of the commands' own arguments. Nothing here imports torch: `sparserl --help` answers at once."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, what adds its flags to its parser, what runs it (an exit code), and its
    flags renamed lately (old -> new), so that an old command line is told the new name."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    renamed: dict[str, str] = field(default_factory=dict)

    def renamed_in(self, argv: list[str]) -> list[str]:
        """One "--old is now --new" for each renamed flag in `argv` (`--old` or `--old=V`)."""
        return [f"{old} is now {self.renamed[old]}" for old in (arg.split("=", 1)[0] for arg in argv)
                if old in self.renamed]


COMMANDS: dict[str, Command] = {}  # filled by @command, in the order `commands/__init__.py` imports them


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda sub: None,
            renamed: dict[str, str] | None = None):
    """Register the decorated function as `sparserl NAME`; `renamed`: its old flags and their new names."""
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = Command(help, add_arguments, run, dict(renamed or {}))
        return run
    return register


def common_arguments(sub: argparse.ArgumentParser, out_help: str | None = None) -> None:
    sub.add_argument("--config", metavar="FILE", help="YAML config applied before the flags")
    if out_help:
        sub.add_argument("--out", required=True, metavar="FILE.json", help=out_help)


def settings_arguments(sub: argparse.ArgumentParser, settings_class: type, prefix: str) -> None:
    """One `--flag` per field of a command's own settings dataclass (`SFTConfig`, `WarmupConfig`), into
    `args.<prefix><field>` (None when not given), with the field's comment as help; a yes/no setting given alone
    means yes. Fields without a default are set in code, not by flags."""
    import dataclasses
    import typing

    from ..config.flags import given_alone
    from ..config.schema import field_help

    hints, helps = typing.get_type_hints(settings_class), field_help(settings_class)
    for f in dataclasses.fields(settings_class):
        if f.default is dataclasses.MISSING:
            continue
        sub.add_argument("--" + f.name.replace("_", "-"), dest=prefix + f.name, default=None,
                         **given_alone(hints[f.name]),
                         metavar=hints[f.name].__name__.upper(), help=f"{helps.get(f.name, '')} (default: {f.default})")


def inference_fields(*rollout: str, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The config flags of an inference command: the model and the task sections, the seed, the sparse sampler's
    settings and its KV storage (`kv_dtype`), the limits on rows in flight (`config.schema`), the rollout fields
    `rollout` it also reads, less `skip`. None of training's, Ray's, the speculative sampler's or an adaptive
    schedule's."""
    from ..config.schema import DECODE_FIELDS, KV_STORAGE_FIELDS, SPARSITY_FIELDS

    return tuple(f for f in ("model", "task", "seed", *SPARSITY_FIELDS, *KV_STORAGE_FIELDS, *DECODE_FIELDS, *rollout)
                 if f not in skip)


def inference_arguments(sub, out_help: str, fields: tuple[str, ...]) -> None:
    from ..config.flags import add_config_arguments

    common_arguments(sub, out_help)
    sub.add_argument("--n", type=int, default=200, help="held-out prompts (default: 200)")
    add_config_arguments(sub, only=fields)


def config_from_args(args):
    from ..config.flags import overrides_from_args
    from ..config.schema import load_config

    return load_config(args.config, overrides_from_args(args))


WEIGHT_FIELDS = ("is_cap", "is_level", "batch_normalize")  # what shapes an importance weight, idle under unit weights


def refuse_idle_weight_flags(args, configs) -> None:
    """A `--is-cap`, `--is-level` or `--batch-normalize` typed for modes that all weight by ones (is_mode none:
    dense, naive-sparse and the presets that only reject) would change nothing: say so rather than run without it.
    Only typed flags are checked: a run's saved config.yaml names every field, the idle ones too."""
    from ..config.flags import overrides_from_args
    from ..errors import ConfigError

    typed = [name for name in WEIGHT_FIELDS if name in overrides_from_args(args)]
    unweighted = [config.train.mode for config in configs if config.correction.is_mode == "none"]
    if typed and configs and len(unweighted) == len(configs):
        flags = ", ".join("--" + name.replace("_", "-") for name in typed)
        modes = f"mode {unweighted[0]} weights" if len(unweighted) == 1 else f"modes {', '.join(unweighted)} weight"
        raise ConfigError(f"{flags} would do nothing: {modes} every token by 1 (is_mode none); "
                          "add --is-mode truncate|clip|mask to weight by ξ, or drop it")


def refuse_adaptive_schedule(config, command: str) -> None:
    """An adaptive schedule moves the budget between training steps from the α it measures: an inference command
    would only ever sample at its starting budget."""
    from ..errors import ConfigError

    if config.rollout.kv_schedule == "adaptive":
        raise ConfigError(f"sparserl {command}: --kv-schedule adaptive adapts during training only; give a fixed "
                          "--kv-budget or a calibrated schedule file (`sparserl calibrate`)")


def int_list(text: str, flag: str, minimum: int) -> list[int]:
    from ..config.values import coerce
    from ..errors import ConfigError

    values = [coerce(item.strip(), int, flag) for item in text.split(",") if item.strip()]
    if not values or min(values) < minimum:
        raise ConfigError(f"--{flag} {text!r}: give one or more comma-separated integers >= {minimum}")
    return values


def check_ranges(args, bounds: dict[str, tuple[float, float, str]]) -> None:
    """Refuse a command's own numeric flags outside their range at once: {dest: (low, high, meaning)}."""
    from ..errors import ConfigError

    for dest, (low, high, meaning) in bounds.items():
        value = getattr(args, dest)
        if not low <= value <= high:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} {value:g} is out of range: {meaning}")


def write_json(out: Path, result: dict) -> None:
    _write_text(out, json.dumps(result, indent=2) + "\n", "--out", "eval.json")


def write_jsonl(out: Path, records: list[dict], flag: str) -> None:
    """`records` a JSON line each, in the file a command's `flag` names."""
    _write_text(out, "".join(json.dumps(record) + "\n" for record in records), flag, "answers.jsonl")


def check_output_file(out: Path, flag: str, example_name: str) -> None:
    """Refuse, before any work, a file path that cannot be written: a directory, or one under a file or a directory
    this user cannot write to."""
    import os

    from ..errors import ConfigError

    if out.is_dir():
        raise ConfigError(f"{flag} {out} is a directory; give a file name such as {out / example_name}")
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise ConfigError(f"{flag} {out}: {ancestor} is {'a file' if not ancestor.is_dir() else 'not writable'}; "
                          "choose a writable path")


def _write_text(out: Path, text: str, flag: str, example_name: str) -> None:
    from ..errors import ConfigError

    check_output_file(out, flag, example_name)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as error:
        raise ConfigError(f"{flag} {out}: cannot write there ({error.strerror}); choose a writable path") from None
