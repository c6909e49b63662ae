"""`sparserl calibrate`: Sparrow's KV budget schedule for an α tail (`experiments/calibrate.py`)."""

from __future__ import annotations

import sys

from .base import check_ranges, command, common_arguments, config_from_args, inference_fields

# The calibration's own settings are the config's (`train --recalibrate-every` runs the same search with them): one
# flag each, and a config file sets them too.
CALIBRATION_FIELDS = ("alpha_tau", "calibration_budgets", "alpha_bin_size", "calibration_prompts",
                      "calibration_samples")


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments

    common_arguments(sub)
    sub.add_argument("--out", required=True, metavar="DIR",
                     help="where schedule.yaml, tails.png, calibration.md and calibration.json go")
    # It tries the budgets of --calibration-budgets, under the sampled rollouts' temperature.
    add_config_arguments(sub, only=inference_fields("temperature", *CALIBRATION_FIELDS,
                                                    skip=("kv_budget", "kv_schedule")))


@command("calibrate",
         "per cached-length bin, the smallest KV budget whose acceptance-rate tail stays >= tau (Sparrow)",
         _arguments,
         # renamed on 2026-11-28 to the config's names, shared with `train --recalibrate-every`
         renamed={"--tau": "--alpha-tau", "--budgets": "--calibration-budgets", "--bin-size": "--alpha-bin-size",
                  "--prompts": "--calibration-prompts", "--samples": "--calibration-samples"})
def _calibrate(args) -> int:
    from ..config.validation import calibration_budgets
    from ..experiments.calibrate import calibration_table, run_calibration
    from ..train.layout import CALIBRATION_PLOT_FILE, SCHEDULE_FILE
    from ..train.run_dir import check_output_dir

    out = check_output_dir(args.out)
    config = config_from_args(args)
    rollout = config.rollout
    check_ranges(rollout, {"calibration_prompts": (1, float("inf"), "calibration prompts, at least 1"),
                           "calibration_samples": (1, float("inf"), "sampled rollouts per prompt, at least 1")})
    budgets = calibration_budgets(rollout)
    if (out / SCHEDULE_FILE).exists():
        print(f"calibrate: replacing the calibration in {out}", file=sys.stderr)
    result = run_calibration(config, out, budgets, tau=rollout.alpha_tau,
                             bin_size=rollout.alpha_bin_size, prompts=rollout.calibration_prompts,
                             samples=rollout.calibration_samples)
    print(calibration_table(result))
    if result["kv_warning"]:
        print(f"calibrate: warning: {result['kv_warning']}", file=sys.stderr)
    print(f"\nschedule: {out / SCHEDULE_FILE} (use it with --kv-schedule); plot: {out / CALIBRATION_PLOT_FILE}")
    return 0
