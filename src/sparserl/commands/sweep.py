"""`sparserl sweep`: accuracy, veto rate and KV saved at each KV budget and KV storage, and the two regimes
(`experiments/sweep.py`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .base import (
    check_output_file,
    check_ranges,
    command,
    config_from_args,
    inference_arguments,
    inference_fields,
    int_list,
)


def _arguments(sub) -> None:
    # --budgets is the budget and --kv-dtypes the KV storage; the sampled rollouts that measure the veto read the
    # temperature.
    inference_arguments(sub, "where to write the results (a Markdown table goes beside it, FILE.md)",
                        inference_fields("temperature", skip=("kv_budget", "kv_schedule", "kv_dtype")))
    sub.add_argument("--budgets", default="24,32,40,48,56,64,72,80,88,96", metavar="B,B,...",
                     help="comma-separated KV budgets (default: 24,32,...,96)")
    sub.add_argument("--kv-dtypes", default=None, metavar="D,D,...",
                     help="comma-separated KV storages to try at every budget, of auto (the model's dtype), fp8, "
                          "int8; a quantized one is also tried without eviction (default: the config's kv_dtype, "
                          "auto)")
    sub.add_argument("--sample-prompts", type=int, default=16,
                     help="prompts for the sampled rollouts that measure veto and band rates (default: 16)")
    sub.add_argument("--samples", type=int, default=8, help="samples per prompt for those rollouts (default: 8)")


def kv_dtype_list(text: str | None, config) -> tuple[str, ...]:
    """The KV storages of `--kv-dtypes` (None: the config's kv_dtype), each checked against the config as `train`
    checks `--kv-dtype`: block attention and speculative rollouts are refused a quantized cache in one line."""
    from ..config.validation import validate
    from ..errors import ConfigError
    from ..rollout.quantization import KV_DTYPES

    if text is None:
        return (config.rollout.kv_dtype,)
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in KV_DTYPES]
    if not names or unknown or len(set(names)) != len(names):
        why = f"{', '.join(unknown)} unknown" if unknown else "each at most once"
        raise ConfigError(f"--kv-dtypes {text!r}: give one or more of {', '.join(KV_DTYPES)}, comma-separated ({why})")
    for name in names:
        try:
            validate(dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, kv_dtype=name)))
        except ConfigError as error:
            raise ConfigError(f"--kv-dtypes {name}: {error}") from None
    return tuple(names)


@command("sweep", "accuracy, veto rate and KV saved at each KV budget and KV storage; names the two regimes",
         _arguments)
def _sweep(args) -> int:
    from ..errors import ConfigError
    from ..experiments.sweep import run_sweep, sweep_table, write_sweep

    check_output_file(Path(args.out), "--out", "sweep.json")
    check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1"),
                        "sample_prompts": (1, float("inf"), "prompts for the sampled rollouts, at least 1"),
                        "samples": (1, float("inf"), "samples per prompt, at least 1")})

    budgets = int_list(args.budgets, "budgets", minimum=1)
    config = config_from_args(args)
    below = [b for b in budgets if b <= config.rollout.kv_window]
    if below:
        raise ConfigError(f"--budgets: {', '.join(map(str, below))} do(es) not exceed kv_window "
                          f"({config.rollout.kv_window}), which every budget must (as `train` requires of --kv-budget)")
    if config.rollout.kv_schedule:
        raise ConfigError(f"sparserl sweep tries the fixed budgets of --budgets; the config's kv_schedule "
                          f"({config.rollout.kv_schedule}) would override them: leave it out")
    kv_dtypes = kv_dtype_list(args.kv_dtypes, config)
    result = run_sweep(config, budgets, n=args.n, samples=args.samples,
                       sample_prompts=args.sample_prompts, kv_dtypes=kv_dtypes)
    write_sweep(result, Path(args.out))
    print(sweep_table(result))
    return 0
