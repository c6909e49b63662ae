"""Values as users write them (YAML scalars, command-line strings) turned into a setting's type: one rule for
the config file, the flags and a preset file's corrections."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from ..errors import ConfigError


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert `value` (from YAML or a command line string) to `annotation`, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return _union(value, args, key)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(coerce(v, a, key) for v, a in zip(items, args))
    scalar = _SCALARS.get(annotation) if isinstance(annotation, type) else None
    if scalar is None:
        raise ConfigError(f"{key}: unsupported type {annotation}")
    return scalar(value, key)


def _union(value: Any, options: tuple, key: str) -> Any:
    """None for none/null where the union allows it, else the first option that takes `value`."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in options:
            return None
    errors = []
    for option in (a for a in options if a is not type(None)):
        try:
            return coerce(value, option, key)
        except ConfigError as error:
            errors.append(str(error))
    raise ConfigError(errors[0] if errors else f"{key}: {value!r} is not allowed")


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _int(value: Any, key: str) -> int:
    """An integer, also from a whole float ("3", 3.0, "1e3"), never from a bool."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if not as_float.is_integer():
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return int(as_float)


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None


def _str(value: Any, key: str) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return str(value)


_SCALARS: dict[type, Callable[[Any, str], Any]] = {bool: _bool, int: _int, float: _float, str: _str}
