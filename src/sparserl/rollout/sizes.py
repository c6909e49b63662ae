"""Memory sizes as a user writes them: 64MiB, 20GiB, 1.5g, 4096 (bytes), or auto."""

from __future__ import annotations

import re

from ..errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_memory(text: str) -> int | str:
    """Bytes in `text` ("64MiB", "20GiB", "1.5g", "4096"; binary units), or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"rollout_kv_memory: {text!r} is not a size; give e.g. 64MiB, 20GiB or auto")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"rollout_kv_memory must be positive, got {text!r}")
    return size
