"""`sparserl compare`: modes over seeds, and the paper-style report (`experiments/compare.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import command, common_arguments, int_list, refuse_idle_weight_flags

if TYPE_CHECKING:
    from ..config.presets import Preset


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments
    from ..config.presets import DEFAULT_COMPARE

    common_arguments(sub)
    default = ",".join(DEFAULT_COMPARE)
    sub.add_argument("--modes", default=default,
                     help=f"comma-separated modes to run (default: {default}; add others from `sparserl presets`, "
                          "e.g. sparse-tis,sparse-rs for the ablations)")
    sub.add_argument("--seeds", default=None, metavar="S,S,...",
                     help="comma-separated seeds, each a full set of runs (default: --seed); cells are reported as "
                          "mean (min–max) over them")
    add_config_arguments(sub, skip=("mode",))


@command("compare",
         "run dense, naive-sparse, sparse-rl (and ablations) over seeds and write the report",
         _arguments)
def _compare(args) -> int:
    from ..config.flags import overrides_from_args
    from ..config.presets import DEFAULT_COMPARE
    from ..config.schema import load_config, switched_off
    from ..experiments.compare import run_compare

    overrides = overrides_from_args(args)

    def config_for_mode(mode: str):
        settings = {**overrides, "mode": mode}
        preset = _preset_or_none(mode)  # None: run_compare names the unknown mode
        # DistillSparse, recalibration and a quantized cache belong to sparse samplers: the dense baseline samples
        # without (its sparse-inference evaluation is then in the model's dtype, and the report compares it only with
        # runs evaluated through the same sampler); a full cache has no budget to recalibrate.
        if preset is not None and not preset.sparse_rollouts:
            settings.update(switched_off("distill_sparse", "recalibrate_every"), kv_dtype="auto")
        elif preset is not None and preset.rollout.get("sparsity") == "none":
            settings.update(switched_off("recalibrate_every"))
        return load_config(args.config, settings)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    seeds = [config_for_mode(modes[0] if modes else DEFAULT_COMPARE[0]).train.seed] if args.seeds is None \
        else int_list(args.seeds, "seeds", minimum=0)
    if all(_preset_or_none(mode) is not None for mode in modes):  # else run_compare names the unknown one
        refuse_idle_weight_flags(args, [config_for_mode(mode) for mode in modes])
    run_compare(config_for_mode, modes, seeds)
    return 0


def _preset_or_none(mode: str) -> Preset | None:
    from ..config.presets import PresetError, load_preset

    try:
        return load_preset(mode)
    except PresetError:
        return None
