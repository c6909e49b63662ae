"""`sparserl calibrate`: Sparrow's KV budget schedule for an α tail (`experiments/calibrate.py`)."""

from __future__ import annotations

from pathlib import Path

from .base import (
    INFERENCE_FIELDS,
    SAMPLER_ONLY,
    check_ranges,
    command,
    common_arguments,
    config_from_args,
    int_list,
)


def _arguments(sub) -> None:
    from ..config.flags import add_config_arguments

    common_arguments(sub)
    sub.add_argument("--out", required=True, metavar="DIR",
                     help="where schedule.yaml, tails.png, calibration.md and calibration.json go")
    sub.add_argument("--tau", type=float, default=0.86, help="the tail a bin's budget must reach (default: 0.86)")
    sub.add_argument("--budgets", default="24,32,40,48,56,64,72,80,96,128", metavar="B,B,...",
                     help="comma-separated KV budgets to try (default: 24,32,...,128)")
    sub.add_argument("--bin-size", type=int, default=16, help="cached-length bin in tokens (default: 16)")
    sub.add_argument("--prompts", type=int, default=32, help="calibration prompts, from the train split (default: 32)")
    sub.add_argument("--samples", type=int, default=4, help="sampled rollouts per prompt (default: 4)")
    add_config_arguments(sub, only=INFERENCE_FIELDS, skip=("out", "kv_budget", "kv_schedule") + SAMPLER_ONLY)


@command("calibrate",
         "per cached-length bin, the smallest KV budget whose acceptance-rate tail stays >= tau (Sparrow)",
         _arguments)
def _calibrate(args) -> int:
    from ..experiments.calibrate import calibration_table, run_calibration

    check_ranges(args, {"tau": (1e-9, 1.0, "τ is a probability: the α tail to reach, in (0, 1] (Sparrow uses 0.86)"),
                        "bin_size": (1, float("inf"), "a bin of cached length, at least 1 token"),
                        "prompts": (1, float("inf"), "calibration prompts, at least 1"),
                        "samples": (1, float("inf"), "sampled rollouts per prompt, at least 1")})

    budgets = int_list(args.budgets, "budgets", minimum=1)
    result = run_calibration(config_from_args(args), Path(args.out), budgets, tau=args.tau,
                             bin_size=args.bin_size, prompts=args.prompts, samples=args.samples)
    print(calibration_table(result))
    out = Path(args.out)
    print(f"\nschedule: {out / 'schedule.yaml'} (use it with --kv-schedule); plot: {out / 'tails.png'}")
    return 0
