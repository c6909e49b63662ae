"""`sparserl presets`: the training modes, their rollouts and corrections."""

from __future__ import annotations

from .base import command


@command("presets", "list the training modes: rollouts and corrections of each (--mode NAME)")
def _presets(args) -> int:
    from ..config.presets import presets_table

    print(presets_table())
    print("\nA field given on the command line or in --config overrides the preset's; a preset of your own is "
          "a YAML file (--mode FILE.yaml, see sparserl/config/presets.py).")
    return 0
