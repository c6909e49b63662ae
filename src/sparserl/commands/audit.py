"""`sparserl audit`: where sparse pointer-walk rollouts first go wrong, and what was evicted (`experiments/audit.py`)."""

from __future__ import annotations

from pathlib import Path

from .base import (
    check_output_file,
    check_ranges,
    command,
    config_from_args,
    inference_arguments,
    inference_fields,
    refuse_adaptive_schedule,
)


def _arguments(sub) -> None:
    # Greedy rollouts: no temperature.
    inference_arguments(sub, "where to write the results (a Markdown table goes beside it, FILE.md)",
                        inference_fields())


@command("audit",
         "pointer walk: where sparse rollouts first go wrong, and whether the token they needed was evicted",
         _arguments)
def _audit(args) -> int:
    from ..experiments.audit import audit_table, run_audit, write_audit

    check_output_file(Path(args.out), "--out", "audit.json")
    check_ranges(args, {"n": (1, float("inf"), "the number of held-out prompts, at least 1")})

    config = config_from_args(args)
    refuse_adaptive_schedule(config, "audit")
    result = run_audit(config, n=args.n)
    write_audit(result, Path(args.out))
    print(audit_table(result))
    return 0
