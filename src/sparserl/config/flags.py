"""Command-line flags from the config dataclasses: one `--flag` per field, with its help and default.

The flags are generated from `sparserl.config.schema` (field types, the trailing `# comments` as help),
so a new config field is a new flag with no change here.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Literal

from .schema import MODES, _sections, field_help, field_index


def add_config_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                         skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per config field, grouped by section, with its one-line help, valid values and
    default. `only` names the sections (or single fields) a command uses; `skip` drops fields."""
    index = field_index()
    helps = {name: text for cls in _sections().values() for name, text in field_help(cls).items()}
    groups = {name: parser.add_argument_group(f"{name} settings") for name in _sections()
              if only is None or name in only or any(index[f][0] == name for f in only if f in index)}
    for name, (section, annotation, default) in index.items():
        if name in skip or section not in groups or (only is not None and section not in only and name not in only):
            continue
        shown = "none" if default is None else ",".join(map(str, default)) if isinstance(default, tuple) else default
        if section == "correction":
            shown = "set by --mode"
        groups[section].add_argument(
            "--" + name.replace("_", "-"), dest=f"cfg__{name}", default=None, **given_alone(annotation),
            metavar=_named_choices(name) or _metavar(annotation),
            help=_with_default(helps.get(name, ""), shown).replace("%", "%%"))  # argparse formats help with %


def given_alone(annotation: Any) -> dict[str, str]:
    """For a yes/no setting, what lets its flag alone mean yes (`--overwrite`, as `--overwrite true`)."""
    return {"nargs": "?", "const": "true"} if annotation is bool else {}


def _with_default(text: str, shown: Any) -> str:
    """The field's help and its default, unless its comment says the default in its own words."""
    return text if "(default:" in text else f"{text} (default: {shown})"


def _named_choices(name: str) -> str | None:
    """The valid values of the string fields that name a registered thing."""
    if name == "kv_policy":
        from ..rollout.sparsity.policies import POLICIES

        return "{" + ",".join(sorted(POLICIES)) + "}"
    if name == "speculative_draft":
        from ..rollout.speculative.drafts import DRAFTS

        return "{" + ",".join(sorted(DRAFTS)) + "}"
    if name == "rollout_backend":
        from ..rollout.dispatch.backends import BACKENDS

        return "{auto," + ",".join(sorted(BACKENDS)) + "}"
    if name == "task":
        from ..tasks.registry import task_names

        return "{" + ",".join(task_names()) + "}"
    if name == "mode":
        return "{" + ",".join(MODES) + "}|FILE.yaml"
    return None


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__") and v is not None}


def _metavar(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        return str(values[0]) if len(values) == 1 else "{" + ",".join(map(str, values)) + "}"
    if typing.get_origin(annotation) is tuple:
        return ",".join(["LOW", "HIGH"] if len(typing.get_args(annotation)) == 2 else ["VALUE"] * 3)
    names = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}
    if annotation in names:
        return names[annotation]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args:
        inner = "|".join(_metavar(a) for a in args)
        return f"{inner}|none" if type(None) in typing.get_args(annotation) else inner
    return "VALUE"
